from mpoverlap.overlap.config import CommOverlapConfig, ModeState
from mpoverlap.overlap.rules import Problem, Rule, all_rules, validate

__all__ = ["CommOverlapConfig", "ModeState", "Problem", "Rule", "all_rules", "validate"]
