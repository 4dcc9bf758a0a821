"""train.precision=fp8 rules: torchao present, every FP8 GEMM's dimensions divisible by 16, a
device with FP8 GEMMs, what FP8 ZeRO-3 gathers need, and the layouts not built in FP8 yet.

What runs in FP8 (precision/fp8_select.py): the transformer blocks' q/k/v and attention output
projections and the MLP linears, on every path (plain, tensor-parallel with sequence
parallelism and collective matmul, the zero-bubble deferred weight gradient, recompute); the
embedding, output head, router, norms and softmax stay bf16.
"""
from __future__ import annotations

from typing import Iterator, Tuple

from mpoverlap.overlap.cuda_env import device_choice
from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, rule

# FP8 GEMMs (torch._scaled_mm on CUDA) need every dimension divisible by 16.
FP8_DIM = 16
# FP8 tensor cores: Ada (8.9) and Hopper (9.0) on.
FP8_CAPABILITY = (8, 9)
TO_BF16 = "train.precision=bf16"


def _fp8(lo: Layout) -> bool:
    return str(lo.cfg.train.precision) == "fp8"


@rule("fp8.torchao", "general", ("train.precision",), "train.precision=fp8 needs torchao (the fp8 extra)")
def _torchao(lo: Layout):
    if not _fp8(lo):
        return
    from mpoverlap.precision.fp8_select import INSTALL, torchao_missing

    reason = torchao_missing()
    if reason:
        yield Problem("fp8.torchao", {"train.precision": "fp8"}, reason, [INSTALL, TO_BF16])


