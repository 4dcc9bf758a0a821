"""CommOverlapConfig: each mode's switch, resolved from auto|true|false, with the reason.

Built only from a config the rule engine accepted; layers receive `overlap.<mode>.enabled`
(a plain bool), never the config itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from mpoverlap.overlap.layout import Layout, build_layout


@dataclass(frozen=True)
class ModeState:
    requested: str  # auto | true | false
    enabled: bool
    reason: str


@dataclass(frozen=True)
class CommOverlapConfig:
    dp: ModeState
    tp: ModeState
    pp: ModeState
    cp: ModeState
    ep: ModeState
    dp_param_gather: ModeState
    dp_bucket_mb: Optional[float]  # None: auto (resolved where a machine is known: simulate/bucket_size.py)
    ep_pairing: ModeState = ModeState("false", False, "not resolved")

    def modes(self) -> Dict[str, ModeState]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
                "dp_param_gather": self.dp_param_gather, "ep_pairing": self.ep_pairing}

    @classmethod
    def from_config(cls, cfg: Any, world_size: Optional[int] = None) -> "CommOverlapConfig":
        from mpoverlap.overlap.cuda_env import max_connections_conflict, max_connections_reason

        lo = build_layout(cfg, world_size)
        # On CUDA, TP/CP overlap needs CUDA_DEVICE_MAX_CONNECTIONS=1: a user's other value turns
        # an `auto` mode off (a `true` one is refused by the rule cuda.max_connections).
        conflict = max_connections_conflict(cfg, lo.world) if lo.degrees_ok else None
        blocked = max_connections_reason(conflict) if conflict is not None else None
        ep_state = _resolve_ep(cfg, lo, world_size)
        return cls(
            dp=_resolve(lo, "dp", lo.dp_cp > 1 or expert_grad_ranks(lo) > 1, _dp_what(lo),
                        f"dp x cp = {lo.dp_cp}: a single replica has no gradient reduction"),
            tp=_resolve(lo, "tp", lo.tp > 1, _tp_what(lo),
                        f"parallel.tp={lo.tp}: no tensor-parallel communication", blocked),
            pp=_resolve(lo, "pp", lo.pp > 1, "pipeline send/receive posted ahead",
                        f"parallel.pp={lo.pp}: no pipeline communication"),
            cp=_resolve_cp(lo, blocked),
            ep=ep_state,
            dp_param_gather=_resolve_param_gather(lo),
            dp_bucket_mb=_bucket_mb(cfg),
            ep_pairing=_resolve_pairing(lo, ep_state),
        )


def _bucket_mb(cfg: Any) -> Optional[float]:
    """overlap.dp_bucket_mb as a number, None for auto or a value the rule dp.bucket_size refuses."""
    from mpoverlap.simulate.bucket_size import requested_bucket_mb

    try:
        return requested_bucket_mb(cfg)
    except ValueError:
        return None


def _resolve(lo: Layout, mode: str, applies: bool, what: str, why_not: str,
             blocked: Optional[str] = None) -> ModeState:
    """`blocked`: why a mode that applies cannot overlap on this machine (auto turns it off)."""
    requested = lo.mode(mode)
    if requested == "false":
        if applies:
            return ModeState(requested, False, "off as requested: the same collectives, each waited at once")
        return ModeState(requested, False, f"off as requested ({why_not})")
    if applies and blocked is not None and requested == "auto":
        return ModeState(requested, False, blocked)
    if applies:
        return ModeState(requested, True, what)
    # `true` that cannot apply never reaches here: the rule engine rejects it first.
    return ModeState(requested, False, why_not)


def _tp_what(lo: Layout) -> str:
    """What overlap.tp hides under what, with and without sequence parallelism; without SP, also
    where a zero-bubble schedule's deferred weight gradients leave the input-gradient all-reduce
    (with SP the collective-matmul ring keeps its dgrad GEMM chunks under the transfers)."""
    from mpoverlap.pipeline.schedules import defers_weight_grads, resolve_schedule

    if bool(lo.cfg.parallel.sequence_parallel):
        return ("collective matmul: the SP all-gather / reduce-scatter in ring steps under GEMM "
                "chunks; backward all-gather under the dgrad GEMM, dgrad reduction under wgrad")
    what = ("without SP: each column-parallel linear's input-gradient all-reduce (qkv, a dense MLP's gate/up, "
            "output head) issued after its dgrad GEMM and waited after its wgrad GEMM; the forward's "
            "row-parallel all-reduces are waited at once (their sums are the next op's input)")
    schedule = str(getattr(lo.cfg.parallel, "pp_schedule", "auto"))
    if lo.pp not in (None, 1) and lo.vpp is not None and defers_weight_grads(resolve_schedule(schedule, lo.vpp)):
        what += (f"; parallel.pp_schedule={schedule}: a B that has a W defers the wgrad GEMM, so there the "
                 "all-reduce hides under the bias-gradient sum only and is waited at the end of the linear's "
                 "backward (mostly exposed; the W runs later); in a B without a W it hides under the wgrad GEMM")
    return what


def _resolve_cp(lo: Layout, blocked: Optional[str] = None) -> ModeState:
    from mpoverlap.overlap.cp_rules import a2a_head_groups

    if lo.cfg.parallel.cp_comm == "a2a":
        m = lo.cfg.model
        groups = a2a_head_groups(m.num_attention_heads, lo.tp, lo.cp, m.num_query_groups) if lo.cp > 1 else 1
        return _resolve(lo, "cp", lo.cp > 1 and groups > 1,
                        "all-to-all of one head group in flight under attention of another",
                        f"parallel.cp={lo.cp}: no context-parallel communication" if lo.cp == 1 else
                        "parallel.cp_comm=a2a with an odd number of local heads (or K/V groups): one head group, nothing "
                        "to overlap (use parallel.cp_comm=p2p to overlap the ring)", blocked)
    return _resolve(lo, "cp", lo.cp > 1, "next K/V block (and dK/dV in backward) in flight around the ring "
                    "while attention runs on the block already here",
                    f"parallel.cp={lo.cp}: no context-parallel communication", blocked)


def _resolve_ep(cfg: Any, lo: Layout, world_size: Optional[int]) -> ModeState:
    """overlap.ep: `auto` on only where the simulator predicts a faster step with it (ep_choice.py)."""
    applies = lo.ep is not None and lo.ep > 1 and cfg.model.num_experts > 0
    state = _resolve(lo, "ep", applies, "token dispatch under experts",
                     f"parallel.ep={lo.ep}, model.num_experts={cfg.model.num_experts}: no expert dispatch")
    if not applies or state.requested != "auto" or not lo.degrees_ok:
        return state
    from mpoverlap.simulate.ep_choice import choose

    choice = choose(cfg, world_size)
    return ModeState(state.requested, choice.enabled, choice.reason)


def _resolve_pairing(lo: Layout, ep: Optional[ModeState] = None) -> ModeState:
    from mpoverlap.overlap.ep_rules import pairing_obstacles

    requested = lo.mode("ep_pairing")
    obstacles = pairing_obstacles(lo)
    if requested == "false":
        return ModeState(requested, False, "off as requested: each microbatch's forward and backward run alone")
    schedule = str(getattr(lo.cfg.parallel, "pp_schedule", "auto"))
    zbv = lo.pp not in (None, 1) and schedule == "zbv"
    zb1p = lo.pp not in (None, 1) and schedule == "zb1p" and lo.vpp not in (None, 1)
    if zbv and requested == "auto":
        return ModeState(requested, False, "parallel.pp_schedule=zbv: the paired V (pipeline/zbv_paired.py) runs only "
                                           "when asked for (overlap.ep_pairing=true): measured within the noise of the "
                                           "better of zbv and interleaved + pairing (docs/benchmarks.md)")
    if zb1p and requested == "auto":
        return ModeState(requested, False, "parallel.pp_schedule=zb1p: the paired zb1p table (pipeline/zero_bubble.py) "
                                           "runs only when asked for (overlap.ep_pairing=true): no benchmark measures "
                                           "its gain over zb1p unpaired (docs/pipeline-schedules.md)")
    if obstacles:  # `true` never reaches here with an obstacle: the rules refuse it first
        _, values, why, _ = obstacles[0]
        keys = ", ".join(f"{k}={v}" for k, v in values.items())
        return ModeState(requested, False, f"{keys}: {why}")
    if requested == "auto" and ep is not None and ep.requested == "auto" and not ep.enabled:
        return ModeState(requested, False, "overlap.ep=auto resolved off (pairing keeps the exchanges in flight, "
                                           f"which needs EP overlap): {ep.reason}")
    if zbv:
        return ModeState(requested, True, "the paired V: each steady-state forward of one chunk paired with a "
                                          "backward of the stage's other chunk into an overlapped FB action, its "
                                          "weight gradients deferred to the W after the pair")
    if zb1p:
        return ModeState(requested, True, "the paired zb1p table: the interleaved table's steady-state forward and "
                                          "backward actions paired into overlapped FB actions, each B's weight "
                                          "gradients deferred to a W placed where the stage would idle")
    if lo.pp not in (None, 1):
        return ModeState(requested, True, "the interleaved table's steady-state forward and backward actions paired "
                                          "into overlapped FB actions, each one's expert all-to-alls in flight under "
                                          "the other's computation (one more warm-up forward per stage)")
    return ModeState(requested, True, "forward of microbatch i+1 paired with backward of microbatch i: each one's "
                                      "expert all-to-alls in flight under the other's computation (one more "
                                      "microbatch of activations in flight)")


def _resolve_param_gather(lo: Layout) -> ModeState:
    from mpoverlap.overlap.dp_rules import sharding_level

    requested = lo.mode("dp_param_gather")
    level = sharding_level(lo.cfg)
    distopt = level != "none"
    if level == "optim_grads_params":
        return ModeState(requested, False, "ZeRO-3: no gather after the step; each unit is gathered before its "
                                           "forward and backward, prefetched under overlap.dp")
    if requested == "false":
        return ModeState(requested, False, "off as requested: parameters gathered and waited right after "
                                           "the optimizer step" if distopt else "off as requested")
    if not distopt:
        return ModeState(requested, False, "train.dp_sharding=none, every rank holds "
                                           "full parameters")
    if lo.dp_cp == 1:
        return ModeState(requested, False, "a single replica, nothing to gather")
    if lo.mode("dp") == "false":
        return ModeState(requested, False, "overlap.dp=false waits every DP collective at once")
    return ModeState(requested, True, "parameter all-gather per bucket issued after the optimizer step, "
                                      "each waited by the first forward that needs it")


def ep_chunks(cfg: Any, world_size: Optional[int] = None) -> int:
    """overlap.ep_chunks resolved: an integer as given; `auto`, where the experts' tokens are
    exchanged (parallel.ep > 1, an MoE model), the count the simulator predicts the fastest step
    with (simulate/ep_choice.py, 1 where EP overlap resolves off), else 1 (at ep 1 the exchanges
    are the identity: more chunks would hide nothing and only repeat the MoE layer's operators, a
    GPU's kernel launches). Only called on a config the rule engine accepted (moe.values checks
    the value)."""
    value = cfg.overlap.ep_chunks
    if isinstance(value, str) and value.strip().lower() == "auto":
        if int(cfg.parallel.ep) <= 1 or cfg.model.num_experts == 0:
            return 1
        return ep_chunks_choice(cfg, world_size).chunks
    return int(value)


def ep_chunks_choice(cfg: Any, world_size: Optional[int] = None):
    """The simulator's EpChoice for `cfg` (simulate/ep_choice.py): chunks and why."""
    from mpoverlap.simulate.ep_choice import choose

    return choose(cfg, world_size)


