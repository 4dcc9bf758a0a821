"""Data-parallel overlap rules: gradient buckets and the distributed optimizer's gather."""
from __future__ import annotations

from mpoverlap.data_parallel.levels import LEVELS
from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, rule


def _nothing_reduced(lo: Layout) -> bool:
    """A single data-parallel replica (dp x cp = 1) and no expert gradients reduced over tp x edp:
    no data-parallel reduction (or gather) exists."""
    from mpoverlap.overlap.config import expert_grad_ranks

    return lo.dp_cp == 1 and expert_grad_ranks(lo) == 1


def sharding_level(cfg) -> str:
    """train.dp_sharding, with train.distributed_optimizer=true read as `optim` (the rule
    dp.sharding_conflict refuses it beside a higher level; an unknown value reads as given)."""
    level = str(cfg.train.dp_sharding)
    if cfg.train.distributed_optimizer and level == "none":
        return "optim"
    return level


@rule("dp.sharding_conflict", "dp", ("train.distributed_optimizer", "train.dp_sharding"),
      "train.distributed_optimizer=true is the older spelling of train.dp_sharding=optim only")
def _sharding_conflict(lo: Layout):
    level = str(lo.cfg.train.dp_sharding)
    if lo.cfg.train.distributed_optimizer and level in LEVELS and level not in ("none", "optim"):
        yield Problem("dp.sharding_conflict",
                      {"train.distributed_optimizer": True, "train.dp_sharding": level},
                      "both keys choose a sharding level; train.distributed_optimizer=true means "
                      "train.dp_sharding=optim (ZeRO-1) and nothing else",
                      ["train.distributed_optimizer=false"])


@rule("dp.overlap_needs_replicas", "dp", ("overlap.dp", "parallel.dp", "parallel.cp"),
      "overlap.dp=true needs more than one data-parallel replica (dp x cp > 1), or expert "
      "gradients reduced over tp (MoE, sequence parallelism, parallel.etp=1, tp > 1)")
def _needs_replicas(lo: Layout):
    if lo.mode("dp") == "true" and _nothing_reduced(lo):
        yield Problem("dp.overlap_needs_replicas",
                      {"overlap.dp": "true", "parallel.dp": lo.dp, "parallel.cp": lo.cp},
                      "with a single replica there is no gradient reduction to overlap "
                      "(or launch more replicas, e.g. parallel.dp=2)",
                      ["overlap.dp=auto"])


@rule("dp.bucket_size", "dp", ("overlap.dp_bucket_mb",), "gradient buckets have a positive size")
def _bucket(lo: Layout):
    from mpoverlap.simulate.bucket_size import requested_bucket_mb

    value = lo.cfg.overlap.dp_bucket_mb
    try:
        mb = requested_bucket_mb(lo.cfg)
    except ValueError:
        yield Problem("dp.bucket_size", {"overlap.dp_bucket_mb": value},
                      "a bucket size is a number of MiB or auto", ["overlap.dp_bucket_mb=auto"])
        return
    if mb is not None and not mb > 0:
        yield Problem("dp.bucket_size", {"overlap.dp_bucket_mb": value},
                      "a bucket of zero megabytes holds no gradient", ["overlap.dp_bucket_mb=auto"])


@rule("dp.param_gather_needs_distributed_optimizer", "dp",
      ("overlap.dp_param_gather", "train.distributed_optimizer", "train.dp_sharding"),
      "the parameter all-gather exists only with the distributed optimizer")
def _gather_needs_distopt(lo: Layout):
    if lo.mode("dp_param_gather") == "true" and sharding_level(lo.cfg) == "none":
        yield Problem("dp.param_gather_needs_distributed_optimizer",
                      {"overlap.dp_param_gather": "true", "train.dp_sharding": "none"},
                      "without the distributed optimizer every rank updates full parameters and "
                      "no parameter all-gather exists to overlap",
                      ["train.dp_sharding=optim"])


@rule("dp.param_gather_under_zero3", "dp", ("overlap.dp_param_gather", "train.dp_sharding"),
      "ZeRO-3 has no after-step parameter gather: its per-unit gathers follow overlap.dp")
def _gather_under_zero3(lo: Layout):
    if lo.mode("dp_param_gather") == "true" and sharding_level(lo.cfg) == "optim_grads_params":
        yield Problem("dp.param_gather_under_zero3",
                      {"overlap.dp_param_gather": "true", "train.dp_sharding": "optim_grads_params"},
                      "under ZeRO-3 parameters stay sharded after the step; each unit is gathered before "
                      "its forward and backward, prefetched under overlap.dp (depth overlap.dp_prefetch)",
                      ["overlap.dp_param_gather=auto"])


@rule("dp.param_gather_needs_dp_overlap", "dp", ("overlap.dp_param_gather", "overlap.dp"),
      "overlapping the parameter gather contradicts overlap.dp=false")
def _gather_vs_dp_off(lo: Layout):
    if lo.mode("dp_param_gather") == "true" and lo.mode("dp") == "false":
        yield Problem("dp.param_gather_needs_dp_overlap",
                      {"overlap.dp_param_gather": "true", "overlap.dp": "false"},
                      "overlap.dp=false asks every data-parallel collective to be waited at once",
                      ["overlap.dp_param_gather=auto"])


