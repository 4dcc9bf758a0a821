"""Expert-parallel and mixture-of-experts rules: expert placement, routing, MoE keys.

No rule ties EP overlap (overlap.ep, its chunks) to the pipeline or to recomputation: the
overlap chunks the tokens of one MoE layer's forward and backward and waits every handle before
the layer returns (or its backward finishes), so nothing is in flight across a pipeline send or
a layer boundary; full activation recomputation replays a whole block's forward, dispatch and
combine included, with the same issue-and-wait order. Forward/backward pairing
(overlap.ep_pairing, the end of this file) keeps one microbatch's all-to-all in flight under
another's computation across layers; under full recomputation the paired sub-steps replay a
block's forward as sub-steps in its backward (pairing/steps.py), so it composes too.
"""
from __future__ import annotations

from mpoverlap.overlap.layout import Layout, as_positive_int
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
        ("overlap.ep_chunks", o.ep_chunks, _chunks_ok(o.ep_chunks),
         "each microbatch's tokens are dispatched in ep_chunks >= 1 chunks (or auto: 4 at parallel.ep > 1, "
         "else 1)", "auto"),
    ]
    for key, value, ok, why, fix in checks:
        if not ok:
            yield Problem("moe.values", {key: value}, why, [f"{key}={fix}"])


def _chunks_ok(value) -> bool:
    return (isinstance(value, str) and value.strip().lower() == "auto") or as_positive_int(value) is not None


@rule("ep.overlap_needs_moe", "ep", ("overlap.ep", "model.num_experts"),
      "overlap.ep=true needs an MoE model (and parallel.ep >= 2: mode.required_applies)")
def _overlap_needs_moe(lo: Layout):
    if lo.mode("ep") == "true" and lo.cfg.model.num_experts == 0:
        yield Problem("ep.overlap_needs_moe", {"overlap.ep": "true", "model.num_experts": 0},
                      "overlap.ep=true is required but a dense model dispatches no tokens",
                      ["overlap.ep=auto"])


@rule("ep.dispatch_dtype", "ep", ("train.ep_dispatch_dtype", "parallel.ep", "model.num_experts", "model.hidden_size"),
      "train.ep_dispatch_dtype=bf16|fp8 needs a mixture-of-experts model; fp8 also an expert exchange "
      "to compress (parallel.ep >= 2) and a hidden size its blocks of 128 divide")
def _dispatch_dtype(lo: Layout):
    from mpoverlap.moe.dispatch_wire import BLOCK

    asked = str(lo.cfg.train.ep_dispatch_dtype)
    if asked not in ("bf16", "fp8"):  # auto, or an unknown value (value.choice)
        return
    key = {"train.ep_dispatch_dtype": asked}
    if lo.cfg.model.num_experts == 0:
        yield Problem("ep.dispatch_dtype", {**key, "model.num_experts": 0},
                      "a dense model dispatches no tokens, so no dispatch has a dtype",
                      ["train.ep_dispatch_dtype=auto"])
    elif asked == "fp8" and lo.ep == 1:
        yield Problem("ep.dispatch_dtype", {**key, "parallel.ep": 1},
                      "fp8 compresses the tokens the dispatch sends to other expert-parallel ranks; at "
                      "parallel.ep=1 they never leave the rank, and rounding them would only lose precision "
                      "(or place the experts on several ranks, e.g. parallel.ep=2 with parallel.dp=2)",
                      ["train.ep_dispatch_dtype=auto"])
    H = lo.cfg.model.hidden_size
    if asked == "fp8" and lo.cfg.model.num_experts > 0 and isinstance(H, int) and H >= 1 and H % BLOCK:
        yield Problem("ep.dispatch_dtype", {**key, "model.hidden_size": H},
                      f"fp8 gives each token's hidden vector one fp32 scale per {BLOCK} elements; {BLOCK} does "
                      f"not divide {H}, so every row would be padded to {-(-H // BLOCK) * BLOCK} elements "
                      f"({-(-H // BLOCK) * (BLOCK + 4)} bytes a token against {2 * H} in bf16) (or "
                      f"model.hidden_size={-(-H // BLOCK) * BLOCK})",
                      ["train.ep_dispatch_dtype=auto"])


