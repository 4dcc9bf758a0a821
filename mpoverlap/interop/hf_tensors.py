"""Tensor names and fused layouts between mpoverlap and transformers' Llama, Qwen2, Qwen3,
Mixtral and Qwen3-MoE classes, and DeepSeek-V3's (names and row orders in hf_deepseek_v3; its
routed experts are laid out as Qwen3-MoE's).

Each of our (layout-free) parameters is a list of HF tensors concatenated along dim 0, the
`parts` (one part for most; [q | k | v] for attn.qkv, [gate | up] for mlp.gate_up). The parts
are exactly the blocks a tensor-parallel layer splits separately (`partition_blocks`), so
import reads each rank's slice of every part straight from the file (`hf_dir.SliceReader`)
instead of reading the whole tensor and cutting it.

  ours                                  HF (model.layers.<i>.)
  attn_norm / mlp_norm                  input_layernorm / post_attention_layernorm
  attn.qkv.weight [(N + 2G) D, H]       self_attn.{q,k,v}_proj.weight   (rows, no permutation)
  attn.qkv.bias (model.qkv_bias)        self_attn.{q,k,v}_proj.bias     (Qwen2)
  attn.{q,k}_norm.weight (qk_norm)      self_attn.{q,k}_norm.weight     (Qwen3, Qwen3-MoE)
  attn.proj.weight                      self_attn.o_proj.weight
  mlp.gate_up.weight [2F, H]            mlp.{gate,up}_proj.weight
  mlp.down.weight                       mlp.down_proj.weight
  mlp.router.weight [E, H]              Mixtral block_sparse_moe.gate.weight; Qwen3-MoE mlp.gate.weight
  mlp.experts.<e>.gate_up / down        Mixtral block_sparse_moe.experts.<e>.{w1,w3} / w2;
                                        Qwen3-MoE mlp.experts.<e>.{gate,up}_proj / down_proj;
                                        transformers 5's fused mlp.experts.gate_up_proj[e] / down_proj[e]
Export writes the canonical per-expert names (what save_pretrained writes and every
transformers version loads); import reads them or the fused layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

import torch

from mpoverlap.interop import hf_deepseek_v3 as ds
from mpoverlap.interop.hf_mapping import ARCH_DEEPSEEK_V3, ARCH_MIXTRAL, ConversionError, _qkv_rows, architecture


@dataclass(frozen=True)
class Part:
    """One HF tensor (or, with `index`, one expert's [rows, ...] of a fused [E, rows, ...] one)."""
    name: str
    index: Optional[int] = None


def _is_moe_layer(m: Dict[str, Any], i: int) -> bool:
    from mpoverlap.models.gpt import is_moe_layer

    return is_moe_layer(SimpleNamespace(**{"num_experts": 0, "moe_layer_freq": 1, **m}), i)


def parts_of(m: Dict[str, Any], has: Callable[[str], bool] = lambda _n: False) -> Dict[str, List[Part]]:
    """{our parameter name: its HF parts} for the model keys `m` (architecture() must pass).
    `has(name)` says whether the directory holds a tensor (import: picks the fused expert
    layout when the per-expert one is absent)."""
    arch = architecture(m)
    if arch == ARCH_DEEPSEEK_V3:
        out = ds.parts_of(m, Part, _is_moe_layer)
        L = int(m["num_layers"])
        blocks = [(f"layers.{i}", f"model.layers.{i}", i) for i in range(L)]
        blocks += [(f"mtp.{d}.block", f"model.layers.{L + d}", L + d) for d in range(int(m.get("mtp_num_layers") or 0))]
        for ours, hf, i in blocks:
            if _is_moe_layer(m, i):
                out.update(_expert_parts(m, ours, f"{hf}.mlp", has(f"{hf}.mlp.experts.gate_up_proj"), False))
        return out
    out = {"embedding.weight": [Part("model.embed_tokens.weight")], "final_norm.weight": [Part("model.norm.weight")]}
    if not m["tie_embeddings"]:
        out["output.weight"] = [Part("lm_head.weight")]
    for i in range(int(m["num_layers"])):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        att = f"{hf}.self_attn"
        out.update({f"{ours}.attn_norm.weight": [Part(f"{hf}.input_layernorm.weight")],
                    f"{ours}.mlp_norm.weight": [Part(f"{hf}.post_attention_layernorm.weight")],
                    f"{ours}.attn.qkv.weight": [Part(f"{att}.{p}_proj.weight") for p in "qkv"],
                    f"{ours}.attn.proj.weight": [Part(f"{att}.o_proj.weight")]})
        if m.get("qkv_bias"):
            out[f"{ours}.attn.qkv.bias"] = [Part(f"{att}.{p}_proj.bias") for p in "qkv"]
        if m.get("qk_norm"):
            out[f"{ours}.attn.q_norm.weight"] = [Part(f"{att}.q_norm.weight")]
            out[f"{ours}.attn.k_norm.weight"] = [Part(f"{att}.k_norm.weight")]
        if not _is_moe_layer(m, i):
            out[f"{ours}.mlp.gate_up.weight"] = [Part(f"{hf}.mlp.gate_proj.weight"), Part(f"{hf}.mlp.up_proj.weight")]
            out[f"{ours}.mlp.down.weight"] = [Part(f"{hf}.mlp.down_proj.weight")]
            continue
        fused = has(f"{hf}.mlp.experts.gate_up_proj")
        mixtral = arch == ARCH_MIXTRAL
        moe = f"{hf}.block_sparse_moe" if mixtral and not fused else f"{hf}.mlp"
        out[f"{ours}.mlp.router.weight"] = [Part(f"{moe}.gate.weight")]
        out.update(_expert_parts(m, ours, moe, fused, mixtral))
    return out


def _expert_parts(m: Dict[str, Any], ours: str, moe: str, fused: bool, mixtral: bool) -> Dict[str, List[Part]]:
    """The routed experts of block `ours` whose HF MoE module is `moe`."""
    out = {}
    for e in range(int(m["num_experts"])):
        ex, mine = f"{moe}.experts.{e}", f"{ours}.mlp.experts.{e}"
        if fused:
            out[f"{mine}.gate_up.weight"] = [Part(f"{moe}.experts.gate_up_proj", e)]
            out[f"{mine}.down.weight"] = [Part(f"{moe}.experts.down_proj", e)]
        elif mixtral:
            out[f"{mine}.gate_up.weight"] = [Part(f"{ex}.w1.weight"), Part(f"{ex}.w3.weight")]
            out[f"{mine}.down.weight"] = [Part(f"{ex}.w2.weight")]
        else:
            out[f"{mine}.gate_up.weight"] = [Part(f"{ex}.gate_proj.weight"), Part(f"{ex}.up_proj.weight")]
            out[f"{mine}.down.weight"] = [Part(f"{ex}.down_proj.weight")]
    return out


def _part_rows(m: Dict[str, Any], name: str, n_parts: int, rows: int) -> List[int]:
    """Row counts of a parameter's parts: [q, k, v] for qkv, equal halves for gate_up."""
    if n_parts == 1:
        return [rows]
    if ".attn.qkv." in name:
        return list(_qkv_rows(m))
    return [rows // n_parts] * n_parts


def to_hf(state: Dict[str, torch.Tensor], m: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Our full tensors (layout-free names) -> HF names; every tensor contiguous and unshared."""
    out = {}
    ids = {int(n.split(".")[1]) for n in state if n.startswith("layers.")}
    deepseek = architecture(m) == ARCH_DEEPSEEK_V3
    for name, parts in parts_of(m).items():
        if name.startswith("layers.") and int(name.split(".")[1]) not in ids:
            continue
        t = state.get(name)
        if t is None and name.endswith(".router.expert_bias"):  # a router trained without the bias
            t = torch.zeros(int(m["num_experts"]))
        if deepseek:
            t = ds.convert(name, t, m, to_ours=False)
        for part, piece in zip(parts, t.split(_part_rows(m, name, len(parts), t.shape[0]), dim=0)):
            out[part.name] = piece
    if deepseek:
        out.update(ds.mtp_copies(state, m))
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def from_hf(reader, m: Dict[str, Any], params: Optional[Dict[str, Any]] = None, tp_rank: int = 0,
            tp_size: int = 1, hf: Optional[Dict[str, Any]] = None) -> Dict[str, torch.Tensor]:
    """Our tensors from an HF directory, read through `reader` (`hf_dir.SliceReader`). With
    `params` ({name: this rank's parameter}): only those names, each as this rank's
    tensor-parallel shard (the parameter's partition_dim / partition_blocks), read as slices;
    without: every tensor, full. `hf`: the directory's config.json (DeepSeek-V3's rope_interleave)."""
    table = parts_of(m, reader.has)
    arch = architecture(m)
    if arch == ARCH_DEEPSEEK_V3:
        ds.check_biases_kept(reader, m, table)
    names = list(table) if params is None else [n for n in params if n in table]
    missing = [n for n in (params or {}) if n not in table]
    if missing:
        raise ConversionError(f"{architecture(m)} has no tensor for our parameter(s) {missing[:4]}")
    out = {}
    for name in names:
        for part in table[name]:
            if not reader.has(part.name):
                raise ConversionError(f"the Hugging Face directory has no tensor {part.name!r}, which "
                                      f"{architecture(m)} needs" + ds.missing_hint(part.name, m))
        p = params.get(name) if params is not None else None
        dim = getattr(p, "partition_dim", None) if (p is not None and tp_size > 1
                                                    and getattr(p, "tensor_model_parallel", False)) else None
        out[name] = _read_shard(reader, table[name], dim, getattr(p, "partition_blocks", 1), tp_rank, tp_size)
        if arch == ARCH_DEEPSEEK_V3:  # whole heads on every rank: the per-head row order applies
            out[name] = ds.convert(name, out[name], m, to_ours=True, interleaved=ds.interleaved(hf))
    return out


def _read_shard(reader, parts: List[Part], dim: Optional[int], blocks, rank: int, size: int) -> torch.Tensor:
    """The parts' concatenation, or rank's `shard_tensor` of it along `dim`, read as slices."""
    from mpoverlap.tensor_parallel.layers import block_sizes, shard_tensor

    if dim is None:
        return torch.cat([reader.read(p) for p in parts], dim=0)
    if dim == 1:  # every part's columns: a column slice of the concatenation
        return torch.cat([reader.read(p, 1, rank, size) for p in parts], dim=0)
    rows = [reader.shape(p)[0] for p in parts]
    if tuple(rows) == block_sizes(sum(rows), blocks):  # the parts are the blocks: slice each
        return torch.cat([reader.read(p, 0, rank, size) for p in parts], dim=0)
    full = torch.cat([reader.read(p) for p in parts], dim=0)  # blocks across parts: cut after reading
    return shard_tensor(full, dim, rank, size, blocks)
