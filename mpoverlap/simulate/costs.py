"""Per model chunk and microbatch: forward and backward compute seconds from FLOPs, and each
mode's communication in flight and exposed inside them (TP, CP, EP); per step: the DP and
PP volumes. Volumes come from the estimate (`estimate.comm_ops`, checked against the ledger),
spread evenly over a stage's layers and microbatches; FLOPs are counted here per layer.

FLOPs per rank, layer and microbatch forward (t tokens = b s / cp on this rank, s the whole
sequence, tp the tensor-parallel degree; backward is twice the forward):
  attention GEMMs  2 t (H (H + 2 H g/N) + H^2) / tp     (qkv with g query groups of N heads, proj)
  attention core   4 t s H / tp                          (scores and values, the causal half not
                                                          discounted, as `flops_per_token` counts)
  latent attention the replicated down-projections over t' tokens (t / tp with SP), the
                   split up-projections and proj over t / tp (estimate/latent.py); the core
                   2 t s N (n + p + v) / tp (q/k and v of their own widths)
  dense MLP        2 t m H F / tp                        (m = 3 SwiGLU, 2 GeLU)
  MoE MLP          2 t' (k + shared) m H F_e + 2 t' H E  (t' = t / tp with SP, else t)
  output head      2 t H V / tp on the last chunk
Recomputation adds to backward the forward of what it replays: `full` whole blocks (the first
model.recompute_num_layers of each chunk), `selective` the attention core.
Under train.precision=fp8 the GEMMs the FP8 path covers (attention GEMMs, dense MLP, experts,
shared expert: forward, input and weight gradients) run at the preset's FP8 peak x
gemm_efficiency (hardware.fp8_peak_flops; refused where the preset has none); the attention
core, the router and the head stay at the bf16 rate. Activations, saved tensors and gathers
are the bf16 run's: the FP8 Functions save their bf16 inputs and quantize again in backward
(precision/fp8.py, fp8_grouped.py), and parameters are gathered in bf16 (estimate.core). The
FP8 casts of every operand at each use are memory-bound time (memory.py `fp8_cast_bytes`).
Beside the FLOPs at peak x gemm_efficiency, each layer and the head carry memory-bound seconds:
their elementwise bytes (memory.py) at hardware.hbm_bw (0 where the preset does not set it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from mpoverlap.models.init import padded_vocab_size, qkv_rows
from mpoverlap.overlap.estimate import latent
from mpoverlap.overlap.estimate.activations import recomputed_in_chunk
from mpoverlap.overlap.estimate.comm import comm_ops, ep_forward_share, replayed_ops
from mpoverlap.overlap.estimate.latent import core_widths, is_latent
from mpoverlap.overlap.estimate.mtp import mtp_depths_in_chunk
from mpoverlap.overlap.estimate.params import (chunk_layers, chunk_layout_of, expert_ffn, is_moe_layer, mlp_mult,
                                               num_chunks, shared_expert_ffn, stage_layers, stage_params)
from mpoverlap.pipeline.actions import stage_of
from mpoverlap.overlap.config import ep_chunks
from mpoverlap.overlap.layout import Layout
from mpoverlap.simulate.collectives import collective_time, steps
from mpoverlap.simulate.hardware import Hardware, Link, fp8_speedup
from mpoverlap.simulate.memory import head_bytes, layer_bytes
from mpoverlap.simulate.overlap import cp_ring_exposed, ep_chunks_exposed, ring_exposed
from mpoverlap.simulate.pairing import LayerPass

MODES = ("dp", "tp", "pp", "cp", "ep")


@dataclass
class ChunkCost:
    """One microbatch through one model chunk on its stage: seconds of compute and, per mode,
    of communication in flight and exposed, for the forward ("F") and the backward ("B")."""
    compute: Dict[str, float] = field(default_factory=lambda: {"F": 0.0, "B": 0.0})
    # of `compute`, the memory-bound seconds (memory.py's bytes at hardware.hbm_bw)
    memory: Dict[str, float] = field(default_factory=lambda: {"F": 0.0, "B": 0.0})
    in_flight: Dict[str, Dict[str, float]] = field(default_factory=lambda: {"F": {}, "B": {}})
    exposed: Dict[str, Dict[str, float]] = field(default_factory=lambda: {"F": {}, "B": {}})
    # per layer of the chunk, in forward order: its forward and its backward cut into the
    # sub-steps EP pairing interleaves (pairing.py)
    layers: Dict[str, List[LayerPass]] = field(default_factory=lambda: {"F": [], "B": []})
    # of `compute` (forward and backward), the seconds of GEMMs run at the FP8 rate
    # (train.precision=fp8): their FLOPs are that many seconds at the FP8 rate, not the bf16 one
    fp8_s: float = 0.0

    def duration(self, kind: str) -> float:
        return self.compute[kind] + sum(self.exposed[kind].values())

    def add(self, kind: str, mode: str, in_flight: float, exposed: float) -> None:
        self.in_flight[kind][mode] = self.in_flight[kind].get(mode, 0.0) + in_flight
        self.exposed[kind][mode] = self.exposed[kind].get(mode, 0.0) + exposed


def moe_tokens(cfg: Any, lo: Layout) -> float:
    """Tokens of one microbatch an MoE layer routes on a rank: its b s / cp, over tp too when
    sequence parallelism splits them."""
    t = cfg.train.micro_batch_size * cfg.model.seq_length / lo.cp
    return t / lo.tp if (cfg.parallel.sequence_parallel and lo.tp > 1) else t


def layer_flops(cfg: Any, lo: Layout, i: int) -> Dict[str, float]:
    """Forward FLOPs of layer i per rank and microbatch: attention GEMMs, attention core, MLP
    (dense or experts), the shared expert (under the first dispatch with EP overlap)."""
    m = cfg.model
    H, s, tp = m.hidden_size, m.seq_length, lo.tp
    t = cfg.train.micro_batch_size * s / lo.cp
    q, kv, _ = qkv_rows(m)  # N D and G D (H and H G / N unless model.head_dim says otherwise)
    out = {"attn_gemm": 2 * t * (H * (q + 2 * kv) + q * H) / tp, "core": 4 * t * s * q / tp, "shared": 0.0}
    if is_latent(m):  # latent attention: replicated down-projections, q/k and v of their own widths
        q_w, _, v_w = core_widths(m)
        out["attn_gemm"] = latent.gemm_flops(m, t, moe_tokens(cfg, lo), tp)
        out["core"] = 2 * t * s * (q_w + v_w) / tp
    if is_moe_layer(m, i):
        t_moe = moe_tokens(cfg, lo)
        fe = expert_ffn(m)
        out["mlp"] = 2 * t_moe * m.moe_top_k * mlp_mult(m) * H * fe + 2 * t_moe * H * m.num_experts
        # the shared expert is split over tp like a dense MLP (every position, F/tp)
        out["shared"] = 2 * t * mlp_mult(m) * H * shared_expert_ffn(m) / tp
    else:
        out["mlp"] = 2 * t * mlp_mult(m) * H * m.ffn_hidden_size / tp
    return out


def head_flops(cfg: Any, lo: Layout) -> float:
    m = cfg.model
    V = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    return 2 * cfg.train.micro_batch_size * m.seq_length / lo.cp * m.hidden_size * V / lo.tp


def eh_proj_flops(cfg: Any, lo: Layout) -> float:
    """Forward FLOPs of one MTP depth's eh_proj ([hidden ; embedding] 2H -> H, a plain Linear
    every tp rank runs whole) per rank and microbatch."""
    m = cfg.model
    return 2 * cfg.train.micro_batch_size * m.seq_length / lo.cp * 2 * m.hidden_size * m.hidden_size


def _mode_ops(ops: List, mode: str) -> List:
    return [o for o in ops if o[0] == mode]


def chunk_costs(cfg: Any, lo: Layout, hw: Hardware, links: Dict[str, Link], enabled: Dict[str, bool],
                c: int) -> List[ChunkCost]:
    """ChunkCost of every model chunk (its global index; on the stage `chunk_layout_of` places it; the MTP chunk
    pp*vpp of its own on stage 0 last where parallel.mtp_stage=0 makes one); `enabled[mode]` says whether the
    mode's overlap is on; `c` bytes of the compute dtype. The MTP depths count on the chunk holding them
    (`mtp_depths_in_chunk`), each a block (layer L + d) plus its eh_proj (`eh_proj_flops`) and head."""
    m, p = cfg.model, cfg.parallel
    micro = lo.num_microbatches or 1
    sp = bool(p.sequence_parallel) and lo.tp > 1
    recompute = getattr(m, "recompute", "none")
    rate = hw.flops
    speed = fp8_speedup(cfg, hw)
    costs: List[ChunkCost] = []
    per_stage = {}
    for stage in range(lo.pp):
        params = stage_params(cfg, lo, stage)
        expert = stage_params(cfg, lo, stage, expert_only=True)
        every = comm_ops(cfg, lo, stage, params, expert, c)
        replay = replayed_ops(cfg, lo, stage, c)
        base = list(every[:len(every) - len(replay)]) if replay else list(every)
        per_stage[stage] = (base, replay, len(stage_layers(cfg, lo, stage)),
                            sum(is_moe_layer(m, i) for i in stage_layers(cfg, lo, stage)))
    layout = chunk_layout_of(cfg, lo)
    for chunk in range(num_chunks(cfg, lo)):
        stage = stage_of(chunk, lo.pp, layout)
        base, replay, n_layers, n_moe = per_stage[stage]
        cost = ChunkCost()
        replayed = set(recomputed_in_chunk(cfg, lo, chunk)) if recompute == "full" else set()
        depths = mtp_depths_in_chunk(cfg, lo, chunk)
        for i in chunk_layers(cfg, lo, chunk) + [m.num_layers + d for d in range(depths)]:
            fl = layer_flops(cfg, lo, i)
            fwd = sum(fl.values())
            # an MoE layer: the experts' GEMMs at the experts' own rate (timed on this rank's
            # experts with a dispatch chunk's rows), the rest (the router too) at the model's;
            # under train.precision=fp8 the GEMMs it covers (the blocks' linears, the experts,
            # the shared expert; not the router, the attention core or the head) `speed` x faster
            moe = is_moe_layer(m, i)
            router = 2 * moe_tokens(cfg, lo) * m.hidden_size * m.num_experts if moe else 0.0
            expert_flops = fl["mlp"] - router if moe else 0.0
            covered = fl["attn_gemm"] + fl["shared"] + (0.0 if moe else fl["mlp"])
            fast = covered / (rate * speed)  # seconds of the dense covered GEMMs
            gemms = expert_flops / ((hw.expert_flops or rate) * speed)
            # the forward but the experts (covered GEMMs at their own rate under fp8)
            dense = (fwd - expert_flops) / rate if speed == 1.0 else (fwd - expert_flops - covered) / rate + fast
            f_time = dense + gemms
            extra = dense if i in replayed else (fl["core"] / rate if recompute == "selective" else 0.0)
            b_time = 2 * dense + extra + 2 * gemms
            if moe and i in replayed:  # full recompute replays the experts too
                b_time += gemms
            replays = 1 if i in replayed else 0
            cost.fp8_s += (fast + gemms) * (3 + replays) if speed != 1.0 else 0.0
            # the memory-bound time (elementwise work, casts, the weights' casts and gradient
            # accumulation) after the GEMMs, on the same stream: it adds (pre-dispatch compute
            # for pairing); the communication above hides under the GEMMs only
            mem = {k: hw.memory_seconds(v) for k, v in layer_bytes(cfg, lo, i, c).items()}
            mem["B"] += mem["F"] if i in replayed else 0.0  # full recompute replays the forward's
            f_time += mem["F"]
            b_time += mem["B"]
            for k in ("F", "B"):
                cost.memory[k] += mem[k]
            cost.compute["F"] += f_time
            cost.compute["B"] += b_time
            passes = {"F": LayerPass(f_time), "B": LayerPass(b_time)}
            share = micro * max(1, n_layers)
            _tp(cost, base, replay, lo, links["tp"], enabled["tp"], sp, fl, rate * speed, share, i in replayed, moe)
            _cp(cost, base, replay, lo, links["cp"], enabled["cp"], p.cp_comm, fl, rate, share)
            if moe:
                wire = _ep(cost, base, replay, lo, links["ep"], enabled["ep"], ep_chunks(cfg),
                           gemms + router / rate, fl["shared"] / (rate * speed), micro * max(1, n_moe),
                           ep_forward_share(cfg, c))
                # pairing's sub-steps: the router before the dispatch, the GEMMs after it; the
                # forward's counts exchange (its few bytes are in the volume): one call's latency
                counts = steps("all_to_all", lo.ep) * links["ep"].latency if wire else 0.0
                passes = {k: _moe_pass(passes[k].pre, f * gemms, f * fl["shared"] / (rate * speed), wire.get(k, 0.0),
                                       counts if k == "F" else 0.0) for k, f in (("F", 1), ("B", 2))}
            for k in ("F", "B"):
                cost.layers[k].append(passes[k])
        heads = depths + (1 if chunk == lo.pp * lo.vpp - 1 else 0)  # each depth runs the head too
        if heads:
            head = {k: heads * hw.memory_seconds(v) for k, v in head_bytes(cfg, lo, c).items()}
            flops = heads * head_flops(cfg, lo) + depths * eh_proj_flops(cfg, lo)
            cost.compute["F"] += flops / rate + head["F"]
            cost.compute["B"] += 2 * flops / rate + head["B"]
            for k in ("F", "B"):
                cost.memory[k] += head[k]
        costs.append(cost)
    return costs


def _tp(cost: ChunkCost, base, replay, lo: Layout, link: Link, on: bool, sp: bool, fl, rate: float, share: int,
        replayed: bool, moe_layer: bool = False) -> None:
    """TP per layer: SP's 4 forward and 6 backward gathers/scatters (collective matmul under the
    GEMMs when on), or without SP 2 + 2 all-reduces: the forward's waited at once, the backward's
    (each column-parallel linear's input gradient) under that linear's wgrad GEMM when on, except
    where a zero-bubble schedule defers the W (then only a bias sum is under it: exposed)."""
    if lo.tp <= 1:
        return
    kinds = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
    by_op = {k: sum(o[2] for o in _mode_ops(base, "tp") if o[1] == k) / share for k in kinds}
    main = sum(by_op.values())
    fwd_calls, bwd_calls = (4, 6) if sp else (2, 2)
    fwd_bytes = main * fwd_calls / (fwd_calls + bwd_calls)
    bwd_bytes = main - fwd_bytes
    if replayed:  # full recompute replays the forward's collectives in backward
        bwd_bytes += sum(o[2] for o in _mode_ops(replay, "tp")) / share
    gemm = (fl["attn_gemm"] + fl["mlp"]) / rate

    ring = on and sp  # collective matmul: the gathers and scatters go as point-to-point ring steps

    def time_of(nbytes: float, calls: int) -> float:
        # the bytes and calls split between the ops as the step's volumes are (SP: gathers and
        # scatters, which a backend may run at different rates)
        return sum(collective_time(k, nbytes * v / main, lo.tp, link, calls * v / main,
                                   carried_by="send_recv" if ring else "") for k, v in by_op.items()) \
            if main > 0 else 0.0

    for kind, nbytes, calls, under in (("F", fwd_bytes, fwd_calls, gemm), ("B", bwd_bytes, bwd_calls, 2 * gemm)):
        t = time_of(nbytes, calls)
        exposed = ring_exposed(t, under, calls * (lo.tp - 1), calls * lo.tp) if ring else t
        if kind == "B" and on and not sp and not _w_deferred(lo):
            # one all-reduce under the column linears' wgrad GEMMs of attention, one under the MLP's
            exposed = sum(max(0.0, t / 2 - w) for w in _column_wgrad_seconds(lo.cfg.model, fl, rate, moe_layer))
        cost.add(kind, "tp", t, exposed)


def _w_deferred(lo: Layout) -> bool:
    """A zero-bubble schedule (zb1p, zbv at pp > 1) runs the weight gradients in later W actions."""
    return lo.pp > 1 and str(lo.cfg.parallel.pp_schedule) in ("zb1p", "zbv")


def _column_wgrad_seconds(m: Any, fl, rate: float, moe_layer: bool) -> Tuple[float, float]:
    """Seconds of the column-parallel linears' wgrad GEMMs (each as long as its forward): the q/k/v
    projection of attention (its rows' share of the attention GEMMs; the up-projections' under
    MLA, taken as half), and a dense MLP's fc1 (swiglu's gate_up: 2 of its 3 products, gelu's up:
    1 of 2); an MoE layer's experts are no column-parallel linear (nothing under that one)."""
    if is_latent(m):
        attn = 0.5
    else:
        q, kv, _ = qkv_rows(m)
        attn = (q + 2 * kv) / (2 * q + 2 * kv)
    mult = mlp_mult(m)
    mlp = 0.0 if moe_layer else fl["mlp"] * (mult - 1) / mult
    return fl["attn_gemm"] * attn / rate, mlp / rate


