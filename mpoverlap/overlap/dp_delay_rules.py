"""overlap.dp_delay rules: what the one-step-delayed gradient reduction supports
(data_parallel/delayed.py). Each refused combination would need the reduction inside the step,
or a gradient path the delayed buffers do not carry."""
from __future__ import annotations

from mpoverlap.overlap.dp_rules import sharding_level
from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, rule

_FIX_OFF = ["overlap.dp_delay=0"]


def _delay(lo: Layout):
    return lo.cfg.overlap.dp_delay


@rule("dp.delay_value", "dp", ("overlap.dp_delay",), "overlap.dp_delay is 0 (reduce within the step) or 1")
def _delay_value(lo: Layout):
    if _delay(lo) not in (0, 1):
        yield Problem("dp.delay_value", {"overlap.dp_delay": _delay(lo)},
                      "0 reduces each step's gradients within the step, 1 delays them by one step; "
                      "no deeper delay exists", _FIX_OFF)


@rule("dp.delay_sharding", "dp", ("overlap.dp_delay", "train.dp_sharding"),
      "overlap.dp_delay=1 runs with train.dp_sharding=none|optim (ZeRO-1), not ZeRO-2/3")
def _delay_sharding(lo: Layout):
    level = sharding_level(lo.cfg)
    if _delay(lo) == 1 and level in ("optim_grads", "optim_grads_params"):
        yield Problem("dp.delay_sharding", {"overlap.dp_delay": 1, "train.dp_sharding": level},
                      "ZeRO-2/3 reduce-scatter each bucket in every microbatch and keep only a shard; the "
                      "delayed reduction would need a second persistent shard buffer and a full bucket in "
                      "flight across the step, which is not built (ZeRO-1 is: train.dp_sharding=optim)",
                      ["train.dp_sharding=optim", *_FIX_OFF])


@rule("dp.delay_grad_wire", "dp", ("overlap.dp_delay", "train.grad_reduce_dtype"),
      "overlap.dp_delay=1 reduces in fp32 or bf16, not a quantized wire format")
def _delay_wire(lo: Layout):
    dtype = str(lo.cfg.train.grad_reduce_dtype)
    if _delay(lo) == 1 and dtype in ("fp8", "int8"):
        yield Problem("dp.delay_grad_wire", {"overlap.dp_delay": 1, "train.grad_reduce_dtype": dtype},
                      "a quantized reduction runs in two hops with error-feedback residuals fed from the "
                      "gradient buffer; the delayed path carries one collective per bucket across the step",
                      ["train.grad_reduce_dtype=bf16", *_FIX_OFF])


@rule("dp.delay_pipeline", "dp", ("overlap.dp_delay", "parallel.pp"),
      "overlap.dp_delay=1 needs parallel.pp=1")
def _delay_pipeline(lo: Layout):
    if _delay(lo) == 1 and lo.pp > 1:
        yield Problem("dp.delay_pipeline", {"overlap.dp_delay": 1, "parallel.pp": lo.pp},
                      "pipeline schedules reduce inside the step (the last stage's buckets during the "
                      "cool-down, deferred weight gradients of zero-bubble schedules, the tied embedding's "
                      "sum over its two stages), none of which the delayed buffers carry",
                      ["parallel.pp=1", *_FIX_OFF])


@rule("dp.delay_moe", "dp", ("overlap.dp_delay", "model.num_experts"),
      "overlap.dp_delay=1 is for dense models")
def _delay_moe(lo: Layout):
    if _delay(lo) == 1 and lo.cfg.model.num_experts > 0:
        yield Problem("dp.delay_moe", {"overlap.dp_delay": 1, "model.num_experts": lo.cfg.model.num_experts},
                      "expert gradients reduce over other groups (and forward/backward pairing holds them "
                      "back within a backward); no single-process reference covers their delay yet",
                      ["model.num_experts=0", *_FIX_OFF])
