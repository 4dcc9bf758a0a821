"""What each wire format would save, for `mpoverlap-check --simulate`: the same layout simulated
again with the format switched, the step and the mode's communication beside the run's.

EP: train.ep_dispatch_dtype (moe/dispatch_wire.py), fp8 against the activation dtype, on the
layouts where fp8 dispatch is valid (an MoE model, ep > 1, a hidden size 128 divides)."""
from __future__ import annotations

from typing import Any, List


def format_lines(cfg: Any, hw, args: List[str], result) -> List[str]:
    from mpoverlap.config import compose
    from mpoverlap.moe.dispatch_wire import BLOCK
    from mpoverlap.overlap.layout import build_layout
    from mpoverlap.simulate.core import simulate

    lo = build_layout(cfg)
    m, asked = cfg.model, str(cfg.train.ep_dispatch_dtype)
    if m.num_experts == 0 or lo.ep <= 1 or m.hidden_size % BLOCK:
        return []
    other = "auto" if asked == "fp8" else "fp8"
    alt = simulate(compose([*args, f"train.ep_dispatch_dtype={other}"]), hw)
    fp8, act = (result, alt) if asked == "fp8" else (alt, result)

    def ms(r, what):
        return 1e3 * (r.step_s if what == "step" else r.exposed_s.get("ep", 0.0))
    return [f"  ep dispatch formats (train.ep_dispatch_dtype): fp8 step {ms(fp8, 'step'):,.2f} ms, ep exposed "
            f"{ms(fp8, 'ep'):,.3f} ms; the activation dtype (auto) step {ms(act, 'step'):,.2f} ms, ep exposed "
            f"{ms(act, 'ep'):,.3f} ms: fp8 saves {ms(act, 'step') - ms(fp8, 'step'):,.2f} ms a step"]
