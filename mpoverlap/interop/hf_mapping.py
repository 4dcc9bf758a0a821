"""Which transformers class reproduces an mpoverlap model exactly, and its config.json.

Pure Python (no transformers import), so the validator can use it on any machine. The tensor
names and fused layouts are in `hf_tensors`.

Classes (nothing else is written: an approximate export is worse than none); every one needs
model.norm=rmsnorm, model.activation=swiglu:
  dense                                                   -> LlamaForCausalLM
  dense, model.qkv_bias=true                              -> Qwen2ForCausalLM (Qwen2 / Qwen2.5)
  dense, model.qk_norm=true                               -> Qwen3ForCausalLM
  MoE, every layer (moe_layer_freq=1, no leading dense layer), no shared expert, dropless,
  softmax router with top-k renormalised                  -> MixtralForCausalLM
  MoE, model.qk_norm=true, moe_layer_freq=1 (leading dense layers allowed: mlp_only_layers),
  no shared expert, dropless, softmax router (top-k renormalised or not: norm_topk_prob)
                                                          -> Qwen3MoeForCausalLM
  model.attention=mla (latent attention), MoE             -> DeepseekV3ForCausalLM (hf_deepseek_v3)

Why no permutation is needed anywhere (DeepSeek-V3's interleaved RoPE rows do need one: see
hf_deepseek_v3):
  RoPE: ours is rotate-half (pairs i, i + D/2) with inv_freq_i = 1 / base^(2i/D), exactly HF's
        default rope (rope_theta = model.rope_base); model.rope_scaling llama3 is HF's llama3
        rope type, computed the same way (models/rope.py): q/k rows map unchanged.
  attn.qkv.weight [(N + 2G) D, H] = rows [q | k | v], q N heads and k, v G groups (GQA:
        model.num_query_groups = num_key_value_heads) of D rows head-major (D = model.head_dim
        = HF head_dim), which is the row order of q_proj / k_proj / v_proj: a split.
  Qwen3's q_norm / k_norm are RMSNorms over each head's D channels before RoPE (model.qk_norm).
  Routers: softmax over all experts in fp32, top-k, renormalised (Mixtral; Qwen3-MoE with
        norm_topk_prob) or not (Qwen3-MoE without): model.moe_router_score=softmax,
        moe_router_order=score_topk, moe_router_norm_topk.
  The padded vocabulary (model.make_vocab_size_divisible_by) is the HF vocab_size.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

ARCH_LLAMA, ARCH_MIXTRAL = "LlamaForCausalLM", "MixtralForCausalLM"
ARCH_QWEN2, ARCH_QWEN3, ARCH_QWEN3_MOE = "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
ARCHS = (ARCH_LLAMA, ARCH_QWEN2, ARCH_QWEN3, ARCH_MIXTRAL, ARCH_QWEN3_MOE)
# model.attention=mla: its config and tensor mapping are in hf_deepseek_v3
ARCH_DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
MODEL_TYPES = {ARCH_LLAMA: "llama", ARCH_QWEN2: "qwen2", ARCH_QWEN3: "qwen3", ARCH_MIXTRAL: "mixtral",
               ARCH_QWEN3_MOE: "qwen3_moe"}
RMS_ONLY = "transformers' Llama/Qwen/Mixtral classes normalise with RMSNorm and use SwiGLU MLPs"
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ConversionError(Exception):
    """A model or directory that cannot be converted exactly; names the keys and the fix."""


def num_kv_heads(m: Dict[str, Any]) -> int:
    """THE place where GQA maps: model.num_query_groups (null = the heads) <-> num_key_value_heads.
    qkv rows are [q: N*D | k: G*D | v: G*D] (see `_qkv_rows`), the row order of q_proj, k_proj,
    v_proj (HF's query head n reads K/V head n // (N / G), as ours does)."""
    return int(m.get("num_query_groups") or m["num_attention_heads"])


def head_dim(m: Dict[str, Any]) -> int:
    return int(m.get("head_dim") or int(m["hidden_size"]) // int(m["num_attention_heads"]))


def _qkv_rows(m: Dict[str, Any]) -> Tuple[int, int, int]:
    D = head_dim(m)
    return int(m["num_attention_heads"]) * D, num_kv_heads(m) * D, num_kv_heads(m) * D


def moe_ffn(m: Dict[str, Any]) -> int:
    return int(m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"])


def padded_vocab(m: Dict[str, Any]) -> int:
    from mpoverlap.models.init import padded_vocab_size

    return padded_vocab_size(int(m["vocab_size"]), int(m["make_vocab_size_divisible_by"]))


def rope_scaling(m: Dict[str, Any]) -> Dict[str, Any] | None:
    """model.rope_scaling as a plain dict when it scales (rope_type set), else None."""
    rs = m.get("rope_scaling")
    if rs is None or rs.get("rope_type") is None:
        return None
    return {"rope_type": str(rs["rope_type"]), **{k: rs[k] for k in LLAMA3_KEYS}}


def architecture(m: Dict[str, Any]) -> str:
    """The transformers class for the model keys `m`; ConversionError naming EVERY key that
    makes the model one no transformers class reproduces exactly."""
    if m.get("attention", "mha") == "mla":
        from mpoverlap.interop import hf_deepseek_v3 as ds

        bad = ds.problems(m)
        if bad:
            raise ConversionError("no transformers class reproduces this model exactly, so nothing was written: "
                                  + "; ".join(bad) + f". Latent attention maps to {ds.ARCH_DEEPSEEK_V3}")
        return ds.ARCH_DEEPSEEK_V3
    bad: List[str] = []
    if m["norm"] != "rmsnorm":
        bad.append(f"model.norm={m['norm']} ({RMS_ONLY})")
    if m["activation"] != "swiglu":
        bad.append(f"model.activation={m['activation']} ({RMS_ONLY})")
    rs = rope_scaling(m)
    if rs is not None and rs["rope_type"] != "llama3":
        bad.append(f"model.rope_scaling.rope_type={rs['rope_type']} (only llama3 scaling is exported)")
    qkv_bias, qk_norm = bool(m.get("qkv_bias")), bool(m.get("qk_norm"))
    if qkv_bias and qk_norm:
        bad.append("model.qkv_bias=true with model.qk_norm=true (Qwen3's attention_bias also adds an o_proj "
                   "bias; Qwen2 has no q/k norm)")
    if int(m.get("mtp_num_layers") or 0) > 0:
        bad.append(f"model.mtp_num_layers={m['mtp_num_layers']} (of the exported architectures only DeepSeek-V3, "
                   "with model.attention=mla, has multi-token prediction depths)")
    moe = int(m.get("num_experts") or 0) > 0
    if moe:
        arch = ARCH_QWEN3_MOE if qk_norm else ARCH_MIXTRAL
        if qkv_bias:
            bad.append("model.qkv_bias=true (Mixtral and Qwen3-MoE have no q/k/v bias)")
        if m.get("shared_expert"):
            bad.append(f"model.shared_expert=true ({arch} has no shared expert)")
        if int(m.get("moe_layer_freq", 1)) != 1:
            bad.append(f"model.moe_layer_freq={m['moe_layer_freq']} ({arch} makes every layer MoE)")
        if arch == ARCH_MIXTRAL and int(m.get("moe_first_dense_layers") or 0) != 0:
            bad.append(f"model.moe_first_dense_layers={m['moe_first_dense_layers']} (Mixtral makes every layer "
                       "MoE; Qwen3-MoE, with model.qk_norm=true, can keep leading dense layers)")
        wanted = {"moe_router_score": "softmax", "moe_router_order": "score_topk"}
        if arch == ARCH_MIXTRAL:
            wanted["moe_router_norm_topk"] = True
        router = [(k, m.get(k), v) for k, v in wanted.items() if m.get(k, v) != v]
        bad += [f"model.{k}={str(got).lower()} ({arch}'s router is a softmax over all experts, then top-k"
                + (", renormalised)" if arch == ARCH_MIXTRAL else ")") for k, got, _ in router]
        if float(m.get("moe_router_bias_update_rate") or 0.0) != 0.0:
            bad.append(f"model.moe_router_bias_update_rate={m['moe_router_bias_update_rate']} ({arch}'s router "
                       "has no expert bias)")
        if int(m.get("moe_router_num_groups") or 1) != 1:
            bad.append(f"model.moe_router_num_groups={m['moe_router_num_groups']} ({arch}'s router chooses among "
                       "all experts, not within the best groups)")
        if float(m.get("moe_router_scaling_factor") or 1.0) != 1.0:
            bad.append(f"model.moe_router_scaling_factor={m['moe_router_scaling_factor']} ({arch}'s routed "
                       "weights are not scaled)")
        if m.get("moe_router_force_load_balancing"):
            bad.append("model.moe_router_force_load_balancing=true (this run routed by random logits, a benchmark "
                       "setting: the router it trained never chose the experts)")
        if m.get("moe_capacity_factor") is not None:
            bad.append(f"model.moe_capacity_factor={m['moe_capacity_factor']} (this model drops tokens "
                       f"beyond capacity; {arch} is dropless)")
    else:
        arch = ARCH_QWEN3 if qk_norm else ARCH_QWEN2 if qkv_bias else ARCH_LLAMA
    if bad:
        raise ConversionError(
            "no transformers class reproduces this model exactly, so nothing was written: "
            + "; ".join(bad) + ". Llama needs model.norm=rmsnorm model.activation=swiglu; Mixtral also "
            "model.shared_expert=false model.moe_layer_freq=1 model.moe_capacity_factor=null")
    return arch


def _rope_config(m: Dict[str, Any]) -> Dict[str, Any]:
    """rope_theta and rope_scaling for transformers 4.x, rope_parameters for 5.x: the same rope."""
    theta = float(m["rope_base"])
    rs = rope_scaling(m)
    params = {"rope_type": "default", "rope_theta": theta}
    if rs is not None:
        rs = dict(rs, factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
                  high_freq_factor=float(rs["high_freq_factor"]),
                  original_max_position_embeddings=int(rs["original_max_position_embeddings"]))
        params = dict(rs, rope_theta=theta)
    return {"rope_theta": theta, "rope_scaling": rs, "rope_parameters": params}


def hf_config(m: Dict[str, Any]) -> Dict[str, Any]:
    """config.json for the model keys `m` (architecture() must pass)."""
    arch = architecture(m)
    if arch == ARCH_DEEPSEEK_V3:
        from mpoverlap.interop import hf_deepseek_v3 as ds

        return ds.hf_config(m)
    H, N, L = int(m["hidden_size"]), int(m["num_attention_heads"]), int(m["num_layers"])
    cfg = {
        "architectures": [arch], "model_type": MODEL_TYPES[arch],
        "vocab_size": padded_vocab(m), "hidden_size": H, "num_hidden_layers": L,
        "num_attention_heads": N, "num_key_value_heads": num_kv_heads(m), "head_dim": head_dim(m),
        "hidden_act": "silu", "rms_norm_eps": float(m["norm_eps"]), **_rope_config(m),
        "max_position_embeddings": int(m["seq_length"]), "tie_word_embeddings": bool(m["tie_embeddings"]),
        "attention_dropout": 0.0, "initializer_range": float(m.get("init_std", 0.02)),
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "use_cache": True,
        "torch_dtype": "float32", "intermediate_size": int(m["ffn_hidden_size"]),
    }
    if arch != ARCH_QWEN2:  # Qwen2 always has the q/k/v bias and no key for it
        cfg["attention_bias"] = False
    if arch in (ARCH_QWEN2, ARCH_QWEN3, ARCH_QWEN3_MOE):
        cfg.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": L})
    if arch == ARCH_LLAMA:
        cfg["mlp_bias"] = False
    elif arch == ARCH_MIXTRAL:
        cfg.update({"intermediate_size": moe_ffn(m), "num_local_experts": int(m["num_experts"]),
                    "num_experts_per_tok": int(m["moe_top_k"]), "sliding_window": None,
                    "output_router_logits": False,
                    "router_aux_loss_coef": float(m.get("moe_aux_loss_coeff", 0.0))})
    elif arch == ARCH_QWEN3_MOE:
        cfg.update({"moe_intermediate_size": moe_ffn(m), "num_experts": int(m["num_experts"]),
                    "num_experts_per_tok": int(m["moe_top_k"]), "norm_topk_prob": bool(m["moe_router_norm_topk"]),
                    "decoder_sparse_step": 1, "mlp_only_layers": list(range(int(m.get("moe_first_dense_layers") or 0))),
                    "output_router_logits": False,
                    "router_aux_loss_coef": float(m.get("moe_aux_loss_coeff", 0.0))})
    return cfg


def _refuse_hf(key: str, value: Any, why: str) -> ConversionError:
    return ConversionError(f"config.json: {key}={value!r}: {why}; mpoverlap starts from Llama (with default or "
                           "llama3 RoPE), Qwen2, Qwen3, Mixtral or Qwen3-MoE directories with RMSNorm, SwiGLU and "
                           "no biases beyond Qwen2's q/k/v ones")


def _rope_keys_from_hf(hf: Dict[str, Any]) -> Dict[str, Any]:
    """rope_base and model.rope_scaling.* from rope_parameters (transformers 5) or rope_theta +
    rope_scaling (4.x). Refuses the rope types the model does not compute."""
    rope = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    if not rope.get("rope_type") or rope.get("rope_type") == "default":
        rope.update({k: v for k, v in legacy.items() if k != "type"})
        rope.setdefault("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    kind = rope.get("rope_type") or "default"
    keys = {"rope_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "rope_scaling.rope_type": None}
    if kind == "default":
        return keys
    if kind != "llama3":
        raise _refuse_hf("rope_parameters.rope_type", kind, "only the default and llama3 rope types are computed "
                         "exactly (see model.rope_scaling in docs/hf-checkpoints.md)")
    missing = [k for k in LLAMA3_KEYS if k not in rope]
    if missing:
        raise _refuse_hf("rope_parameters", rope, f"llama3 rope lacks {missing}")
    keys.update({"rope_scaling.rope_type": "llama3", **{f"rope_scaling.{k}": float(rope[k]) for k in LLAMA3_KEYS[:3]},
                 "rope_scaling.original_max_position_embeddings": int(rope["original_max_position_embeddings"])})
    return keys


def model_keys_from_hf(hf: Dict[str, Any]) -> Dict[str, Any]:
    """HF config.json -> the model.* values it implies (without vocab_size: the HF vocab is
    the PADDED size, compared by `mismatches`; model.rope_scaling's fields as dotted keys)."""
    arch = (hf.get("architectures") or [None])[0]
    if arch == ARCH_DEEPSEEK_V3:
        from mpoverlap.interop import hf_deepseek_v3 as ds

        return ds.model_keys_from_hf(hf)
    if arch not in ARCHS:
        raise _refuse_hf("architectures", hf.get("architectures"),
                         f"not one of {', '.join(ARCHS + (ARCH_DEEPSEEK_V3,))}")
    H, N = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    checks = [("hidden_act", hf.get("hidden_act", "silu"), "silu"),
              ("mlp_bias", bool(hf.get("mlp_bias", False)), False)]
    if arch != ARCH_QWEN2:
        checks.append(("attention_bias", bool(hf.get("attention_bias", False)), False))
    if arch in (ARCH_LLAMA, ARCH_MIXTRAL):
        checks.append(("sliding_window", hf.get("sliding_window"), None))
    else:  # Qwen configs carry a sliding_window size that applies only with use_sliding_window
        checks.append(("use_sliding_window", bool(hf.get("use_sliding_window", False)), False))
    if arch == ARCH_QWEN3_MOE:
        checks.append(("decoder_sparse_step", int(hf.get("decoder_sparse_step", 1)), 1))
    for key, value, wanted in checks:
        if value != wanted:
            raise _refuse_hf(key, value, f"only {wanted!r} is reproduced exactly")
    kv = int(hf.get("num_key_value_heads") or N)  # grouped-query attention: see num_kv_heads
    keys = {"num_layers": int(hf["num_hidden_layers"]), "hidden_size": H, "num_attention_heads": N,
            "num_query_groups": kv, "head_dim": int(hf.get("head_dim") or H // N),
            "norm": "rmsnorm", "activation": "swiglu", "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), **_rope_keys_from_hf(hf),
            "qkv_bias": arch == ARCH_QWEN2, "qk_norm": arch in (ARCH_QWEN3, ARCH_QWEN3_MOE), "attention": "mha"}
    if arch in (ARCH_LLAMA, ARCH_QWEN2, ARCH_QWEN3):
        keys.update({"ffn_hidden_size": int(hf["intermediate_size"]), "num_experts": 0})
    elif arch == ARCH_MIXTRAL:
        keys.update({"moe_ffn_hidden_size": int(hf["intermediate_size"]), "num_experts": int(hf["num_local_experts"]),
                     "moe_top_k": int(hf["num_experts_per_tok"]), "shared_expert": False, "moe_layer_freq": 1,
                     "moe_first_dense_layers": 0, "moe_router_norm_topk": True})
    else:
        dense = [int(i) for i in hf.get("mlp_only_layers") or []]
        if dense != list(range(len(dense))):
            raise _refuse_hf("mlp_only_layers", dense, "only leading dense layers [0, 1, ..., k-1] map "
                             "(model.moe_first_dense_layers=k)")
        keys.update({"moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
                     "num_experts": int(hf.get("num_experts") or hf["num_local_experts"]),
                     "moe_top_k": int(hf["num_experts_per_tok"]), "shared_expert": False, "moe_layer_freq": 1,
                     "moe_first_dense_layers": len(dense), "moe_router_norm_topk": bool(hf.get("norm_topk_prob", False))})
        if dense:  # the dense layers' width
            keys["ffn_hidden_size"] = int(hf["intermediate_size"])
    if keys["num_experts"]:
        keys.update({"moe_router_score": "softmax", "moe_router_order": "score_topk"})
    return keys


def mismatches(hf: Dict[str, Any], model: Any) -> List[Tuple[str, Any, Any]]:
    """[(model key, value implied by the HF config, our value)] for every disagreement."""
    want = model_keys_from_hf(hf)
    m = {k: model[k] for k in model}  # DictConfig or dict
    rs = m.get("rope_scaling") or {}
    ours = dict(m, moe_ffn_hidden_size=moe_ffn(m) if want.get("num_experts") else m.get("moe_ffn_hidden_size"),
                num_query_groups=num_kv_heads(m), head_dim=head_dim(m),  # null (= the default) compares as it
                **{f"rope_scaling.{k}": rs.get(k) for k in ("rope_type",) + LLAMA3_KEYS})
    if want.get("attention") == "mla":
        from mpoverlap.interop import hf_deepseek_v3 as ds

        ours.update(ds.comparable(m))
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
