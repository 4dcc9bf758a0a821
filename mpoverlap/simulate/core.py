"""Step time of one layout on one machine: the pieces put together.

Ranks with the same role compute the same thing: every tp, cp, dp (and ep) rank of a pipeline
stage runs the same actions on equal shares, so each stage is simulated once, whatever the
world size. Per stage: chunk costs (costs.py) -> discrete-event pipeline (engine.py), once
with the real p2p and once with free p2p (the bubble) -> the DP tail after the last backward
(buckets, overlap.py) and the other once-per-step collectives.

Decomposition of the step on the stage that ends last:
  step = compute + exposed TP/CP/EP (inside the actions) + DP parameter-gather wait
         + bubble (idle with free p2p) + exposed PP (what real p2p adds) + DP tail
         + the update after the last backward (norm, clip, optimizer: `update_seconds`)
         + the CPU time hidden communication takes from compute (`hidden_comm_cpu`; for PP on
           gloo it is spent inside the post, where the ledger counts it as exposed pp).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from mpoverlap.overlap.config import CommOverlapConfig, ep_chunks
from mpoverlap.overlap.estimate.comm import comm_ops
from mpoverlap.overlap.estimate.core import compute_bytes
from mpoverlap.overlap.estimate.params import chunk_layout_of, mtp_own_chunk, stage_params
from mpoverlap.overlap.layout import Layout, build_layout
from mpoverlap.simulate.collectives import collective_time, group_links
from mpoverlap.simulate.costs import MODES, ChunkCost, chunk_costs, step_ops
from mpoverlap.simulate.engine import last_backward_spans, run_pipeline
from mpoverlap.simulate.hardware import Hardware, fp8_speedup
from mpoverlap.simulate.pairing import PipelinePairing, apply_pairing, pairing_state
from mpoverlap.simulate.plain import plain
from mpoverlap.simulate.overlap import bucket_finish, buckets_over, gather_exposed
from mpoverlap.simulate.report import bubble_form_line, render  # noqa: F401  (the step's report, report.py)


@dataclass
class SimResult:
    step_s: float
    compute_s: float  # the critical stage's compute
    bubble_s: float
    in_flight_s: Dict[str, float]  # per mode, the critical stage's communication time per step
    exposed_s: Dict[str, float]  # per mode, what of it the step waited for
    tokens_per_s: float
    mfu: float
    critical_stage: int
    enabled: Dict[str, bool]
    links: Dict[str, str] = field(default_factory=dict)
    # pp as metrics.jsonl counts it (engine.PipelineRun.ledger_*), per rank averaged over stages
    ledger_pp: Dict[str, float] = field(default_factory=dict)
    avg_compute_s: float = 0.0  # compute per step averaged over the stages
    useful_share: float = 1.0  # model FLOPs / FLOPs run (recomputation, head, attention's causal half)
    update_s: float = 0.0  # the critical stage's work after the last backward (in compute_s)
    comm_cpu_s: float = 0.0  # CPU time its hidden communication took from compute (in compute_s)
    # of compute_s, the memory-bound seconds (memory.py's bytes at hardware.hbm_bw; 0 = not
    # modelled); the rest is compute-bound (FLOPs at peak x gemm_efficiency)
    memory_s: float = 0.0
    # mean stage FLOP seconds (at the GEMM rate) over mean stage compute: what the memory-bound
    # time, the update and the CPU of hidden communication leave to the GEMMs
    compute_bound_share: float = 1.0
    # EP forward/backward pairing (overlap.ep_pairing, pairing.py): whether modelled and why,
    # and per pair and unpaired pass the seconds of ep exposed ({"F", "B", "F_alone", "B_alone"})
    ep_pairing: str = ""
    ep_pairing_exposed: Dict[str, float] = field(default_factory=dict)
    # pp > 1: the schedule's closed-form bubble (pipeline/bubble.py) at the simulated per-chunk
    # action costs, pooled over the stages and each stage's own ({"schedule", "pooled" (F, B, W),
    # "form", "per_stage"}); printed beside the simulated idle
    bubble_forms: Dict[str, Any] = field(default_factory=dict)
    # more ranks than CPU cores (a measured machine): {"ranks", "cores", "stretch" (compute's
    # slow-down), "runnable" (the fraction of the step a rank computes)}; {} otherwise
    core_sharing: Dict[str, float] = field(default_factory=dict)
    # train.precision=fp8: FLOPs run per compute-bound second over the bf16 rate's (the covered
    # GEMMs ran at the FP8 rate); 1.0 otherwise
    fp8_gain: float = 1.0

    @property
    def exposed_share(self) -> Dict[str, float]:
        return {m: (self.exposed_s.get(m, 0.0) / t if t > 0 else 0.0) for m, t in self.in_flight_s.items()}


def simulate(cfg: Any, hw: Hardware, world_size: Optional[int] = None) -> SimResult:
    """The step of `cfg`'s layout on `hw`; where its ranks share fewer CPU cores than there are
    ranks (`hw.cores`), with compute stretched as sharing.py says."""
    from mpoverlap.simulate.bucket_size import with_resolved_bucket
    from mpoverlap.simulate.ep_choice import pin_auto
    from mpoverlap.simulate.sharing import with_shared_cores

    cfg = pin_auto(cfg, hw, world_size)  # overlap.ep / ep_chunks = auto decided on `hw` itself
    cfg = with_resolved_bucket(cfg, hw, world_size)  # overlap.dp_bucket_mb=auto: bucket_size.py
    lo = build_layout(plain(cfg), world_size)
    if not hw.cores or lo.world <= hw.cores:
        return _simulate(cfg, hw, world_size)
    return with_shared_cores(lambda h: _simulate(cfg, h, world_size), hw, lo.world)


def _simulate(cfg: Any, hw: Hardware, world_size: Optional[int] = None) -> SimResult:
    from mpoverlap.models.flops import flops_per_token

    cfg = plain(cfg)
    lo = build_layout(cfg, world_size)
    ov = CommOverlapConfig.from_config(cfg, world_size)
    enabled = {m: ov.modes()[m].enabled for m in MODES}
    c = compute_bytes(cfg)
    links = group_links(lo, hw)
    micro = lo.num_microbatches or 1
    costs = chunk_costs(cfg, lo, hw, links, enabled, c)
    paired, pairing_why = pairing_state(cfg, lo.pp, lo.vpp, lo.ep, enabled["ep"], micro, ov.modes().get("ep_pairing"))
    pipe_pairs = PipelinePairing(costs, ep_chunks(cfg)) if paired and lo.pp > 1 else None
    pairing_exposed = apply_pairing(costs[0], micro, ep_chunks(cfg)) if paired and pipe_pairs is None else {}
    pp_msg = _pp_message_bytes(cfg, lo, c)
    T = lo.tp * lo.cp * lo.dp

    def hop(src: int, dst: int) -> float:
        a, b = sorted((src, dst))
        return collective_time("send_recv", 2 * pp_msg, 2, hw.group_link((b - a) * T, 2, first=a * T))

    from mpoverlap.pipeline import chunk_index, chunk_layout, defers_weight_grads, resolve_schedule
    from mpoverlap.pipeline.actions import LOOP_MTP

    schedule = resolve_schedule(getattr(cfg.parallel, "pp_schedule", "auto"), lo.vpp) if lo.pp > 1 else None
    zero_bubble = schedule is not None and defers_weight_grads(schedule)
    mtp = mtp_own_chunk(cfg, lo)  # the MTP chunk pp*vpp on stage 0 (loop_mtp), after the head's

    def seconds(kind: str, chunk: int, ep_exposed: Optional[float] = None) -> float:
        """One action; `ep_exposed`: its ep exposed as pairing leaves it (None: the chunk's own)."""
        whole = costs[chunk].duration(kind) if kind != "W" else 0.0
        if ep_exposed is not None and kind != "W":
            whole += ep_exposed - costs[chunk].exposed[kind].get("ep", 0.0)
        if not zero_bubble or kind == "F" or chunk == lo.pp * lo.vpp:  # the MTP chunk has no W
            return whole
        # Zero bubble: W = the weight-gradient GEMMs, one per forward GEMM (paper Table 1:
        # T_W ~ T_F), at most half the backward; B keeps the rest (input gradient, recompute,
        # the backward's communication).
        weight = min(costs[chunk].compute["F"], costs[chunk].compute["B"] / 2)
        return weight if kind == "W" else whole - weight

    def duration(kind: str, chunk: int) -> float:
        # in a paired table the lone forwards and backwards run the pairing's programs alone
        return seconds(kind, chunk, pipe_pairs.alone(chunk)[kind] if pipe_pairs and kind != "W" else None)

    pair_duration = None
    if pipe_pairs is not None:
        def pair_duration(f_chunk: int, b_chunk: int) -> Tuple[float, float]:
            x = pipe_pairs.pair(f_chunk, b_chunk)
            return seconds("F", f_chunk, x["F"]), seconds("B", b_chunk, x["B"])

    # DP per stage: gradient buckets under the last backward, parameter gather under the first forward.
    dp = [_dp_stage(cfg, lo, hw, links, s, c) for s in range(lo.pp)]
    update = [update_seconds(cfg, lo, hw, s) for s in range(lo.pp)]
    layout = chunk_layout(schedule) if schedule else "loop"  # zbv: stage s holds chunks s and 2pp-1-s
    layout = LOOP_MTP if mtp else layout

    def chunks_of(stage: int) -> List[int]:
        return [chunk_index(stage, v, lo.pp, layout) for v in range(lo.vpp + (1 if mtp and stage == 0 else 0))]
    first_fwd = [sum(costs[chunk_index(s, v, lo.pp, layout)].duration("F") for v in range(lo.vpp))
                 for s in range(lo.pp)]
    gather_wait = [0.0] * lo.pp
    if ov.dp_param_gather.enabled:
        probe = run_pipeline(lo.pp, lo.vpp, micro, duration, lambda a, b: 0.0, True, schedule=schedule,
                             pair_duration=pair_duration, mtp_chunk=mtp)
        starts = [probe.times[s][0][0] for s in range(lo.pp)]
        gather_wait = [max(0.0, gather_exposed(dp[s]["gather"], first_fwd[s], dp[s]["buckets"]) - starts[s])
                       for s in range(lo.pp)]
    free = run_pipeline(lo.pp, lo.vpp, micro, duration, lambda a, b: 0.0, True, gather_wait, schedule,
                        pair_duration, mtp)
    real = (run_pipeline(lo.pp, lo.vpp, micro, duration, hop, ov.pp.enabled, gather_wait, schedule, pair_duration,
                         mtp) if lo.pp > 1 else free)
    ends = []
    tails = []
    for s in range(lo.pp):
        end = real.ends[s]
        grads = dp[s]["grads"]
        if ov.dp.enabled and grads > 0:
            spans = last_backward_spans(real, s, lo.pp)
            share = grads / len(spans)
            per = max(1, math.ceil(dp[s]["buckets"] / len(spans)))
            pieces = [p for (a, b) in spans.values() for p in buckets_over(a, b, share, per)]
            finish = max(end, bucket_finish(pieces))
        else:
            finish = end + grads
        tail_other = dp[s]["other"] + (0.0 if ov.dp_param_gather.enabled else dp[s]["gather"])
        tails.append((finish - end, tail_other))
        ends.append(finish + tail_other + update[s])
    crit = max(range(lo.pp), key=lambda s: ends[s])
    step = ends[crit]
    pipe_real = max(real.ends)
    pipe_free = max(free.ends)
    fcrit = max(range(lo.pp), key=lambda s: free.ends[s])
    bubble = pipe_free - free.busy[fcrit]
    forms = {}
    if lo.pp > 1:
        from mpoverlap.pipeline.bubble import closed_forms, stage_costs

        def cost_of(kind: str, s: int, v: int) -> float:
            # the MTP chunk's work spread over stage 0's chunks: the closed forms take a mean per chunk
            extra = duration(kind, lo.pp * lo.vpp) / lo.vpp if mtp and s == 0 else 0.0
            return duration(kind, chunk_index(s, v, lo.pp, layout)) + extra
        per_stage = stage_costs(schedule, lo.pp, lo.vpp, cost_of)
        pooled, form, at_stages = closed_forms(schedule, lo.pp, lo.vpp, per_stage)
        forms = {"schedule": schedule, "pooled": pooled, "form": form, "per_stage": at_stages}

    in_flight = {m: 0.0 for m in MODES}
    exposed = {m: 0.0 for m in MODES}
    compute = update[crit]
    memory = update_memory_seconds(cfg, lo, hw, crit)
    for chunk in chunks_of(crit):
        cost: ChunkCost = costs[chunk]
        for kind in ("F", "B"):
            compute += micro * cost.compute[kind]
            memory += micro * cost.memory[kind]
            for m, t in cost.in_flight[kind].items():
                in_flight[m] += micro * t
            for m, t in cost.exposed[kind].items():
                exposed[m] += micro * t
    if pipe_pairs is not None:
        # ep exposed per action of the critical stage's paired table: each pair's sides, the
        # lone forwards and backwards alone; the counts exchanges in flight beside the dispatches
        exposed["ep"], pairing_exposed = pipe_pairs.stage_exposed(real, crit)
        for v in range(lo.vpp):
            in_flight["ep"] += micro * pipe_pairs.counts(chunk_index(crit, v, lo.pp, layout))
        pairs = sum(1 for role, _ in real.pairs[crit] if role == 1)
        pairing_why += f"; {pairs} pairs on stage {crit}"
    # pp in flight as the ledger counts its handles (post to completion): a blocking transfer
    # also waits for its peer to post (rendezvous), which the wire time alone does not show,
    # and what that costs the step can exceed the wire time.
    in_flight["pp"] = real.ledger_in_flight[crit] + dp[crit]["pp_other"]
    exposed["pp"] = max(0.0, pipe_real - pipe_free) + dp[crit]["pp_other"]
    in_flight["tp"] += dp[crit]["tp_other"]
    exposed["tp"] += dp[crit]["tp_other"]
    in_flight["dp"] = dp[crit]["grads"] + dp[crit]["gather"]
    exposed["dp"] = tails[crit][0] + gather_wait[crit] + (0.0 if ov.dp_param_gather.enabled else dp[crit]["gather"])
    # Communication hidden under compute still costs the CPU that sends it (gloo ranks): the
    # step grows by those seconds (0 on GPUs, where comm_cpu_s_per_byte is 0).
    on_wire = dict(in_flight, pp=real.p2p_in_flight[crit] + dp[crit]["pp_other"])
    cpu = hidden_comm_cpu(hw, links, on_wire, exposed, enabled)
    # gloo writes a point-to-point send inline: its CPU time is spent inside the post, where
    # the ledger counts the caller as blocked (exposed pp); the collectives' CPU is spent on
    # gloo's threads, beside compute
    posted = cpu.pop("pp", 0.0)
    stolen = sum(cpu.values())
    exposed["pp"] += posted
    step += stolen + posted
    compute += stolen
    m, t = cfg.model, cfg.train
    tokens = t.global_batch_size * m.seq_length
    model_flops = flops_per_token(m) * tokens
    world = lo.world
    per_stage = [micro * sum(costs[k].compute[kind] for k in chunks_of(s) for kind in ("F", "B"))
                 for s in range(lo.pp)]
    # each stage's compute-bound seconds: its FLOPs at the GEMM rate (compute less memory-bound)
    flop_s = [per_stage[s] - micro * sum(costs[k].memory[kind] for k in chunks_of(s) for kind in ("F", "B"))
              for s in range(lo.pp)]
    # GEMMs at the FP8 rate (train.precision=fp8) ran `speed` x the FLOPs of their seconds
    fp8_extra = (fp8_speedup(cfg, hw) - 1.0) * micro * sum(c.fp8_s for c in costs)
    run_flops = (sum(flop_s) + fp8_extra) / lo.pp * hw.flops * world
    avg_compute = sum(per_stage[s] + update[s] for s in range(lo.pp)) / lo.pp + stolen
    ledger_pp = {}
    if lo.pp > 1:
        ledger_pp = {"in_flight_s": sum(real.ledger_in_flight) / lo.pp,
                     "exposed_s": sum(real.ledger_exposed) / lo.pp + posted}
    return SimResult(
        step_s=step,
        compute_s=compute,
        bubble_s=bubble,
        in_flight_s=in_flight,
        exposed_s=exposed,
        tokens_per_s=tokens / step,
        mfu=model_flops / (step * world * hw.peak_flops),
        critical_stage=crit,
        enabled=enabled,
        links={k: v.name for k, v in links.items() if k in ("tp", "cp", "dp", "ep", "pp")},
        ledger_pp=ledger_pp,
        avg_compute_s=avg_compute,
        useful_share=model_flops / run_flops if run_flops else 1.0,
        update_s=update[crit],
        comm_cpu_s=stolen,
        memory_s=memory,
        compute_bound_share=sum(flop_s) / lo.pp / avg_compute if avg_compute else 1.0,
        fp8_gain=(sum(flop_s) + fp8_extra) / sum(flop_s) if fp8_extra else 1.0,
        ep_pairing=pairing_why if lo.ep > 1 else "",
        ep_pairing_exposed=pairing_exposed,
        bubble_forms=forms,
    )


HIDDEN_LINK = {"dp": "dp", "tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp_hop"}


def hidden_comm_cpu(hw: Hardware, links, on_wire: Dict[str, float], exposed: Dict[str, float],
                    enabled: Dict[str, bool]) -> Dict[str, float]:
    """{mode: CPU seconds its communication hidden under compute takes from it}: per mode with
    overlap on, its hidden seconds (`on_wire`, seconds on the link, - exposed) times the bytes its
    link moves per second times `hw.comm_cpu_s_per_byte`. Exposed communication is waited for:
    its CPU work runs while compute is stopped anyway. {} where communication costs no CPU."""
    if hw.comm_cpu_s_per_byte <= 0:
        return {}
    return {m: max(0.0, on_wire.get(m, 0.0) - exposed.get(m, 0.0)) * links[k].bandwidth * hw.comm_cpu_s_per_byte
            for m, k in HIDDEN_LINK.items() if enabled.get(m)}


def update_seconds(cfg: Any, lo: Layout, hw: Hardware, stage: int) -> float:
    """Seconds of one rank of `stage` after its last backward: gradient norm, clip, AdamW and
    zeroing the gradient buffer, `hw.update_s_per_param` per parameter it updates (its
    parameters, over dp x cp when the optimizer is sharded, as DataParallelAdamW shards them),
    or, where the preset gives the HBM bandwidth, their bytes at that rate (memory.py)."""
    return updated_params(cfg, lo, stage) * hw.update_s_per_param + update_memory_seconds(cfg, lo, hw, stage)


def update_memory_seconds(cfg: Any, lo: Layout, hw: Hardware, stage: int) -> float:
    """The memory-bound part of `update_seconds`: the update's bytes at hardware.hbm_bw."""
    from mpoverlap.simulate.memory import update_bytes

    return hw.memory_seconds(update_bytes(updated_params(cfg, lo, stage))) if hw.hbm_bw > 0 else 0.0


def updated_params(cfg: Any, lo: Layout, stage: int) -> float:
    """Parameters one rank of `stage` updates: its own, over dp x cp when the optimizer is
    sharded (as DataParallelAdamW shards them)."""
    from mpoverlap.data_parallel.levels import resolve_level

    t = cfg.train
    level = resolve_level(getattr(t, "dp_sharding", "none"), bool(getattr(t, "distributed_optimizer", False)))
    shard = lo.dp * lo.cp if level != "none" else 1
    return stage_params(cfg, lo, stage) / shard


def _pp_message_bytes(cfg: Any, lo: Layout, c: int) -> float:
    """One activation (or its gradient) between stages, per microbatch: the estimate's pp
    send_recv volume over its count (4 per boundary and microbatch, both ends)."""
    if lo.pp <= 1:
        return 0.0
    micro = lo.num_microbatches or 1
    ops = comm_ops(cfg, lo, 0, stage_params(cfg, lo, 0), stage_params(cfg, lo, 0, expert_only=True), c)
    total = sum(o[2] for o in ops if o[0] == "pp" and o[1] == "send_recv")
    turn = 1 if chunk_layout_of(cfg, lo) == "v" else 0  # zbv's V: the turn stays on its stage
    to_mtp = 1 if mtp_own_chunk(cfg, lo) else 0  # the head's chunk to the MTP chunk on stage 0
    return total / (4 * micro * (lo.pp * lo.vpp - 1 - turn + to_mtp) / lo.pp)


def _dp_stage(cfg: Any, lo: Layout, hw: Hardware, links, stage: int, c: int) -> Dict[str, float]:
    """Seconds of the once-per-step collectives of `stage`: DP gradients (all-reduce or
    reduce-scatter), ZeRO-1's parameter gather, and the rest (tied embedding sum, SP's
    unsplit-gradient sum), with the number of gradient buckets."""
    out = {"grads": 0.0, "gather": 0.0, "other": 0.0, "pp_other": 0.0, "tp_other": 0.0, "buckets": 1}
    bucket = float(cfg.overlap.dp_bucket_mb) * 2 ** 20
    grad_bytes = 0.0
    for mode, op, nbytes, n in step_ops(cfg, lo, stage, c):
        if mode == "dp":
            link = links["dp"] if n == lo.dp * lo.cp else links["edp"]
            if op == "all_gather":
                out["gather"] += collective_time(op, nbytes, n, link, max(1, math.ceil(nbytes / bucket)))
            else:
                calls = max(1, math.ceil(nbytes / bucket))
                out["grads"] += collective_time(op, nbytes, n, link, calls)
                grad_bytes += nbytes
        elif mode == "pp":
            t = collective_time(op, nbytes * lo.pp / min(2, lo.pp), n, links["pp"])
            if stage in (0, lo.pp - 1):
                out["pp_other"] += t
                out["other"] += t
        else:
            t = collective_time(op, nbytes, n, links["tp"])
            out["tp_other"] += t
            out["other"] += t
    out["buckets"] = max(1, math.ceil(grad_bytes / bucket))
    return out
