"""Step-time simulator and layout planner (`mpoverlap-check --simulate` / `--search`): a
hardware model (hardware.py), alpha-beta collectives (collectives.py), each overlap mode's
rule for what it hides (overlap.py), per-chunk costs (costs.py), a discrete-event run of the
pipeline schedule's action tables (engine.py), the step put together (core.py), the step's
printed report (report.py) and the planner (planner.py)."""
from mpoverlap.simulate.core import SimResult, simulate
from mpoverlap.simulate.hardware import Hardware, Link, from_config
from mpoverlap.simulate.report import render

__all__ = ["Hardware", "Link", "SimResult", "from_config", "render", "simulate"]