@rule("dp.param_gather_needs_replicas", "dp", ("overlap.dp_param_gather", "parallel.dp", "parallel.cp"),
      "overlap.dp_param_gather=true needs dp x cp > 1")
def _gather_needs_replicas(lo: Layout):
    if lo.mode("dp_param_gather") == "true" and lo.dp_cp == 1:
        yield Problem("dp.param_gather_needs_replicas",
                      {"overlap.dp_param_gather": "true", "parallel.dp": lo.dp, "parallel.cp": lo.cp},
                      "with a single replica nothing is sharded and nothing is gathered",
                      ["overlap.dp_param_gather=auto"])


@rule("dp.param_gather_dtype", "dp", ("train.param_gather_dtype", "train.dp_sharding", "parallel.dp", "parallel.cp"),
      "train.param_gather_dtype=bf16|int8|fp8 rounds only ZeRO-3's transient unit gathers, and needs data-parallel "
      "ranks to gather from")
def _gather_dtype(lo: Layout):
    asked = str(lo.cfg.train.param_gather_dtype)
    if asked not in ("bf16", "int8", "fp8"):
        return
    level = sharding_level(lo.cfg)
    keys = {"train.param_gather_dtype": asked, "train.dp_sharding": level}
    if level != "optim_grads_params":
        yield Problem("dp.param_gather_dtype", keys,
                      "below ZeRO-3 the only parameter gather is the one after the optimizer step, whose result "
                      "is the weights themselves (every rank's copy of them): rounding it would round the model "
                      "on every rank but the shard's owner; it stays fp32 (or shard the parameters: "
                      "train.dp_sharding=optim_grads_params)",
                      ["train.param_gather_dtype=auto"])
    elif _nothing_reduced(lo):
        yield Problem("dp.param_gather_dtype", {**keys, "parallel.dp": lo.dp, "parallel.cp": lo.cp},
                      "with a single data-parallel replica nothing is gathered, so no gather has a dtype "
                      "(or launch more replicas, e.g. parallel.dp=2)",
                      ["train.param_gather_dtype=auto"])


@rule("dp.grad_reduce_dtype", "dp", ("train.grad_reduce_dtype", "parallel.dp", "parallel.cp", "parallel.tp",
                                     "parallel.sequence_parallel"),
      "train.grad_reduce_dtype=fp8|int8 quantizes a data-parallel gradient reduction: one must exist, and "
      "tensor-parallel replicas of a weight must reach the same gradient")
def _grad_reduce_dtype(lo: Layout):
    asked = str(lo.cfg.train.grad_reduce_dtype)
    if asked not in ("fp8", "int8"):
        return
    if _nothing_reduced(lo):
        yield Problem("dp.grad_reduce_dtype",
                      {"train.grad_reduce_dtype": asked, "parallel.dp": lo.dp, "parallel.cp": lo.cp},
                      "with a single data-parallel replica no gradient is reduced, so nothing would be quantized "
                      "(or launch more replicas, e.g. parallel.dp=2)", ["train.grad_reduce_dtype=fp32"])
    if lo.tp > 1 and not bool(lo.cfg.parallel.sequence_parallel):
        yield Problem("dp.grad_reduce_dtype",
                      {"train.grad_reduce_dtype": asked, "parallel.tp": lo.tp, "parallel.sequence_parallel": False},
                      "a bucket's quantization blocks mix the weights replicated over tp (norms, biases) with "
                      "tp-sharded neighbours, so each tp rank would round the replicated weights' gradients "
                      "differently and their copies would drift apart; under sequence parallelism their "
                      "gradients are summed over tp after the data-parallel reduction, which makes them agree "
                      "(or reduce in bf16, rounded elementwise: train.grad_reduce_dtype=bf16)",
                      ["parallel.sequence_parallel=true"])


@rule("dp.grad_error_feedback", "dp", ("train.grad_error_feedback", "train.grad_reduce_dtype"),
      "train.grad_error_feedback=true needs a quantized gradient reduction (fp8|int8) to feed back")
def _grad_error_feedback(lo: Layout):
    value = str(lo.cfg.train.grad_error_feedback).lower()
    if value not in ("auto", "true", "false"):
        yield Problem("dp.grad_error_feedback", {"train.grad_error_feedback": lo.cfg.train.grad_error_feedback},
                      "must be one of auto|true|false", ["train.grad_error_feedback=auto"])
        return
    dtype = str(lo.cfg.train.grad_reduce_dtype)
    if value == "true" and dtype not in ("fp8", "int8"):
        yield Problem("dp.grad_error_feedback", {"train.grad_error_feedback": True, "train.grad_reduce_dtype": dtype},
                      f"{dtype} gradients are rounded elementwise, not quantized in blocks: there is no residual "
                      "to carry (error feedback is for fp8|int8: train.grad_reduce_dtype=int8)",
                      ["train.grad_error_feedback=auto"])