def fp8_gemm_dims(lo: Layout) -> Iterator[Tuple[str, str, int]]:
    """(GEMM, model key behind the dimension, this rank's dimension after TP) for each dimension
    of each FP8 GEMM: the projections' and MLP's input and output widths, and the tokens a GEMM
    holds (the wgrad GEMM's contraction: micro batch x sequence / cp, / tp under sequence
    parallelism, where collective matmul's ring runs each sequence chunk as its own GEMM)."""
    from mpoverlap.models.init import head_dim_of, qkv_rows

    m, t = lo.cfg.model, lo.cfg.train
    tp, cp = lo.tp or 1, lo.cp or 1
    H, F = int(m.hidden_size), int(m.ffn_hidden_size)
    if str(getattr(m, "attention", "mha")) == "mla":
        yield from _latent_gemm_dims(m, tp)
    else:
        rows = qkv_rows(m)
        heads = f"model.num_attention_heads x model.head_dim (D={head_dim_of(m)})"
        yield "attn.qkv (in)", "model.hidden_size", H
        yield "attn.qkv (out)", f"{heads} + 2 x model.num_query_groups x D, / parallel.tp", sum(rows) // tp
        yield "attn.proj (in)", f"{heads} / parallel.tp", rows[0] // tp
        yield "attn.proj (out)", "model.hidden_size", H
    fc1 = 2 * F if str(m.activation) == "swiglu" else F
    yield "mlp fc1 (out)", "model.ffn_hidden_size / parallel.tp", fc1 // tp
    yield "mlp fc2 (in)", "model.ffn_hidden_size / parallel.tp", F // tp
    tokens = int(t.micro_batch_size) * int(m.seq_length) // cp
    sp = tp > 1 and bool(lo.cfg.parallel.sequence_parallel)
    yield ("tokens", "train.micro_batch_size x model.seq_length / parallel.cp" + (" / parallel.tp" if sp else ""),
           tokens // tp if sp else tokens)


def _latent_gemm_dims(m, tp: int) -> Iterator[Tuple[str, str, int]]:
    """Multi-head latent attention's GEMMs (models/mla.py): the replicated down-projections, the
    column-parallel up-projections (split by heads) and the row-parallel output."""
    N, r, c = int(m.num_attention_heads), int(m.q_lora_rank), int(m.kv_lora_rank)
    nope, rope, v = int(m.qk_nope_head_dim), int(m.qk_rope_head_dim), int(m.v_head_dim)
    yield "attn.kv_a_proj_with_mqa (in)", "model.hidden_size", int(m.hidden_size)
    yield "attn.kv_a_proj_with_mqa (out)", "model.kv_lora_rank + model.qk_rope_head_dim", c + rope
    if r:
        yield "attn.q_a_proj (out)", "model.q_lora_rank", r
    yield ("attn.q_b_proj (out)" if r else "attn.q_proj (out)",
           "model.num_attention_heads x (model.qk_nope_head_dim + model.qk_rope_head_dim) / parallel.tp",
           N * (nope + rope) // tp)
    yield "attn.kv_b_proj (in)", "model.kv_lora_rank", c
    yield ("attn.kv_b_proj (out)", "model.num_attention_heads x (model.qk_nope_head_dim + model.v_head_dim) "
           "/ parallel.tp", N * (nope + v) // tp)
    yield "attn.proj (in)", "model.num_attention_heads x model.v_head_dim / parallel.tp", N * v // tp
    yield "attn.proj (out)", "model.hidden_size", int(m.hidden_size)


@rule("fp8.gemm_dims", "general", ("train.precision", "model.hidden_size", "model.ffn_hidden_size",
                                   "model.num_attention_heads", "parallel.tp"),
      "every FP8 GEMM's dimensions (after TP) are divisible by 16")
def _gemm_dims(lo: Layout):
    if not _fp8(lo) or lo.tp is None or lo.cp is None:
        return
    for gemm, key, dim in fp8_gemm_dims(lo):
        if dim % FP8_DIM:
            yield Problem("fp8.gemm_dims", {"train.precision": "fp8", key: dim},
                          f"the FP8 GEMM {gemm} has dimension {dim} on each rank, not divisible by {FP8_DIM} "
                          f"(torch._scaled_mm's requirement): choose {key.split(' ')[0]} so that it is a "
                          f"multiple of {FP8_DIM}, or keep the GEMMs in bf16", [TO_BF16])


@rule("fp8.device", "general", ("train.precision", "train.device"),
      "FP8 GEMMs need CUDA compute capability 8.9 or newer (CPU runs them for tests)")
def _device(lo: Layout):
    if not _fp8(lo) or device_choice(str(lo.cfg.train.device), lo.world_env)[0] != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        return  # train.device=cuda without CUDA is refused by the device rules
    cc = torch.cuda.get_device_capability()
    if cc < FP8_CAPABILITY:
        yield Problem("fp8.device", {"train.precision": "fp8", "cuda_capability": f"{cc[0]}.{cc[1]}"},
                      "FP8 GEMMs need CUDA compute capability 8.9 or newer (Ada, Hopper, Blackwell)",
                      [TO_BF16])


@rule("fp8.param_gather", "general", ("train.precision", "train.fp8_recipe", "train.param_gather_dtype"),
      "train.param_gather_dtype=fp8 needs train.precision=fp8 with the tensorwise recipe")
def _param_gather(lo: Layout):
    asked = str(lo.cfg.train.param_gather_dtype)
    if asked != "fp8":
        return
    precision, recipe = str(lo.cfg.train.precision), str(lo.cfg.train.fp8_recipe)
    if precision != "fp8":
        yield Problem("fp8.param_gather", {"train.param_gather_dtype": asked, "train.precision": precision},
                      "FP8 gathers carry the weights of the FP8 GEMMs cast as those GEMMs cast them, and "
                      f"under train.precision={precision} no GEMM runs in FP8 (or gather in the compute "
                      "dtype: train.param_gather_dtype=auto)",
                      ["train.precision=fp8"])
    elif recipe != "tensorwise":
        yield Problem("fp8.param_gather", {"train.param_gather_dtype": asked, "train.fp8_recipe": recipe},
                      f"the {recipe} recipe scales each row of a GEMM operand on its own, and a row's scale "
                      "cannot be shared before the gather (a rank holds a flat shard, not whole rows of the "
                      "operand the GEMM scales): FP8 gathers need one scale per weight, the tensorwise recipe "
                      "(or keep rowwise and gather bf16: train.param_gather_dtype=bf16)",
                      ["train.fp8_recipe=tensorwise"])


@rule("fp8.moe", "general", ("train.precision", "model.num_experts", "model.moe_grouped_gemm",
                              "model.moe_ffn_hidden_size", "parallel.etp"),
      "MoE in FP8 runs the grouped experts (precision/fp8_grouped.py), widths divisible by 16 per rank")
def _moe(lo: Layout):
    """The experts' FP8 GEMMs are the grouped ones (torchao's rowwise grouped recipe, whichever
    train.fp8_recipe); each expert's width on its rank and the hidden size must divide by 16."""
    m = lo.cfg.model
    if not _fp8(lo) or int(m.num_experts) == 0:
        return
    if not bool(m.moe_grouped_gemm):
        yield Problem("fp8.moe", {"train.precision": "fp8", "model.moe_grouped_gemm": False},
                      "the experts' FP8 GEMMs are the grouped ones; the per-expert linear path is not built in FP8",
                      ["model.moe_grouped_gemm=true", TO_BF16])
        return
    from mpoverlap.overlap.estimate.params import etp_size, expert_ffn

    width = expert_ffn(m) // etp_size(lo.cfg)
    for key, dim in (("model.moe_ffn_hidden_size / parallel.etp", width), ("model.hidden_size", int(m.hidden_size))):
        if dim % FP8_DIM:
            yield Problem("fp8.moe", {"train.precision": "fp8", key: dim},
                          f"the FP8 grouped expert GEMMs have dimension {dim} ({key}) on each rank, not divisible "
                          f"by {FP8_DIM} (torch._scaled_grouped_mm's requirement): choose a multiple of {FP8_DIM}",
                          [TO_BF16])
