"""Which transformers class reproduces an mpoverlap model exactly, and how tensors map.

Pure Python and torch (no transformers import), so the validator can use it on any machine.

Classes (nothing else is written: an approximate export is worse than none):
  dense, model.norm=rmsnorm, model.activation=swiglu                 -> LlamaForCausalLM
  num_experts > 0, every layer MoE (moe_layer_freq=1), no shared expert, dropless,
  rmsnorm, swiglu                                                      -> MixtralForCausalLM

Why no permutation is needed anywhere:
  RoPE: ours is rotate-half (pairs i, i + D/2) with inv_freq_i = 1 / base^(2i/D), exactly HF
        Llama's default rope (rope_theta = model.rope_base): q/k rows map unchanged.
  attn.qkv.weight [(N + 2G) D, H] = rows [q | k | v], q N heads and k, v G groups (GQA:
        model.num_query_groups = num_key_value_heads) of D rows head-major, which is the
        row order of q_proj / k_proj / v_proj: a split, no reordering.
  mlp.gate_up.weight [2F, H] = rows [gate | up] -> gate_proj, up_proj (Mixtral: w1, w3);
        down -> down_proj (w2). Router [E, H] -> block_sparse_moe.gate; the router math
        (softmax over all experts in fp32, top-k, renormalised) is Mixtral's.
  The padded vocabulary (model.make_vocab_size_divisible_by) is the HF vocab_size.
Experts are written in the canonical Mixtral layout (`experts.<e>.w1/w2/w3`), which every
transformers version loads (v5 fuses them on load); import reads it and v5's fused layout.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

ARCH_LLAMA, ARCH_MIXTRAL = "LlamaForCausalLM", "MixtralForCausalLM"
RMS_ONLY = "transformers' Llama/Mixtral normalise with RMSNorm and use SwiGLU MLPs"


class ConversionError(Exception):
    """A model or directory that cannot be converted exactly; names the keys and the fix."""


def num_kv_heads(m: Dict[str, Any]) -> int:
    """THE place where GQA maps: model.num_query_groups (null = the heads) <-> num_key_value_heads.
    qkv rows are [q: N*D | k: G*D | v: G*D] (see `_qkv_rows`), the row order of q_proj, k_proj,
    v_proj (HF Llama's query head n reads K/V head n // (N / G), as ours does)."""
    return int(m.get("num_query_groups") or m["num_attention_heads"])


def _qkv_rows(m: Dict[str, Any]) -> Tuple[int, int, int]:
    D = int(m["hidden_size"]) // int(m["num_attention_heads"])
    return int(m["num_attention_heads"]) * D, num_kv_heads(m) * D, num_kv_heads(m) * D


def moe_ffn(m: Dict[str, Any]) -> int:
    return int(m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"])


def padded_vocab(m: Dict[str, Any]) -> int:
    from mpoverlap.models.init import padded_vocab_size

    return padded_vocab_size(int(m["vocab_size"]), int(m["make_vocab_size_divisible_by"]))


def architecture(m: Dict[str, Any]) -> str:
    """LlamaForCausalLM or MixtralForCausalLM; ConversionError naming EVERY key that makes the
    model one no transformers class reproduces exactly."""
    bad: List[str] = []
    if m["norm"] != "rmsnorm":
        bad.append(f"model.norm={m['norm']} ({RMS_ONLY})")
    if m["activation"] != "swiglu":
        bad.append(f"model.activation={m['activation']} ({RMS_ONLY})")
    moe = int(m.get("num_experts") or 0) > 0
    if moe:
        if m.get("shared_expert"):
            bad.append("model.shared_expert=true (Mixtral has no shared expert)")
        if int(m.get("moe_layer_freq", 1)) != 1:
            bad.append(f"model.moe_layer_freq={m['moe_layer_freq']} (Mixtral makes every layer MoE)")
        if int(m.get("moe_first_dense_layers") or 0) != 0:
            bad.append(f"model.moe_first_dense_layers={m['moe_first_dense_layers']} (Mixtral makes every layer MoE)")
        router = [(k, m.get(k), v) for k, v in (("moe_router_score", "softmax"), ("moe_router_norm_topk", True))
                  if m.get(k, v) != v]
        bad += [f"model.{k}={str(got).lower()} (Mixtral's router is softmax, top-k renormalised)" for k, got, _ in router]
        if float(m.get("moe_router_bias_update_rate") or 0.0) != 0.0:
            bad.append(f"model.moe_router_bias_update_rate={m['moe_router_bias_update_rate']} (Mixtral's router "
                       "has no expert bias)")
        if m.get("moe_capacity_factor") is not None:
            bad.append(f"model.moe_capacity_factor={m['moe_capacity_factor']} (this model drops tokens "
                       "beyond capacity; Mixtral is dropless)")
    if bad:
        raise ConversionError(
            "no transformers class reproduces this model exactly, so nothing was written: "
            + "; ".join(bad) + ". Llama needs model.norm=rmsnorm model.activation=swiglu; Mixtral also "
            "model.shared_expert=false model.moe_layer_freq=1 model.moe_capacity_factor=null")
    return ARCH_MIXTRAL if moe else ARCH_LLAMA


def hf_config(m: Dict[str, Any]) -> Dict[str, Any]:
    """config.json for the model keys `m` (architecture() must pass)."""
    arch = architecture(m)
    H, N = int(m["hidden_size"]), int(m["num_attention_heads"])
    cfg = {
        "architectures": [arch], "model_type": "mixtral" if arch == ARCH_MIXTRAL else "llama",
        "vocab_size": padded_vocab(m), "hidden_size": H, "num_hidden_layers": int(m["num_layers"]),
        "num_attention_heads": N, "num_key_value_heads": num_kv_heads(m), "head_dim": H // N,
        "hidden_act": "silu", "rms_norm_eps": float(m["norm_eps"]),
        # rope_theta for transformers 4.x, rope_parameters for 5.x: the same default rope.
        "rope_theta": float(m["rope_base"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m["rope_base"])},
        "max_position_embeddings": int(m["seq_length"]), "tie_word_embeddings": bool(m["tie_embeddings"]),
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": float(m.get("init_std", 0.02)),
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "use_cache": True,
        "torch_dtype": "float32",
    }
    if arch == ARCH_LLAMA:
        cfg.update({"intermediate_size": int(m["ffn_hidden_size"]), "mlp_bias": False})
    else:
        cfg.update({"intermediate_size": moe_ffn(m), "num_local_experts": int(m["num_experts"]),
                    "num_experts_per_tok": int(m["moe_top_k"]), "sliding_window": None,
                    "output_router_logits": False,
                    "router_aux_loss_coef": float(m.get("moe_aux_loss_coeff", 0.0))})
    return cfg


def _refuse_hf(key: str, value: Any, why: str) -> ConversionError:
    return ConversionError(f"config.json: {key}={value!r}: {why}; mpoverlap can start only from a "
                           "Llama or Mixtral directory with RMSNorm, SwiGLU, default RoPE and no biases")


def model_keys_from_hf(hf: Dict[str, Any]) -> Dict[str, Any]:
    """HF config.json -> the model.* values it implies (without vocab_size: the HF vocab is
    the PADDED size, compared by `mismatches`)."""
    arch = (hf.get("architectures") or [None])[0]
    if arch not in (ARCH_LLAMA, ARCH_MIXTRAL):
        raise _refuse_hf("architectures", hf.get("architectures"), "not LlamaForCausalLM or MixtralForCausalLM")
    H, N = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    rope = hf.get("rope_parameters") or {}
    checks = [("hidden_act", hf.get("hidden_act", "silu"), "silu"),
              ("attention_bias", bool(hf.get("attention_bias", False)), False),
              ("mlp_bias", bool(hf.get("mlp_bias", False)), False),
              ("head_dim", hf.get("head_dim") or H // N, H // N),
              ("rope_scaling", hf.get("rope_scaling"), None),
              ("rope_parameters.rope_type", rope.get("rope_type", "default"), "default"),
              ("sliding_window", hf.get("sliding_window"), None)]
    for key, value, wanted in checks:
        if value != wanted:
            raise _refuse_hf(key, value, f"only {wanted!r} is reproduced exactly")
    kv = int(hf.get("num_key_value_heads") or N)  # grouped-query attention: see num_kv_heads
    keys = {"num_layers": int(hf["num_hidden_layers"]), "hidden_size": H, "num_attention_heads": N,
            "num_query_groups": kv,
            "norm": "rmsnorm", "activation": "swiglu", "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6))}
    if arch == ARCH_LLAMA:
        keys.update({"ffn_hidden_size": int(hf["intermediate_size"]), "num_experts": 0})
    else:
        keys.update({"moe_ffn_hidden_size": int(hf["intermediate_size"]), "num_experts": int(hf["num_local_experts"]),
                     "moe_top_k": int(hf["num_experts_per_tok"]), "shared_expert": False, "moe_layer_freq": 1})
    return keys


def mismatches(hf: Dict[str, Any], model: Any) -> List[Tuple[str, Any, Any]]:
    """[(model key, value implied by the HF config, our value)] for every disagreement."""
    want = model_keys_from_hf(hf)
    m = {k: model[k] for k in model}  # DictConfig or dict
    ours = dict(m, moe_ffn_hidden_size=moe_ffn(m) if want.get("num_experts") else m.get("moe_ffn_hidden_size"),
                num_query_groups=num_kv_heads(m))  # null (= heads) compares as the heads
    out = [(k, v, ours.get(k)) for k, v in want.items() if _differs(v, ours.get(k))]
    if int(hf["vocab_size"]) != padded_vocab(m):
        out.append(("vocab_size", int(hf["vocab_size"]), m["vocab_size"]))
    return out


def _differs(theirs: Any, ours: Any) -> bool:
    if isinstance(theirs, float):  # rope_base, norm_eps: equal up to float formatting in the json
        return ours is None or abs(theirs - float(ours)) > 1e-9 * max(1.0, abs(theirs))
    return theirs != ours


def describe_mismatches(directory: str, found: List[Tuple[str, Any, Any]], model: Any) -> str:
    parts = []
    for key, theirs, ours in found:
        if key == "vocab_size":
            parts.append(f"model.vocab_size: the HF vocab_size is {theirs} (padded), ours pads "
                         f"model.vocab_size={ours} with model.make_vocab_size_divisible_by="
                         f"{model['make_vocab_size_divisible_by']} to {padded_vocab(model)}")
        else:
            parts.append(f"model.{key}: HF {_show(theirs)}, ours {_show(ours)}")
    return f"checkpoint.init_from={directory} holds a different model (" + "; ".join(parts) + ")"


def _show(value: Any) -> str:
    """A value as an override spells it (true/false/null)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def fix_overrides(found: List[Tuple[str, Any, Any]]) -> List[str]:
    fix = []
    for key, theirs, _ in found:
        if key == "vocab_size":
            fix += [f"model.vocab_size={theirs}", "model.make_vocab_size_divisible_by=1"]
        else:
            fix.append(f"model.{key}={_show(theirs)}")
    return fix


# ---- tensors ------------------------------------------------------------------------------

def _layer_ids(names) -> List[int]:
    return sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})


def to_hf(state: Dict[str, torch.Tensor], m: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Our full tensors (layout-free names) -> HF names; every tensor contiguous and unshared."""
    arch = architecture(m)
    out = {"model.embed_tokens.weight": state["embedding.weight"], "model.norm.weight": state["final_norm.weight"]}
    if not m["tie_embeddings"]:
        out["lm_head.weight"] = state["output.weight"]
    q, k, _ = _qkv_rows(m)
    for i in _layer_ids(state):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        out[f"{hf}.input_layernorm.weight"] = state[f"{ours}.attn_norm.weight"]
        out[f"{hf}.post_attention_layernorm.weight"] = state[f"{ours}.mlp_norm.weight"]
        qkv = state[f"{ours}.attn.qkv.weight"]
        out[f"{hf}.self_attn.q_proj.weight"] = qkv[:q]
        out[f"{hf}.self_attn.k_proj.weight"] = qkv[q:q + k]
        out[f"{hf}.self_attn.v_proj.weight"] = qkv[q + k:]
        out[f"{hf}.self_attn.o_proj.weight"] = state[f"{ours}.attn.proj.weight"]
        if arch == ARCH_LLAMA:
            gate, up = state[f"{ours}.mlp.gate_up.weight"].chunk(2, dim=0)
            out.update({f"{hf}.mlp.gate_proj.weight": gate, f"{hf}.mlp.up_proj.weight": up,
                        f"{hf}.mlp.down_proj.weight": state[f"{ours}.mlp.down.weight"]})
            continue
        out[f"{hf}.block_sparse_moe.gate.weight"] = state[f"{ours}.mlp.router.weight"]
        for e in range(int(m["num_experts"])):
            gate, up = state[f"{ours}.mlp.experts.{e}.gate_up.weight"].chunk(2, dim=0)
            ex = f"{hf}.block_sparse_moe.experts.{e}"
            out.update({f"{ex}.w1.weight": gate, f"{ex}.w3.weight": up,
                        f"{ex}.w2.weight": state[f"{ours}.mlp.experts.{e}.down.weight"]})
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def from_hf(get, m: Dict[str, Any], wanted: Optional[set] = None) -> Dict[str, torch.Tensor]:
    """The inverse of `to_hf`: `get(hf_name)` returns a tensor (or None when absent);
    returns our full tensors, only the names in `wanted` (default: all) so a pipeline
    stage reads only its own layers."""
    arch = architecture(m)
    names = set(wanted) if wanted is not None else None

    def need(name):
        return names is None or name in names

    def must(key):
        t = get(key)
        if t is None:
            raise ConversionError(f"the Hugging Face directory has no tensor {key!r}, which {arch} needs")
        return t

    out = {}
    if need("embedding.weight"):
        out["embedding.weight"] = must("model.embed_tokens.weight")
    if need("final_norm.weight"):
        out["final_norm.weight"] = must("model.norm.weight")
    if not m["tie_embeddings"] and need("output.weight"):
        out["output.weight"] = must("lm_head.weight")
    for i in range(int(m["num_layers"])):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        pairs = {f"{ours}.attn_norm.weight": lambda: must(f"{hf}.input_layernorm.weight"),
                 f"{ours}.mlp_norm.weight": lambda: must(f"{hf}.post_attention_layernorm.weight"),
                 f"{ours}.attn.qkv.weight": lambda: torch.cat([must(f"{hf}.self_attn.{p}_proj.weight")
                                                               for p in "qkv"], dim=0),
                 f"{ours}.attn.proj.weight": lambda: must(f"{hf}.self_attn.o_proj.weight")}
        if arch == ARCH_LLAMA:
            pairs[f"{ours}.mlp.gate_up.weight"] = lambda: torch.cat(
                [must(f"{hf}.mlp.gate_proj.weight"), must(f"{hf}.mlp.up_proj.weight")], dim=0)
            pairs[f"{ours}.mlp.down.weight"] = lambda: must(f"{hf}.mlp.down_proj.weight")
        else:
            pairs.update(_experts_from_hf(get, must, m, ours, hf))
        for name, load in pairs.items():
            if need(name):
                out[name] = load()
    return out


def _experts_from_hf(get, must, m, ours: str, hf: str) -> Dict[str, Any]:
    """Mixtral experts, canonical (`block_sparse_moe.experts.<e>.w1/w2/w3`) or transformers
    5's fused layout (`mlp.experts.gate_up_proj` [E, 2F, H], `down_proj` [E, H, F])."""
    fused = get(f"{hf}.mlp.experts.gate_up_proj") is not None
    router = f"{hf}.mlp.gate.weight" if fused else f"{hf}.block_sparse_moe.gate.weight"
    pairs = {f"{ours}.mlp.router.weight": lambda: must(router)}
    for e in range(int(m["num_experts"])):
        ex = f"{hf}.block_sparse_moe.experts.{e}"
        if fused:
            pairs[f"{ours}.mlp.experts.{e}.gate_up.weight"] = lambda e=e: must(f"{hf}.mlp.experts.gate_up_proj")[e]
            pairs[f"{ours}.mlp.experts.{e}.down.weight"] = lambda e=e: must(f"{hf}.mlp.experts.down_proj")[e]
        else:
            pairs[f"{ours}.mlp.experts.{e}.gate_up.weight"] = lambda ex=ex: torch.cat(
                [must(f"{ex}.w1.weight"), must(f"{ex}.w3.weight")], dim=0)
            pairs[f"{ours}.mlp.experts.{e}.down.weight"] = lambda ex=ex: must(f"{ex}.w2.weight")
    return pairs
