"""Activation recomputation: keep a region's inputs, recompute the region in backward."""
from mpoverlap.recompute.checkpointing import RECOMPUTE_MODES, recomputed, recomputed_layers

__all__ = ["RECOMPUTE_MODES", "recomputed", "recomputed_layers"]