# ---- fine-grained MoE and expert tensor parallelism -------------------------------------
ROUTER_SCORES = ("softmax", "sigmoid")
ROUTER_ORDERS = ("score_topk", "topk_score")


@rule("moe.fine_grained_values", "ep",
      ("model.moe_shared_expert_ffn_hidden_size", "model.moe_first_dense_layers", "model.moe_router_score",
       "model.moe_router_order", "model.moe_router_bias_update_rate", "model.num_layers"),
      "fine-grained MoE settings hold usable values (and leave at least one MoE layer)")
def _fine_values(lo: Layout):
    m = lo.cfg.model
    checks = [
        ("model.moe_shared_expert_ffn_hidden_size", m.moe_shared_expert_ffn_hidden_size,
         m.moe_shared_expert_ffn_hidden_size is None or m.moe_shared_expert_ffn_hidden_size >= 1,
         "must be positive (or null: the expert width)", "null"),
        ("model.moe_first_dense_layers", m.moe_first_dense_layers, m.moe_first_dense_layers >= 0,
         "must be 0 or a positive count of leading dense layers", "0"),
        ("model.moe_router_score", m.moe_router_score, m.moe_router_score in ROUTER_SCORES,
         f"must be one of {'|'.join(ROUTER_SCORES)}", ROUTER_SCORES[0]),
        ("model.moe_router_order", m.moe_router_order, m.moe_router_order in ROUTER_ORDERS,
         f"must be one of {'|'.join(ROUTER_ORDERS)}", ROUTER_ORDERS[0]),
        ("model.moe_router_bias_update_rate", m.moe_router_bias_update_rate, m.moe_router_bias_update_rate >= 0,
         "must not be negative (0 = no aux-loss-free bias)", "0"),
    ]
    for key, value, ok, why, fix in checks:
        if not ok:
            yield Problem("moe.fine_grained_values", {key: value}, why, [f"{key}={fix}"])
    if m.num_experts > 0 and m.num_layers >= 1 and m.moe_first_dense_layers >= m.num_layers:
        yield Problem("moe.fine_grained_values",
                      {"model.moe_first_dense_layers": m.moe_first_dense_layers, "model.num_layers": m.num_layers},
                      "every layer would be dense: the experts would never be used",
                      [f"model.moe_first_dense_layers={m.num_layers - 1}"])


@rule("moe.fine_grained_needs_experts", "ep",
      ("model.num_experts", "model.moe_shared_expert_ffn_hidden_size", "model.moe_first_dense_layers",
       "model.moe_router_score", "model.moe_router_order", "model.moe_router_bias_update_rate",
       "model.moe_router_force_load_balancing"),
      "fine-grained MoE keys are set only on a mixture-of-experts model (never silently ignored)")
def _fine_needs_experts(lo: Layout):
    m = lo.cfg.model
    if m.num_experts != 0:
        return
    set_keys = {"model.moe_shared_expert_ffn_hidden_size": (m.moe_shared_expert_ffn_hidden_size, None),
                "model.moe_first_dense_layers": (m.moe_first_dense_layers, 0),
                "model.moe_router_score": (m.moe_router_score, "softmax"),
                "model.moe_router_order": (m.moe_router_order, "score_topk"),
                "model.moe_router_bias_update_rate": (m.moe_router_bias_update_rate, 0.0),
                "model.moe_router_force_load_balancing": (m.moe_router_force_load_balancing, False)}
    for key, (value, default) in set_keys.items():
        if value != default:
            yield Problem("moe.fine_grained_needs_experts", {key: value, "model.num_experts": 0},
                          "a dense model has no router or experts for this key to act on",
                          [f"{key}={'null' if default is None else str(default).lower() if isinstance(default, bool) else default}"])


@rule("moe.topk_score_needs_softmax", "ep", ("model.moe_router_order", "model.moe_router_score"),
      "top-k-then-softmax routing normalises with a softmax (sigmoid scores pick first, then normalise)")
def _topk_score(lo: Layout):
    m = lo.cfg.model
    if m.moe_router_order == "topk_score" and m.moe_router_score == "sigmoid":
        yield Problem("moe.topk_score_needs_softmax",
                      {"model.moe_router_order": "topk_score", "model.moe_router_score": "sigmoid"},
                      "topk_score applies a softmax over the k chosen logits; sigmoid scores are "
                      "chosen first and then renormalised (DeepSeek-V3), which is score_topk",
                      ["model.moe_router_order=score_topk"])