def _cp(cost: ChunkCost, base, replay, lo: Layout, link: Link, on: bool, cp_comm: str, fl, rate: float,
        share: int) -> None:
    if lo.cp <= 1:
        return
    op = "all_to_all" if cp_comm == "a2a" else "send_recv"
    main = sum(o[2] for o in _mode_ops(base, "cp") if o[1] == op) / share
    main_b = main + sum(o[2] for o in _mode_ops(replay, "cp") if o[1] == op) / share
    core = fl["core"] / rate
    if op == "send_recv":
        hops_f, hops_b = lo.cp - 1, 2 * lo.cp - 1
        fwd = collective_time(op, main * hops_f / (hops_f + hops_b), 2, link, hops_f)
        bwd = collective_time(op, main_b - main * hops_f / (hops_f + hops_b), 2, link, hops_b)
        ef, eb = cp_ring_exposed(fwd, bwd, core, 2 * core, lo.cp) if on else (fwd, bwd)
    else:
        fwd = collective_time(op, main / 2, lo.cp, link, 4)
        bwd = collective_time(op, main_b - main / 2, lo.cp, link, 4)
        # two head groups: one group's exchange under the other's attention
        ef = fwd / 2 + ring_exposed(fwd / 2, core / 2, 1, 1) if on else fwd
        eb = bwd / 2 + ring_exposed(bwd / 2, core, 1, 1) if on else bwd
    cost.add("F", "cp", fwd, ef)
    cost.add("B", "cp", bwd, eb)


