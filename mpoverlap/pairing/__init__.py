"""Forward/backward pairing (overlap.ep_pairing): one microbatch's expert all-to-alls in flight
under another microbatch's computation, at pp 1. tape.py: sub-steps and their mirrored
backward; steps.py: a GPT microbatch as sub-steps; executor.py: the pairing schedule."""
from mpoverlap.pairing.executor import run_pair, train_paired

__all__ = ["run_pair", "train_paired"]
