"""The simulated step as `mpoverlap-check --simulate` prints it: the step's decomposition, why
its MFU is what it is, each mode's communication in flight and exposed, and the pipeline
schedule's closed-form bubble beside the simulated idle (core.py computes the figures)."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Dict, Optional

from mpoverlap.overlap.layout import build_layout
from mpoverlap.simulate.costs import MODES
from mpoverlap.simulate.hardware import Hardware

if TYPE_CHECKING:
    from mpoverlap.simulate.core import SimResult


def render(cfg: Any, hw: Hardware, r: SimResult, world_size: Optional[int] = None) -> str:
    from mpoverlap.simulate.hardware import describe

    lo = build_layout(cfg, world_size)
    exposed = sum(r.exposed_s.values())
    lines = [f"mpoverlap simulate: world {lo.world} = tp {lo.tp} x cp {lo.cp} x dp {lo.dp} x pp {lo.pp} "
             f"(ep {lo.ep}, vpp {lo.vpp}), {lo.num_microbatches} microbatch(es) of {cfg.train.micro_batch_size}",
             f"  hardware {describe(hw)}",
             f"  step {r.step_s * 1e3:,.2f} ms on stage {r.critical_stage}: compute {r.compute_s * 1e3:,.2f} ms"
             f"{f' (of it {r.update_s * 1e3:,.2f} ms optimizer update)' if r.update_s > 0 else ''}"
             f"{f' (of it {r.comm_cpu_s * 1e3:,.2f} ms CPU of hidden communication)' if r.comm_cpu_s > 0 else ''}, "
             f"pipeline idle {r.bubble_s * 1e3:,.2f} ms (bubble and stage imbalance), exposed communication "
             f"{exposed * 1e3:,.2f} ms",
             f"  of the compute: compute-bound {(r.compute_s - r.memory_s) * 1e3:,.2f} ms (FLOPs at "
             f"{hw.peak_flops / 1e12:,.4g} TFLOP/s x {hw.gemm_efficiency:.2f}"
             + (f"; the GEMMs train.precision=fp8 covers at its {hw.fp8_peak_flops / 1e12:,.4g} TFLOP/s"
                if r.fp8_gain != 1.0 else "") + "), memory-bound "
             + (f"{r.memory_s * 1e3:,.2f} ms ({r.memory_s * hw.hbm_bw / 1e9:,.1f} GB of norms, activations, RoPE, "
                f"casts, residual adds, the fp32 loss and the update at {hw.hbm_bw / 1e12:,.4g} TB/s HBM)"
                if hw.hbm_bw > 0 else "not modelled (hardware.hbm_bw not set: gemm_efficiency covers the step)"),
             f"  {r.tokens_per_s:,.0f} tokens/s, MFU {100 * r.mfu:.1f}% of {hw.peak_flops / 1e12:,.4g} TFLOP/s peak",
             f"  why: MFU = GEMM fraction {hw.gemm_efficiency:.2f} x "
             + (f"FP8 gain {r.fp8_gain:.2f} (FLOPs run per FLOP second over the bf16 rate's) x " if r.fp8_gain != 1.0 else "")
             + f"useful share {r.useful_share:.2f} (model FLOPs "
             f"over FLOPs run: recomputation and the head counted as run) x compute-bound share "
             f"{r.compute_bound_share:.2f} (FLOP seconds over compute: the rest memory-bound and the update) x busy share "
             f"{r.avg_compute_s / r.step_s:.2f} (mean stage compute over the step; the rest is pipeline idle "
             f"{r.bubble_s / r.step_s:.0%} and exposed communication {exposed / r.step_s:.0%} on the slowest stage)",
             "  mode | overlap | link  | in flight (ms/step) | exposed (ms/step) | exposed share | of step",
             "  ---- | ------- | ----- | ------------------- | ----------------- | ------------- | -------"]
    for m in MODES:
        t = r.in_flight_s.get(m, 0.0)
        if t <= 0:
            continue
        e = r.exposed_s.get(m, 0.0)
        lines.append(f"  {m:<4} | {'ON' if r.enabled[m] else 'off':<7} | {r.links.get(m, '-'):<5} | {t * 1e3:>19,.3f} | "
                     f"{e * 1e3:>17,.3f} | {e / t:>13.2f} | {e / r.step_s:>6.1%}")
    if r.in_flight_s.get("dp", 0.0) > 0:
        lines.append(grad_format_line(cfg, hw, r, world_size))
    if r.core_sharing:
        c = r.core_sharing
        lines.append(f"  cores shared: {c['ranks']} ranks on {c['cores']} cores, each computing {c['runnable']:.0%} of "
                     f"the step: compute x{c['stretch']:.2f} (the rates above are a core's)")
    if r.bubble_forms:
        lines.append(bubble_form_line(r.bubble_forms, r.bubble_s, "the simulated idle above"))
    if r.ep_pairing:
        x = r.ep_pairing_exposed
        lines.append(f"  ep forward/backward pairing (overlap.ep_pairing): {r.ep_pairing}" + (
            f"; ep exposed per pair {(x['F'] + x['B']) * 1e3:,.3f} ms (forward's exchanges {x['F'] * 1e3:,.3f}, "
            f"backward's {x['B'] * 1e3:,.3f}), unpaired forward {x['F_alone'] * 1e3:,.3f} ms, backward "
            f"{x['B_alone'] * 1e3:,.3f} ms" if x else ""))
    return "\n".join(lines)


GRAD_FORMATS = ("fp32", "bf16", "int8", "fp8")  # train.grad_reduce_dtype


def grad_format_line(cfg: Any, hw: Hardware, r: SimResult, world_size: Optional[int] = None) -> str:
    """The same step with each train.grad_reduce_dtype: what each gradient wire format would save."""
    from mpoverlap.simulate.core import simulate

    asked = str(cfg.train.grad_reduce_dtype)
    parts = []
    for fmt in GRAD_FORMATS:
        if fmt == asked:
            step, dp = r.step_s, r.exposed_s.get("dp", 0.0)
        else:
            other = copy.deepcopy(cfg)
            other.train.grad_reduce_dtype = fmt
            sim = simulate(other, hw, world_size)
            step, dp = sim.step_s, sim.exposed_s.get("dp", 0.0)
        parts.append(f"{fmt}{' (this run)' if fmt == asked else ''} {step * 1e3:,.2f} ms (dp exposed {dp * 1e3:,.3f})")
    return "  dp gradients per format (train.grad_reduce_dtype), step: " + ", ".join(parts)


def bubble_form_line(forms: Dict[str, Any], against_s: float, against: str) -> str:
    """The closed-form bubble at the pooled per-chunk costs and at each stage's own, beside
    `against_s` (a simulated or measured bubble, named by `against`)."""
    from mpoverlap.pipeline import defers_weight_grads

    f, b, w = forms["pooled"]
    form = forms["form"]
    costs = (f"F/B/W {f * 1e3:,.3f}/{b * 1e3:,.3f}/{w * 1e3:,.3f}" if defers_weight_grads(forms["schedule"])
             else f"F/B {f * 1e3:,.3f}/{b * 1e3:,.3f} (B the whole backward, W = 0)")
    return (f"  bubble closed form, {forms['schedule']} {form.describe()}: {form.seconds * 1e3:,.2f} ms at the pooled "
            f"per-chunk {costs} ms; at each stage's own costs "
            + "/".join(f"{x.seconds * 1e3:,.2f}" for x in forms["per_stage"])
            + f" ms; {against}: {against_s * 1e3:,.2f} ms")