def _moe_pass(total: float, experts: float, shared: float, wire: float, counts: float) -> LayerPass:
    """An MoE layer's pass of `total` compute seconds cut into sub-steps: the experts' seconds
    (at their own rate; at most what the total leaves after the shared expert), the shared
    expert's, the rest before the dispatch; `wire` seconds of exchanges, half each way;
    `counts` seconds of the counts exchange."""
    experts = min(experts, max(0.0, total - shared))
    return LayerPass(max(0.0, total - experts - shared), experts, shared, wire / 2, wire / 2, counts)


def _ep(cost: ChunkCost, base, replay, lo: Layout, link: Link, on: bool, chunks: int, experts: float,
        shared: float, share: int, forward: float = 0.5) -> Dict[str, float]:
    """EP per MoE layer pass: the token exchanges (dispatch and combine, ep_chunks each) under
    the experts' `experts` seconds of forward (twice in backward) and the shared expert's;
    `forward` of the pass's bytes move in forward (less than half with an fp8 dispatch).
    Returns the exchanges' seconds per pass ({"F", "B"}; {} without EP)."""
    wire: Dict[str, float] = {}
    if lo.ep <= 1:
        return wire
    ops = [o for o in _mode_ops(base, "ep")]
    if not ops:
        return wire
    op = ops[0][1]
    main = sum(o[2] for o in ops) / share
    again = sum(o[2] for o in _mode_ops(replay, "ep")) / share
    for kind, nbytes, under, sh in (("F", main * forward, experts, shared),
                                    ("B", main * (1 - forward) + again, 2 * experts, 2 * shared)):
        t = collective_time(op, nbytes, lo.ep, link, 2 * chunks)
        exposed = ep_chunks_exposed(t / 2, t / 2, under, chunks, sh, backward=kind == "B") if on else t
        cost.add(kind, "ep", t, exposed)
        wire[kind] = t
    return wire


def step_ops(cfg: Any, lo: Layout, stage: int, c: int) -> List:
    """The once-per-step operations of `stage` (DP gradients and parameters, the tied
    embedding's sum, SP's unsplit-gradient sum, router statistics)."""
    params, expert = stage_params(cfg, lo, stage), stage_params(cfg, lo, stage, expert_only=True)
    ops = comm_ops(cfg, lo, stage, params, expert, c)
    out = [o for o in ops if o[0] == "dp" or (o[0] == "pp" and o[1] == "all_reduce")]
    if bool(cfg.parallel.sequence_parallel) and lo.tp > 1:
        out += [o for o in ops if o[0] == "tp" and o[1] == "all_reduce"]
    return out
