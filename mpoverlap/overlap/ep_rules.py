"""Expert-parallel and mixture-of-experts rules: expert placement, routing, MoE keys.

No rule ties EP overlap to the pipeline or to recomputation: the overlap chunks the tokens of
one MoE layer's forward and backward and waits every handle before the layer returns (or its
backward finishes), so nothing is in flight across a pipeline send or a layer boundary; full
activation recomputation replays a whole block's forward, dispatch and combine included, with
the same issue-and-wait order (Megatron's refusal concerns its overlap of one microbatch's
all-to-all with another's compute across layers, which mpoverlap does not do).
"""
from __future__ import annotations

from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, nearest_divisor, next_multiple, rule

DISPATCHERS = ("alltoall", "allgather")


@rule("ep.needs_experts", "ep", ("parallel.ep", "model.num_experts"),
      "expert parallelism needs a mixture-of-experts model")
def _needs_experts(lo: Layout):
    if lo.ep is not None and lo.ep > 1 and lo.cfg.model.num_experts == 0:
        yield Problem("ep.needs_experts", {"parallel.ep": lo.ep, "model.num_experts": 0},
                      "expert parallelism places experts on ranks; a dense model has none, so the ranks "
                      "would sit idle in a layout you did not mean", ["parallel.ep=1"])


@rule("ep.divides_dp_cp", "ep", ("parallel.ep", "parallel.dp", "parallel.cp"),
      "ep divides dp x cp (expert-parallel ranks are carved out of the data/context-parallel ranks)")
def _divides(lo: Layout):
    if None in (lo.ep, lo.dp, lo.cp):
        return
    n = lo.dp * lo.cp
    if n % lo.ep:
        yield Problem("ep.divides_dp_cp", {"parallel.ep": lo.ep, "parallel.dp": lo.dp, "parallel.cp": lo.cp},
                      f"the {n} data x context-parallel ranks of a pipeline stage split into groups of ep; "
                      f"{lo.ep} does not divide {n}", [f"parallel.ep={nearest_divisor(n, lo.ep)}"])


@rule("moe.experts_divisible_by_ep", "ep", ("model.num_experts", "parallel.ep"),
      "every expert-parallel rank holds the same number of experts")
def _experts(lo: Layout):
    E = lo.cfg.model.num_experts
    if lo.ep is not None and E > 0 and E % lo.ep:
        yield Problem("moe.experts_divisible_by_ep", {"model.num_experts": E, "parallel.ep": lo.ep},
                      f"each of the ep={lo.ep} ranks holds num_experts / ep experts",
                      [f"model.num_experts={next_multiple(E, lo.ep)}"])


@rule("moe.top_k_range", "ep", ("model.moe_top_k", "model.num_experts"),
      "each token picks between 1 and num_experts experts")
def _top_k(lo: Layout):
    m = lo.cfg.model
    if m.num_experts > 0 and not 1 <= m.moe_top_k <= m.num_experts:
        yield Problem("moe.top_k_range", {"model.moe_top_k": m.moe_top_k, "model.num_experts": m.num_experts},
                      "a token is routed to top_k distinct experts",
                      [f"model.moe_top_k={min(max(1, m.moe_top_k), m.num_experts)}"])


@rule("moe.values", "ep",
      ("model.num_experts", "model.moe_layer_freq", "model.moe_ffn_hidden_size", "model.moe_capacity_factor",
       "model.moe_aux_loss_coeff", "model.moe_z_loss_coeff", "model.moe_dispatcher", "overlap.ep_chunks"),
      "mixture-of-experts settings hold usable values")
def _values(lo: Layout):
    m, o = lo.cfg.model, lo.cfg.overlap
    checks = [
        ("model.num_experts", m.num_experts, m.num_experts >= 0, "must be 0 (dense) or a positive count", "0"),
        ("model.moe_layer_freq", m.moe_layer_freq, m.moe_layer_freq >= 1, "must be at least 1", "1"),
        ("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size,
         m.moe_ffn_hidden_size is None or m.moe_ffn_hidden_size >= 1, "must be positive (or null)", "null"),
        ("model.moe_capacity_factor", m.moe_capacity_factor,
         m.moe_capacity_factor is None or m.moe_capacity_factor > 0,
         "must be positive (or null: dropless)", "null"),
        ("model.moe_aux_loss_coeff", m.moe_aux_loss_coeff, m.moe_aux_loss_coeff >= 0, "must not be negative", "1e-2"),
        ("model.moe_z_loss_coeff", m.moe_z_loss_coeff, m.moe_z_loss_coeff >= 0, "must not be negative", "1e-3"),
        ("model.moe_dispatcher", m.moe_dispatcher, m.moe_dispatcher in DISPATCHERS,
         f"must be one of {'|'.join(DISPATCHERS)}", DISPATCHERS[0]),
        ("overlap.ep_chunks", o.ep_chunks, o.ep_chunks >= 1,
         "each microbatch's tokens are dispatched in ep_chunks >= 1 chunks", "4"),
    ]
    for key, value, ok, why, fix in checks:
        if not ok:
            yield Problem("moe.values", {key: value}, why, [f"{key}={fix}"])


@rule("ep.overlap_needs_moe", "ep", ("overlap.ep", "model.num_experts"),
      "overlap.ep=true needs an MoE model (and parallel.ep >= 2: mode.required_applies)")
def _overlap_needs_moe(lo: Layout):
    if lo.mode("ep") == "true" and lo.cfg.model.num_experts == 0:
        yield Problem("ep.overlap_needs_moe", {"overlap.ep": "true", "model.num_experts": 0},
                      "overlap.ep=true is required but a dense model dispatches no tokens",
                      ["overlap.ep=auto"])
