"""What `mpoverlap-check` estimates per rank: parameters (params.py), saved activations and
the schedule's in-flight microbatches (activations.py), communication in buffer and link
views (comm.py), and the whole (core.py)."""
from mpoverlap.overlap.estimate.activations import (Conventions, chunk_activation_bytes, head_activation_bytes,
                                                    layer_activation_bytes, stage_activation_peak)
from mpoverlap.overlap.estimate.comm import comm_ops, comm_views, link_factor
from mpoverlap.overlap.estimate.core import (RankEstimate, StageEstimate, compute_bytes, estimate,
                                             render_estimate)
from mpoverlap.overlap.estimate.params import (is_moe_layer, layer_params, stage_layers, stage_params)

__all__ = ["Conventions", "RankEstimate", "StageEstimate", "chunk_activation_bytes", "comm_ops", "comm_views",
           "compute_bytes", "estimate", "head_activation_bytes", "is_moe_layer", "layer_activation_bytes",
           "layer_params", "link_factor", "render_estimate", "stage_activation_peak", "stage_layers",
           "stage_params"]