@rule("moe.shared_width_needs_shared_expert", "ep",
      ("model.moe_shared_expert_ffn_hidden_size", "model.shared_expert"),
      "a shared-expert width is given only with model.shared_expert=true")
def _shared_width(lo: Layout):
    m = lo.cfg.model
    if m.moe_shared_expert_ffn_hidden_size is not None and not m.shared_expert and m.num_experts > 0:
        yield Problem("moe.shared_width_needs_shared_expert",
                      {"model.moe_shared_expert_ffn_hidden_size": m.moe_shared_expert_ffn_hidden_size,
                       "model.shared_expert": False},
                      "the width of a shared expert the model does not have would be ignored",
                      ["model.shared_expert=true"])


@rule("etp.value", "ep", ("parallel.etp", "parallel.tp", "parallel.ep", "parallel.cp", "parallel.dp"),
      "parallel.etp is 1 or tp: experts split over the tp group; world = tp x cp x dp x pp = "
      "etp x ep x edp x pp (x tp/etp) with edp = dp x cp / ep")
def _etp_value(lo: Layout):
    etp = as_positive_int(lo.cfg.parallel.etp)
    if etp is None:
        yield Problem("etp.value", {"parallel.etp": lo.cfg.parallel.etp},
                      "the expert tensor-parallel degree must be a positive integer", ["parallel.etp=1"])
        return
    if lo.tp is None or etp in (1, lo.tp):
        return
    yield Problem("etp.value", {"parallel.etp": etp, "parallel.tp": lo.tp},
                  f"experts are split over the tensor-parallel group (etp = tp = {lo.tp}) or not at all "
                  f"(etp = 1); a group of {etp} of the {lo.tp} tp ranks would not tile the tp x ep x edp "
                  "grid with the attention's tp", ["parallel.etp=1"])


@rule("etp.needs_experts", "ep", ("parallel.etp", "model.num_experts"),
      "expert tensor parallelism needs a mixture-of-experts model")
def _etp_needs_experts(lo: Layout):
    etp = as_positive_int(lo.cfg.parallel.etp)
    if etp is not None and etp > 1 and lo.cfg.model.num_experts == 0:
        yield Problem("etp.needs_experts", {"parallel.etp": etp, "model.num_experts": 0},
                      "a dense model has no experts to split", ["parallel.etp=1"])


@rule("etp.divides_expert_ffn", "ep", ("parallel.etp", "model.moe_ffn_hidden_size"),
      "etp divides each expert's hidden size")
def _etp_divides(lo: Layout):
    m = lo.cfg.model
    etp = as_positive_int(lo.cfg.parallel.etp)
    if etp is None or etp == 1 or etp != lo.tp or m.num_experts == 0:  # other etp: etp.value
        return
    ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
    if isinstance(ffn, int) and ffn >= 1 and ffn % etp:
        yield Problem("etp.divides_expert_ffn", {"parallel.etp": etp, "model.moe_ffn_hidden_size": ffn},
                      f"each of the etp={etp} ranks holds ffn / etp columns of every expert",
                      [f"model.moe_ffn_hidden_size={next_multiple(ffn, etp)}"])