def expert_grad_ranks(lo: Layout) -> int:
    """The ranks the expert gradient buckets are reduced over: tp x edp when the experts are
    replicated over tp under SP (etp = 1), else edp; 1 without experts. Above 1 at dp x cp = 1
    too (tp 2, dp 1): the data-parallel buckets then have a reduction to overlap."""
    from mpoverlap.overlap.estimate.sharding import expert_group_size

    return expert_group_size(lo.cfg, lo) if lo.cfg.model.num_experts > 0 else 1


def _dp_what(lo: Layout) -> str:
    from mpoverlap.overlap.dp_rules import sharding_level

    if lo.dp_cp == 1:
        return (f"expert-gradient all-reduce per bucket over tp x edp ({expert_grad_ranks(lo)} ranks: the "
                "experts are replicated over tp under SP), issued from backward hooks on the last "
                "microbatch and waited just before the optimizer")
    level = sharding_level(lo.cfg)
    if level in ("optim_grads", "optim_grads_params"):
        what = ("gradient reduce-scatter per bucket in every microbatch, issued from backward hooks under "
                "the rest of backward")
        if level == "optim_grads_params":
            what += (f"; each unit's all-gather waited before its use while the next "
                     f"{lo.cfg.overlap.dp_prefetch} unit(s) gather (forward and backward)")
        return what
    return ("gradient all-reduce/reduce-scatter per bucket, issued from backward hooks on "
            "the last microbatch and waited just before the optimizer")
