"""Sharding levels of the data-parallel group (`train.dp_sharding`, Megatron-FSDP's names).

    none                 every rank holds full parameters, gradients and optimizer state
    optim                ZeRO-1: optimizer state sharded (`train.distributed_optimizer=true`)
    optim_grads          ZeRO-2: + only this rank's shard of the reduced gradients persists
    optim_grads_params   ZeRO-3 / FSDP: + parameters live sharded between uses

Per rank, with P parameters and a sharding group of g ranks (fp32 parameters, gradients and
two AdamW moments; U = the largest gathered units held at once under ZeRO-3):

    level               params      grads      optimizer
    none                P           P          2P
    optim               P           P          2P / g
    optim_grads         P           P / g      2P / g
    optim_grads_params  P / g + U   P / g      2P / g
"""
from __future__ import annotations

LEVELS = ("none", "optim", "optim_grads", "optim_grads_params")


def resolve_level(dp_sharding: str, distributed_optimizer: bool) -> str:
    """The sharding level asked for. `train.distributed_optimizer=true` is the older spelling
    of `optim`; together with a higher level it has two meanings, which the rule
    dp.sharding_conflict refuses before any worker starts (this raises if it got here)."""
    level = str(dp_sharding)
    if level not in LEVELS:
        raise ValueError(f"train.dp_sharding={level}: expected one of {', '.join(LEVELS)}")
    if distributed_optimizer:
        if level not in ("none", "optim"):
            raise ValueError(f"train.distributed_optimizer=true and train.dp_sharding={level} both choose a "
                             "sharding level; set train.distributed_optimizer=false")
        return "optim"
    return level


def shards_grads(level: str) -> bool:
    return level in ("optim_grads", "optim_grads_params")


def shards_params(level: str) -> bool:
    return level == "optim_grads_params"


GATHER_DTYPES = ("auto", "fp32", "bf16", "int8", "fp8")


def param_gather_dtype(requested: str, precision: str, level: str) -> str:
    """What ZeRO-3's unit gathers carry (`train.param_gather_dtype`): their result is a transient
    compute copy of the unit's weights, so `auto` sends the compute dtype (bf16 under
    train.precision=bf16: the values the forward's own cast makes of the GEMM weights); the
    owner's fp32 shard, the master weight, is never rounded. Every other level's gather (of the
    updated shards after the step) writes the weights themselves and stays fp32: `auto` resolves
    to fp32 there, and the rule dp.param_gather_dtype refuses bf16/int8/fp8. Under
    train.precision=fp8 `auto` is bf16 too (compute_precision maps fp8 to bf16): FP8 gathers
    (data_parallel/fp8_gather.py) are opt-in, `fp8`, as the peers' (Megatron's
    --fp8-param-gather, torchao's enable_fsdp_float8_all_gather)."""
    if requested == "auto":
        return precision if shards_params(level) and precision == "bf16" else "fp32"
    return requested
