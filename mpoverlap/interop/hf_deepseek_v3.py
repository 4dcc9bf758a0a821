"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM) <-> mpoverlap's latent-attention MoE model:
which models it reproduces, its config.json both ways, and its tensor names and row orders.

The model: model.attention=mla (models/mla.py), the first model.moe_first_dense_layers layers
dense (first_k_dense_replace, intermediate_size = model.ffn_hidden_size), the others MoE with a
sigmoid router over n_routed_experts (model.moe_router_score=sigmoid, score_topk), the
selection biased by e_score_correction_bias (our router's expert_bias), top-k within the
topk_group best of n_group groups (model.moe_router_num_groups / moe_router_group_topk),
renormalised when norm_topk_prob, scaled by routed_scaling_factor, plus n_shared_experts shared
experts as one MLP of width n_shared_experts * moe_intermediate_size.

Tensor names (model.layers.<i>. on the HF side):
  ours attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
  kv_b_proj}                                   self_attn.<the same>
  attn.proj                                    self_attn.o_proj
  mlp.router.weight / expert_bias              mlp.gate.weight / e_score_correction_bias
  mlp.experts.<e>.gate_up / down               mlp.experts.<e>.{gate,up}_proj / down_proj
                                               (or transformers 5's fused experts.gate_up_proj[e])
  mlp.shared_expert.gate_up / down             mlp.shared_experts.{gate,up}_proj / down_proj
Row order: our RoPE rotates halves (channel j with j + p/2); with rope_interleave (DeepSeek's
layout, transformers' default) HF rotates pairs (2j, 2j + 1) and its output is the halves
layout of the de-interleaved channels. So the p rope rows of every query head (q_b_proj or
q_proj: rows n..n+p of each n+p) and the shared rope rows of kv_a_proj_with_mqa (its last p)
are stored here as [even | odd] of theirs: permuted on import, back on export. The dot products
q.k are then equal channel for channel.

Multi-token prediction (model.mtp_num_layers, models/mtp.py) in DeepSeek's layer-index layout:
depth d (0-based) is model.layers.<num_hidden_layers + d>. with enorm (our embed_norm), hnorm
(hidden_norm), eh_proj, the block's tensors, shared_head.norm (final_norm) and copies of the
embedding (embed_tokens) and head (shared_head.head); config.json's num_nextn_predict_layers
counts them. DeepSeek's eh_proj reads [enorm(e) ; hnorm(h)], ours [hidden_norm(h) ; embed_norm(e)]:
its two column halves swap. transformers' class has no MTP module and skips those tensors.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from mpoverlap.interop.hf_mapping import ARCH_DEEPSEEK_V3, ConversionError, moe_ffn, padded_vocab

MODEL_TYPE = "deepseek_v3"
# transformers' DeepseekV3RMSNorm for q_a_layernorm / kv_a_layernorm keeps its default epsilon
# (rms_norm_eps applies to the block norms only); ours use model.norm_eps for all.
LATENT_NORM_EPS = 1e-6


def shared_width(m: Dict[str, Any]) -> int:
    return int(m.get("moe_shared_expert_ffn_hidden_size") or moe_ffn(m))


def group_topk(m: Dict[str, Any]) -> int:
    groups = int(m.get("moe_router_num_groups") or 1)
    return int(m.get("moe_router_group_topk") or groups)


def problems(m: Dict[str, Any]) -> List[str]:
    """Every `model.key=value (why)` that keeps DeepseekV3ForCausalLM from reproducing `m`."""
    bad = []
    if m["norm"] != "rmsnorm":
        bad.append(f"model.norm={m['norm']} (DeepSeek-V3 normalises with RMSNorm)")
    if m["activation"] != "swiglu":
        bad.append(f"model.activation={m['activation']} (DeepSeek-V3's MLPs are SwiGLU)")
    rs = m.get("rope_scaling") or {}
    if rs.get("rope_type") is not None:
        bad.append(f"model.rope_scaling.rope_type={rs['rope_type']} (only DeepSeek-V3's default rope is exported)")
    if m.get("qkv_bias"):
        bad.append("model.qkv_bias=true (latent attention has no q/k/v bias)")
    if m.get("qk_norm"):
        bad.append("model.qk_norm=true (latent attention has no per-head q/k norm)")
    if abs(float(m["norm_eps"]) - LATENT_NORM_EPS) > 1e-12:
        bad.append(f"model.norm_eps={m['norm_eps']} (transformers' latent norms keep epsilon {LATENT_NORM_EPS})")
    if int(m.get("num_experts") or 0) == 0:
        bad.append("model.num_experts=0 (DeepSeek-V3 routes every layer past first_k_dense_replace)")
        return bad
    if int(m.get("moe_layer_freq", 1)) != 1:
        bad.append(f"model.moe_layer_freq={m['moe_layer_freq']} (DeepSeek-V3 makes every layer past the "
                   "leading dense ones MoE)")
    if not m.get("shared_expert"):
        bad.append("model.shared_expert=false (DeepSeek-V3 always has n_shared_experts >= 1)")
    elif shared_width(m) % moe_ffn(m):
        bad.append(f"model.moe_shared_expert_ffn_hidden_size={shared_width(m)} (DeepSeek-V3's shared experts "
                   f"are n_shared_experts of width moe_intermediate_size={moe_ffn(m)})")
    if m.get("moe_router_score") != "sigmoid":
        bad.append(f"model.moe_router_score={m.get('moe_router_score')} (DeepSeek-V3's router scores with a sigmoid)")
    if m.get("moe_router_order", "score_topk") != "score_topk":
        bad.append(f"model.moe_router_order={m['moe_router_order']} (DeepSeek-V3 takes the top k of the scores)")
    if m.get("moe_router_force_load_balancing"):
        bad.append("model.moe_router_force_load_balancing=true (this run routed by random logits, a benchmark "
                   "setting: the router it trained never chose the experts)")
    if m.get("moe_capacity_factor") is not None:
        bad.append(f"model.moe_capacity_factor={m['moe_capacity_factor']} (this model drops tokens beyond "
                   "capacity; DeepSeek-V3 is dropless)")
    return bad


def hf_config(m: Dict[str, Any]) -> Dict[str, Any]:
    """config.json for the model keys `m` (problems(m) must be empty)."""
    theta = float(m["rope_base"])
    q_rank = int(m.get("q_lora_rank") or 0)
    return {
        "architectures": [ARCH_DEEPSEEK_V3], "model_type": MODEL_TYPE, "vocab_size": padded_vocab(m),
        "hidden_size": int(m["hidden_size"]), "num_hidden_layers": int(m["num_layers"]),
        "num_attention_heads": int(m["num_attention_heads"]), "num_key_value_heads": int(m["num_attention_heads"]),
        "q_lora_rank": q_rank or None, "kv_lora_rank": int(m["kv_lora_rank"]),
        "qk_nope_head_dim": int(m["qk_nope_head_dim"]), "qk_rope_head_dim": int(m["qk_rope_head_dim"]),
        "v_head_dim": int(m["v_head_dim"]), "rope_interleave": True, "attention_bias": False,
        "attention_dropout": 0.0, "rope_theta": theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "intermediate_size": int(m["ffn_hidden_size"]), "moe_intermediate_size": moe_ffn(m),
        "first_k_dense_replace": int(m.get("moe_first_dense_layers") or 0),
        "n_routed_experts": int(m["num_experts"]), "num_experts_per_tok": int(m["moe_top_k"]),
        "n_shared_experts": shared_width(m) // moe_ffn(m), "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "n_group": int(m.get("moe_router_num_groups") or 1), "topk_group": group_topk(m),
        "norm_topk_prob": bool(m.get("moe_router_norm_topk", True)),
        "routed_scaling_factor": float(m.get("moe_router_scaling_factor") or 1.0),
        "num_nextn_predict_layers": int(m.get("mtp_num_layers") or 0),
        "hidden_act": "silu", "rms_norm_eps": float(m["norm_eps"]), "max_position_embeddings": int(m["seq_length"]),
        "tie_word_embeddings": bool(m["tie_embeddings"]), "initializer_range": float(m.get("init_std", 0.02)),
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "use_cache": True,
        "output_router_logits": False, "torch_dtype": "float32",
    }


def _refuse(key: str, value: Any, why: str, fix: str) -> ConversionError:
    return ConversionError(f"config.json: {key}={value!r}: {why}; {fix}")


def model_keys_from_hf(hf: Dict[str, Any]) -> Dict[str, Any]:
    """A DeepseekV3ForCausalLM config.json -> the model.* values it implies (vocab_size apart)."""
    N = int(hf["num_attention_heads"])
    rope = dict(hf.get("rope_parameters") or {})
    kind = rope.get("rope_type") or (hf.get("rope_scaling") or {}).get("rope_type") \
        or (hf.get("rope_scaling") or {}).get("type") or "default"
    checks = [("hidden_act", hf.get("hidden_act", "silu"), "silu",
               "point checkpoint.init_from at a directory with SwiGLU MLPs"),
              ("attention_bias", bool(hf.get("attention_bias", False)), False,
               "latent attention here has no biases"),
              ("rope_parameters.rope_type", kind, "default",
               "only DeepSeek-V3's default rope is computed exactly (YaRN's frequencies and logit scale are not)"),
              ("num_key_value_heads", int(hf.get("num_key_value_heads") or N), N,
               "latent attention up-projects keys and values for every head"),
              ("rms_norm_eps", float(hf.get("rms_norm_eps", 1e-6)), LATENT_NORM_EPS,
               "transformers' latent norms keep epsilon 1e-6 while model.norm_eps sets every norm here"),
              ("scoring_func", hf.get("scoring_func", "sigmoid"), "sigmoid", "DeepSeek-V3's router is a sigmoid"),
              ("topk_method", hf.get("topk_method", "noaux_tc"), "noaux_tc",
               "DeepSeek-V3 routes by the bias-corrected group-limited top-k (noaux_tc)")]
    for key, value, wanted, why in checks:
        if value != wanted:
            raise _refuse(key, value, f"only {wanted!r} is reproduced exactly ({why})",
                          "export it from a run whose model matches, or convert it with transformers first")
    shared = int(hf.get("n_shared_experts") or 0)
    if shared < 1:
        raise _refuse("n_shared_experts", hf.get("n_shared_experts"), "mpoverlap's DeepSeek-V3 mapping needs a "
                      "shared expert", "point checkpoint.init_from at a directory with n_shared_experts >= 1")
    F = int(hf["moe_intermediate_size"])
    return {"num_layers": int(hf["num_hidden_layers"]), "hidden_size": int(hf["hidden_size"]),
            "num_attention_heads": N, "attention": "mla", "q_lora_rank": int(hf.get("q_lora_rank") or 0),
            "kv_lora_rank": int(hf["kv_lora_rank"]), "qk_nope_head_dim": int(hf["qk_nope_head_dim"]),
            "qk_rope_head_dim": int(hf["qk_rope_head_dim"]), "v_head_dim": int(hf["v_head_dim"]),
            "norm": "rmsnorm", "activation": "swiglu", "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), "rope_scaling.rope_type": None,
            "qkv_bias": False, "qk_norm": False, "ffn_hidden_size": int(hf["intermediate_size"]),
            "moe_ffn_hidden_size": F, "num_experts": int(hf["n_routed_experts"]),
            "moe_top_k": int(hf["num_experts_per_tok"]), "moe_layer_freq": 1,
            "moe_first_dense_layers": int(hf.get("first_k_dense_replace") or 0), "shared_expert": True,
            "moe_shared_expert_ffn_hidden_size": shared * F, "moe_router_score": "sigmoid",
            "moe_router_order": "score_topk", "moe_router_norm_topk": bool(hf.get("norm_topk_prob", True)),
            "moe_router_num_groups": int(hf.get("n_group") or 1),
            "moe_router_group_topk": int(hf.get("topk_group") or hf.get("n_group") or 1),
            "moe_router_scaling_factor": float(hf.get("routed_scaling_factor", 1.0))}


def comparable(m: Dict[str, Any]) -> Dict[str, Any]:
    """Our values of the keys model_keys_from_hf sets where a null means a default."""
    return {"q_lora_rank": int(m.get("q_lora_rank") or 0), "moe_ffn_hidden_size": moe_ffn(m),
            "moe_shared_expert_ffn_hidden_size": shared_width(m) if m.get("shared_expert") else None,
            "moe_router_num_groups": int(m.get("moe_router_num_groups") or 1), "moe_router_group_topk": group_topk(m),
            "moe_router_scaling_factor": float(m.get("moe_router_scaling_factor") or 1.0)}


def _block_parts(m: Dict[str, Any], ours: str, hf: str, moe: bool, part) -> Dict[str, list]:
    att = f"{hf}.self_attn"
    out = {f"{ours}.attn_norm.weight": [part(f"{hf}.input_layernorm.weight")],
           f"{ours}.mlp_norm.weight": [part(f"{hf}.post_attention_layernorm.weight")],
           f"{ours}.attn.proj.weight": [part(f"{att}.o_proj.weight")]}
    names = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"]
    names += ["q_a_proj", "q_a_layernorm", "q_b_proj"] if int(m.get("q_lora_rank") or 0) else ["q_proj"]
    out.update({f"{ours}.attn.{n}.weight": [part(f"{att}.{n}.weight")] for n in names})
    mlp = f"{hf}.mlp"
    if not moe:
        out[f"{ours}.mlp.gate_up.weight"] = [part(f"{mlp}.gate_proj.weight"), part(f"{mlp}.up_proj.weight")]
        out[f"{ours}.mlp.down.weight"] = [part(f"{mlp}.down_proj.weight")]
        return out
    out[f"{ours}.mlp.router.weight"] = [part(f"{mlp}.gate.weight")]
    out[f"{ours}.mlp.router.expert_bias"] = [part(f"{mlp}.gate.e_score_correction_bias")]
    sh = f"{mlp}.shared_experts"
    out[f"{ours}.mlp.shared_expert.gate_up.weight"] = [part(f"{sh}.gate_proj.weight"), part(f"{sh}.up_proj.weight")]
    out[f"{ours}.mlp.shared_expert.down.weight"] = [part(f"{sh}.down_proj.weight")]
    return out


def parts_of(m: Dict[str, Any], part, is_moe_layer) -> Dict[str, list]:
    """{our name: HF parts} but the routed experts (hf_tensors adds those, as for Qwen3-MoE).
    `part(name)` builds an hf_tensors.Part; `is_moe_layer(m, i)` decides dense or MoE."""
    L = int(m["num_layers"])
    out = {"embedding.weight": [part("model.embed_tokens.weight")], "final_norm.weight": [part("model.norm.weight")]}
    if not m["tie_embeddings"]:
        out["output.weight"] = [part("lm_head.weight")]
    for i in range(L):
        out.update(_block_parts(m, f"layers.{i}", f"model.layers.{i}", is_moe_layer(m, i), part))
    for d in range(int(m.get("mtp_num_layers") or 0)):
        ours, hf = f"mtp.{d}", f"model.layers.{L + d}"
        out.update({f"{ours}.embed_norm.weight": [part(f"{hf}.enorm.weight")],
                    f"{ours}.hidden_norm.weight": [part(f"{hf}.hnorm.weight")],
                    f"{ours}.eh_proj.weight": [part(f"{hf}.eh_proj.weight")],
                    f"{ours}.final_norm.weight": [part(f"{hf}.shared_head.norm.weight")]})
        out.update(_block_parts(m, f"{ours}.block", hf, is_moe_layer(m, L + d), part))
    return out


def mtp_copies(state: Dict[str, torch.Tensor], m: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The embedding and head copies DeepSeek stores in every MTP layer (ours are the model's)."""
    L, out = int(m["num_layers"]), {}
    head = state["embedding.weight"] if m["tie_embeddings"] else state["output.weight"]
    for d in range(int(m.get("mtp_num_layers") or 0)):
        out[f"model.layers.{L + d}.embed_tokens.weight"] = state["embedding.weight"]
        out[f"model.layers.{L + d}.shared_head.head.weight"] = head
    return out


def missing_hint(name: str, m: Dict[str, Any]) -> str:
    """What to do when the directory lacks `name` (an HF tensor)."""
    L = int(m["num_layers"])
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= L:
        return (f"; it is multi-token prediction depth {int(parts[2]) - L} (model.mtp_num_layers="
                f"{m.get('mtp_num_layers')}), which this directory does not hold (transformers' save_pretrained "
                "drops it): set model.mtp_num_layers=0 to start without MTP")
    return ""


def check_biases_kept(reader, m: Dict[str, Any], table: Dict[str, list]) -> None:
    """Refuses a directory whose routers' e_score_correction_bias is nonzero when the model has
    no bias to take it (model.moe_router_bias_update_rate=0: the routers hold none), since
    dropping it would change which experts are chosen."""
    if float(m.get("moe_router_bias_update_rate") or 0.0) > 0:
        return
    parts = [parts[0] for name, parts in table.items() if name.endswith(".router.expert_bias")]
    before = reader.bytes_read
    used = [p.name for p in parts if reader.has(p.name) and bool(reader.read(p).abs().sum() > 0)]
    reader.bytes_read = before  # the counter is of the tensors handed to the model; these are not
    if used:
        raise ConversionError(f"the directory's routers select experts with a bias ({used[0]} and {len(used) - 1} "
                              "more are nonzero) but model.moe_router_bias_update_rate=0 gives the routers none: "
                              "set model.moe_router_bias_update_rate=1e-3 (DeepSeek-V3's rate; 0 < rate keeps "
                              "the bias)")


def _rope_rows(t: torch.Tensor, width: int, offset: int, p: int, to_ours: bool) -> torch.Tensor:
    """Rows [offset, offset + p) of every `width`-row group of `t`: interleaved pairs -> halves
    (to_ours) or back."""
    order = torch.cat([torch.arange(0, p, 2), torch.arange(1, p, 2)])
    if not to_ours:
        order = torch.argsort(order)
    groups = t.reshape(-1, width, *t.shape[1:])
    out = groups.clone()
    out[:, offset:offset + p] = groups[:, offset:offset + p][:, order]
    return out.reshape(t.shape)


def convert(name: str, t: torch.Tensor, m: Dict[str, Any], to_ours: bool, interleaved: bool = True) -> torch.Tensor:
    """`t` (our parameter `name`, full or this rank's shard of whole heads) in the other side's
    row/column order: RoPE rows (when `interleaved`) and eh_proj's halves; others unchanged."""
    if name.endswith(".eh_proj.weight"):
        H = t.shape[1] // 2
        return torch.cat([t[:, H:], t[:, :H]], dim=1)
    if not interleaved:
        return t
    n, p = int(m["qk_nope_head_dim"]), int(m["qk_rope_head_dim"])
    if name.endswith((".attn.q_b_proj.weight", ".attn.q_proj.weight")):
        return _rope_rows(t, n + p, n, p, to_ours)
    if name.endswith(".attn.kv_a_proj_with_mqa.weight"):
        c = int(m["kv_lora_rank"])
        return _rope_rows(t, c + p, c, p, to_ours)
    return t


def interleaved(hf: Optional[Dict[str, Any]]) -> bool:
    return bool((hf or {}).get("rope_interleave", True))
