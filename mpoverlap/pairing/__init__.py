"""Forward/backward pairing (overlap.ep_pairing): one microbatch's expert all-to-alls in flight
under another microbatch's computation. tape.py: sub-steps and their mirrored backward;
steps.py: a GPT microbatch (or pipeline chunk) as sub-steps; executor.py: the pairing schedule
at pp 1; pipeline.py: pipeline chunks run as sub-step programs for the paired pipeline table's
FB actions (pp > 1, pipeline/paired.py)."""
from mpoverlap.pairing.executor import run_pair, train_paired

__all__ = ["run_pair", "train_paired"]