# ---- forward/backward pairing (overlap.ep_pairing, mpoverlap/pairing) -------------------
def pairing_obstacles(lo: Layout) -> list:
    """[(rule id, {key: value}, reason, [fixes])]: why forward/backward pairing cannot run on
    this layout (empty: it can). `overlap.ep_pairing=true` refuses each; `auto` resolves off
    and the plan gives the first reason."""
    m, out = lo.cfg.model, []
    if m.num_experts == 0 or lo.ep in (None, 1):
        out.append(("ep_pairing.needs_expert_exchange", {"parallel.ep": lo.ep, "model.num_experts": m.num_experts},
                    "pairing hides one microbatch's expert all-to-alls under another's computation; without "
                    "expert parallelism (parallel.ep >= 2 and an MoE model) there is no exchange to hide",
                    ["overlap.ep_pairing=auto"]))
    if lo.pp not in (None, 1) and lo.vpp == 1:
        out.append(("ep_pairing.pp_needs_vpp", {"parallel.pp": lo.pp, "parallel.vpp": 1},
                    "pipelined pairing runs overlapped F/B actions in the interleaved table, in zb1p's at vpp >= 2 "
                    "or in the zbv V (Megatron's combined 1F1B requires virtual chunks too); at vpp=1 (1F1B, zb1p) "
                    "a pair's backward waits for the next stage's pair, which waits for the forward this stage "
                    "sends after its previous pair, so neighbouring stages would take turns instead of overlapping",
                    ["parallel.vpp=2"]))
    schedule = str(getattr(lo.cfg.parallel, "pp_schedule", "auto"))
    if lo.pp not in (None, 1) and schedule == "1f1b":
        out.append(("ep_pairing.pp_needs_interleaved", {"parallel.pp_schedule": schedule},
                    "pipelined pairing pairs the steady-state F and B of the interleaved table (plain or zb1p, "
                    "vpp >= 2) or of the zbv V; 1f1b has one chunk per stage and no paired table",
                    ["parallel.pp_schedule=interleaved"]))
    n = lo.num_microbatches
    if lo.pp not in (None, 1) and schedule == "zbv":
        if n is not None and n < 2 * lo.pp:
            out.append(("ep_pairing.v_microbatches", {"train.global_batch_size": lo.cfg.train.global_batch_size},
                        f"the paired V pairs the forwards of one half of the microbatches with the backwards of "
                        f"the other: it needs at least 2pp = {2 * lo.pp} microbatches per step, got {n}",
                        [f"train.global_batch_size={lo.cfg.train.global_batch_size * -(-2 * lo.pp // n)}"]))
    if n is not None and n < 2:
        out.append(("ep_pairing.needs_two_microbatches",
                    {"train.global_batch_size": lo.cfg.train.global_batch_size,
                     "train.micro_batch_size": lo.cfg.train.micro_batch_size},
                    f"{n} microbatch per step: there is no other microbatch to pair a forward with",
                    [f"train.global_batch_size={2 * lo.cfg.train.global_batch_size}"]))
    if lo.mode("ep") == "false":
        out.append(("ep_pairing.needs_ep_overlap", {"overlap.ep": "false"},
                    "overlap.ep=false asks for every expert exchange to be waited at once; pairing keeps them "
                    "in flight", ["overlap.ep=auto"]))
    return out


_PAIRING_RULES = {
    "ep_pairing.needs_expert_exchange": (("overlap.ep_pairing", "parallel.ep", "model.num_experts"),
                                         "overlap.ep_pairing=true needs expert parallelism (ep >= 2, an MoE model)"),
    "ep_pairing.pp_needs_vpp": (("overlap.ep_pairing", "parallel.pp", "parallel.vpp"),
                                "overlap.ep_pairing=true at parallel.pp > 1 needs parallel.vpp >= 2"),
    "ep_pairing.pp_needs_interleaved": (("overlap.ep_pairing", "parallel.pp_schedule"),
                                        "overlap.ep_pairing=true at parallel.pp > 1 runs the interleaved, zb1p or zbv schedule"),
    "ep_pairing.v_microbatches": (("overlap.ep_pairing", "parallel.pp_schedule", "train.global_batch_size"),
                                  "overlap.ep_pairing=true with zbv needs at least 2pp microbatches per step"),
    "ep_pairing.needs_two_microbatches": (("overlap.ep_pairing", "train.global_batch_size", "train.micro_batch_size"),
                                          "overlap.ep_pairing=true needs at least two microbatches per step"),
    "ep_pairing.needs_ep_overlap": (("overlap.ep_pairing", "overlap.ep"),
                                    "overlap.ep_pairing=true needs overlap.ep not false"),
}


def _pairing_rule(rule_id: str):
    keys, summary = _PAIRING_RULES[rule_id]

    @rule(rule_id, "ep", keys, summary)
    def check(lo: Layout):
        if lo.mode("ep_pairing") != "true":
            return
        for rid, values, why, fixes in pairing_obstacles(lo):
            if rid == rule_id:
                yield Problem(rid, {"overlap.ep_pairing": "true", **values}, why, fixes)
    return check


for _rule_id in _PAIRING_RULES:
    _pairing_rule(_rule_id)
