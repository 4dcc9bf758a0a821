"""Per-rank estimates for the plan: parameters, memory per pipeline stage, communication
(buffer and link views), model FLOPs and the pipeline bubble.

Pure arithmetic on the config (no process group, no model built), so `mpoverlap-check` can
print them for a 4,096-rank layout in a second. Parameters are exact for this GPT; parameters,
gradients and Adam state are fp32 (the master weights under bf16 autocast too). Activations
count what each layer saves for backward (activations.py), in the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from mpoverlap.overlap.estimate.activations import (Conventions, layer_activation_bytes, recompute_mode,
                                                    stage_activation_peak)
from mpoverlap.overlap.estimate.attention_work import cp_attention_work_bytes
from mpoverlap.overlap.estimate.comm import comm_ops, comm_views
from mpoverlap.overlap.estimate.params import model_params, stage_layers, stage_params
from mpoverlap.overlap.estimate.sharding import delayed_grad_memory, residual_memory, state_memory
from mpoverlap.overlap.estimate.transients import head_stage, loss_backward_bytes, weight_cast_bytes
from mpoverlap.overlap.layout import build_layout

BYTES = 4  # fp32 parameters, gradients, optimizer state


@dataclass(frozen=True)
class StageEstimate:
    stage: int
    params: int
    memory_bytes: Dict[str, int]  # params, grads, optimizer, activations
    layers_in_flight: int  # layers' worth of activations alive at this stage's peak
    gathered_bytes: int = 0  # ZeRO-3: the gathered units' working set (inside memory_bytes["params"])


@dataclass(frozen=True)
class RankEstimate:
    params: int  # on the pipeline stage with the most parameters
    memory_bytes: Dict[str, int]  # of the stage with the largest total (params, grads, optimizer, activations)
    comm_bytes_per_step: Dict[str, int]  # BUFFER bytes per mode and step, per rank averaged (= the ledger)
    comm_link_bytes_per_step: Dict[str, int] = field(default_factory=dict)  # LINK bytes each rank sends
    stages: List[StageEstimate] = field(default_factory=list)
    layer_activation_bytes: int = 0  # stage 0's first layer, one microbatch
    model_flops_per_step: float = 0.0  # training FLOPs of the whole model per step (all ranks)
    bubble: float = 0.0  # (pp - 1) / (vpp m): pipeline idle over ideal compute
    conventions: Conventions = Conventions()
    # The heaviest stage's activation peak under each model.recompute mode (this config otherwise).
    activations_by_recompute: Dict[str, int] = field(default_factory=dict)
    total_params: int = 0  # the whole model (all ranks, each parameter once)
    pairing_extra_bytes: int = 0  # overlap.ep_pairing: activations above one microbatch's (in the peak)
    active_params: int = 0  # per token: a mixture of experts counts top_k of its experts


def activation_precision(cfg: Any) -> str:
    """train.precision as the activations, saved tensors and the dispatch see it: fp8 is bf16
    there (the FP8 GEMMs take and return bf16 and save their bf16 inputs for backward; FP8
    weight gathers are train.param_gather_dtype=fp8's, sharding.unit_gather_pass_bytes), any
    other value itself (the key is read only where the schema has it)."""
    from mpoverlap.precision.autocast import compute_precision

    return compute_precision(str(getattr(cfg.train, "precision", "fp32")))


def compute_bytes(cfg: Any) -> int:
    """Bytes of the compute dtype: 2 when `train.precision` is bf16 (or fp8, whose activations
    and non-FP8 GEMMs are bf16), else fp32's 4 (the key is read only where the schema has it)."""
    return 2 if activation_precision(cfg) in ("bf16", "fp16") else 4


def estimate(cfg: Any, world_size: Optional[int] = None, *, dtype_bytes: Optional[int] = None,
             conventions: Optional[Conventions] = None) -> RankEstimate:
    """The plan's figures for `cfg`. `dtype_bytes` overrides the compute dtype (2 = bf16);
    `conventions=Conventions.korthikanti()` counts activations as Korthikanti et al. 2022 do
    (16-bit, dropout, no flash) to compare with their Table 2."""
    from mpoverlap.models.flops import flops_per_token
    from mpoverlap.pipeline import bubble_fraction, resolve_schedule

    lo = build_layout(cfg, world_size)
    m, t = cfg.model, cfg.train
    conv = conventions or Conventions.for_dtype(dtype_bytes or compute_bytes(cfg))
    # per stage (all, expert) parameters, counted once: the planner estimates thousands of layouts
    counts = [(stage_params(cfg, lo, s), stage_params(cfg, lo, s, expert_only=True)) for s in range(lo.pp)]
    by_params = max(range(lo.pp), key=lambda s: counts[s][0])
    params, expert_params = counts[by_params]
    micro = lo.num_microbatches or 1
    mode = recompute_mode(cfg)
    peaks = stage_activation_peak(cfg, lo, conv, t.micro_batch_size, mode)
    stages = []
    for s in range(lo.pp):
        n, n_exp = counts[s]
        # train.dp_sharding shards dense state over dp x cp and expert state over edp = dp x cp / ep.
        mem = state_memory(cfg, lo, s, n, n_exp)
        gathered = mem.pop("gathered")
        residuals = residual_memory(cfg, lo, n, n_exp)
        if residuals:
            mem["grad_residuals"] = residuals
        if delayed_grad_memory(cfg, lo, n):
            mem["dp_delay_grads"] = delayed_grad_memory(cfg, lo, n)
        mem["activations"] = peaks[s]["bytes"]
        mem["weight_casts"] = weight_cast_bytes(cfg, lo, s, n, conv.compute_bytes)
        if s == head_stage(cfg, lo):
            mem["loss_backward"] = loss_backward_bytes(cfg, lo, conv.compute_bytes, t.micro_batch_size)
        if lo.cp > 1:
            # The attention layer in flight: ring buffers, accumulators, kernel workspace.
            mem["cp_attention_work"] = cp_attention_work_bytes(cfg, lo, conv.compute_bytes, t.micro_batch_size)
        stages.append(StageEstimate(s, n, mem, peaks[s]["layers_in_flight"], gathered))
    heaviest = max(stages, key=lambda st: sum(st.memory_bytes.values()))
    by_recompute = {other: max(p["bytes"] for p in (peaks if other == mode else
                                                    stage_activation_peak(cfg, lo, conv, t.micro_batch_size, other)))
                    for other in ("none", "selective", "full")}
    buffer, link = comm_views(stage_mean_dp(cfg, lo, comm_ops(cfg, lo, by_params, params, expert_params,
                                                              conv.compute_bytes, conv.residual_bytes), conv, counts))
    total_params, active_params = model_params(cfg)
    return RankEstimate(
        total_params=total_params, active_params=active_params, params=params, memory_bytes=dict(heaviest.memory_bytes), comm_bytes_per_step=buffer,
        comm_link_bytes_per_step=link, stages=stages,
        layer_activation_bytes=layer_activation_bytes(cfg, lo, stage_layers(cfg, lo, 0)[0], conv,
                                                      t.micro_batch_size),
        model_flops_per_step=flops_per_token(m) * t.global_batch_size * m.seq_length,
        bubble=(bubble_fraction(lo.pp, lo.vpp, micro, resolve_schedule(getattr(cfg.parallel, "pp_schedule", "auto"), lo.vpp))
                if lo.pp > 1 else 0.0), conventions=conv,
        activations_by_recompute=by_recompute, pairing_extra_bytes=peaks[0].get("pairing_extra", 0))


def stage_mean_dp(cfg: Any, lo: Any, ops: list, conv: Conventions, counts: Optional[list] = None) -> list:
    """`ops` (the busiest stage's) with its dp operations replaced by their mean over the
    pipeline stages: the ledger reports the mean over the ranks, and a stage's dp bytes follow
    its parameters (zbv's V puts the embedding and the head both on stage 0: +9% over the mean
    at pp 2 with the busiest stage's bytes)."""
    if lo.pp < 2:
        return ops
    counts = counts or [(stage_params(cfg, lo, s), stage_params(cfg, lo, s, expert_only=True)) for s in range(lo.pp)]
    dp = [(mode, op, nbytes / lo.pp, n)
          for s in range(lo.pp)
          for mode, op, nbytes, n in comm_ops(cfg, lo, s, *counts[s], conv.compute_bytes, conv.residual_bytes)
          if mode == "dp"]
    return [o for o in ops if o[0] != "dp"] + dp


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _signed_mib(n: float) -> str:
    return ("+" if n >= 0 else "-") + _mib(abs(n))


def _flops(n: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def render_estimate(est: RankEstimate, world: Optional[int] = None) -> str:
    conv = est.conventions
    dtype = {2: "16-bit", 4: "fp32"}.get(conv.compute_bytes, f"{conv.compute_bytes}-byte")
    how = ("Korthikanti et al. 2022 conventions: 16-bit, dropout, no flash" if conv.dropout
           else f"{dtype} compute, {'flash' if conv.flash else 'math'} attention")
    heaviest = max(est.stages, key=lambda st: sum(st.memory_bytes.values()))
    total = _mib(sum(heaviest.memory_bytes.values()))
    # The parameter count is the plan's line (overlap/plan.py), printed just above.
    lines = [f"  memory per rank ({how}); heaviest stage {heaviest.stage}: ~{total}",
             "    stage | parameters | params+grads+optim | activations (layers in flight) | total"]
    for st in est.stages:
        mem = st.memory_bytes
        state = _mib(mem["params"] + mem["grads"] + mem["optimizer"])
        lines.append(f"    {st.stage:>5} | {st.params / 1e6:>9.2f}M | {state:>17} |"
                     f" {_mib(mem['activations']):>14} ({st.layers_in_flight:>3}) | {_mib(sum(mem.values()))}")
    if "grad_residuals" in heaviest.memory_bytes:
        lines.append(f"    gradient error-feedback residuals (fp32, in the total): "
                     f"{_mib(heaviest.memory_bytes['grad_residuals'])}")
    if "dp_delay_grads" in heaviest.memory_bytes:
        lines.append(f"    overlap.dp_delay=1: the second gradient buffer holding the reduction in flight (in the "
                     f"total): {_mib(heaviest.memory_bytes['dp_delay_grads'])}")
    if "cp_attention_work" in heaviest.memory_bytes:
        lines.append(f"    context-parallel attention working set (K/V double buffer, out/lse accumulators, "
                     f"kernel workspace; in the total): {_mib(heaviest.memory_bytes['cp_attention_work'])}")
    casts, loss = heaviest.memory_bytes.get("weight_casts", 0), heaviest.memory_bytes.get("loss_backward", 0)
    if casts or loss:
        lines.append(f"    in the total: the step's bf16 weight casts {_mib(casts)}, the loss's backward (the logits' "
                     f"gradient and its fp32 block) {_mib(loss)} (estimate/transients.py)")
    if heaviest.gathered_bytes:
        lines.append(f"    ZeRO-3: parameters = this rank's shards + {_mib(heaviest.gathered_bytes)} of gathered units "
                     "in use or prefetched (train.reshard_after_forward, overlap.dp_prefetch)")
    lines.append(f"    activations of one layer, one microbatch: {_mib(est.layer_activation_bytes)}")
    if est.pairing_extra_bytes:
        if len(est.stages) > 1:
            lines.append("    forward/backward pairing (overlap.ep_pairing): the paired table's order (interleaved and "
                         "zb1p: one extra warm-up forward per stage; zbv: the paired V) and the sub-step boundary "
                         f"buffers: {_signed_mib(est.pairing_extra_bytes)} against the unpaired table's peak on stage 0 "
                         "(in the peak above)")
        else:
            lines.append("    forward/backward pairing (overlap.ep_pairing): a second microbatch in flight, the forward "
                         "of i+1 beside the backward of i (layer t beside layer L-1-t): "
                         f"+{_mib(est.pairing_extra_bytes)} over one microbatch's activations (in the peak above)")
    if est.activations_by_recompute:
        by = est.activations_by_recompute
        lines.append("    activation peak with model.recompute=none / selective / full: "
                     + " / ".join(_mib(by[k]) for k in ("none", "selective", "full"))
                     + " (selective saves little with flash attention: the core keeps no s^2 tensor)")
    per_rank = f" ({_flops(est.model_flops_per_step / world)} per rank)" if world else ""
    lines.append(f"  model FLOPs per step: {_flops(est.model_flops_per_step)}{per_rank}; "
                 f"pipeline bubble {est.bubble:.3f} of the compute ((p-1)/(v m); a third of it for zb1p and zbv)")
    if est.comm_bytes_per_step:
        lines.append("  communication per step per rank (estimate):")
        for mode, nbytes in est.comm_bytes_per_step.items():
            lines.append(f"    {mode:<3} buffers {_mib(nbytes):>14} (what metrics.jsonl counts)   "
                         f"link {_mib(est.comm_link_bytes_per_step.get(mode, 0)):>14} (sent by the algorithm)")
    else:
        lines.append("  communication per step per rank (estimate): none")
    return "\n".join(lines)
