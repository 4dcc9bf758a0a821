from mpoverlap.parallel.grid import GROUP_KINDS, RankCoords, RankGrid
from mpoverlap.parallel.state import ParallelState

__all__ = ["GROUP_KINDS", "RankCoords", "RankGrid", "ParallelState"]
