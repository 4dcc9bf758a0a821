"""What each format would save, for `mpoverlap-check --simulate`: the same layout simulated
again with the format switched, the step (and the mode's communication) beside the run's.

GEMMs: under train.precision=fp8, the step with train.precision=bf16 beside it (`precision_line`).
EP: train.ep_dispatch_dtype (moe/dispatch_wire.py), fp8 against the activation dtype, on the
layouts where fp8 dispatch is valid (an MoE model, ep > 1, a hidden size 128 divides)."""
from __future__ import annotations

from typing import Any, List


def precision_line(fp8, bf16) -> str:
    """The fp8 step (SimResult) beside the same layout's bf16 step."""
    return (f"  GEMM precision (train.precision): fp8 step {1e3 * fp8.step_s:,.2f} ms, {fp8.tokens_per_s:,.0f} tokens/s; "
            f"bf16 step {1e3 * bf16.step_s:,.2f} ms, {bf16.tokens_per_s:,.0f} tokens/s: fp8 "
            f"{fp8.tokens_per_s / bf16.tokens_per_s:.2f}x bf16's tokens/s")


def format_lines(cfg: Any, hw, args: List[str], result) -> List[str]:
    from mpoverlap.config import compose
    from mpoverlap.moe.dispatch_wire import BLOCK
    from mpoverlap.overlap.layout import build_layout
    from mpoverlap.simulate.core import simulate

    lines = []
    if str(cfg.train.precision) == "fp8":
        lines.append(precision_line(result, simulate(compose([*args, "train.precision=bf16"]), hw)))
    lo = build_layout(cfg)
    m, asked = cfg.model, str(cfg.train.ep_dispatch_dtype)
    if m.num_experts == 0 or lo.ep <= 1 or m.hidden_size % BLOCK:
        return lines
    other = "auto" if asked == "fp8" else "fp8"
    alt = simulate(compose([*args, f"train.ep_dispatch_dtype={other}"]), hw)
    fp8, act = (result, alt) if asked == "fp8" else (alt, result)

    def ms(r, what):
        return 1e3 * (r.step_s if what == "step" else r.exposed_s.get("ep", 0.0))
    return lines + [f"  ep dispatch formats (train.ep_dispatch_dtype): fp8 step {ms(fp8, 'step'):,.2f} ms, ep exposed "
            f"{ms(fp8, 'ep'):,.3f} ms; the activation dtype (auto) step {ms(act, 'step'):,.2f} ms, ep exposed "
            f"{ms(act, 'ep'):,.3f} ms: fp8 saves {ms(act, 'step') - ms(fp8, 'step'):,.2f} ms a step"]
