"""Activation recomputation: keep a region's inputs, recompute the region in backward."""
from mpoverlap.recompute.checkpointing import RECOMPUTE_MODES, in_recompute_region, recomputed, recomputed_layers

__all__ = ["RECOMPUTE_MODES", "in_recompute_region", "recomputed", "recomputed_layers"]
