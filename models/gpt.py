"""A GPT decoder, readable top to bottom: the single-process reference model.

No process groups and no distributed code live here; parallel layers reproduce this math.

Shape letters: B batch, S sequence, H hidden, N heads, G K/V groups (model.num_query_groups,
default N), D head dim (H / N), F ffn hidden, V padded vocabulary (Vpad), L layers.

Fused weight layouts (a tensor-parallel layer slices each block separately):
  attn.qkv.weight   [(N + 2G) D, H]: rows [q | k | v]; q = N heads of D rows, k and v = G
                    groups of D rows each, head-major ([3H, H] without GQA, G = N). Query
                    head n uses K/V group n // (N / G); tp splits q's heads and the groups
                    alike (rank r: query heads r N/tp.., groups r G/tp..), so a rank's query
                    heads find their groups on the same rank (the rules need tp | G).
  mlp.gate_up.weight [2F, H]: rows [gate | up] (swiglu); gelu uses mlp.up.weight [F, H].

Initialisation is layout independent: each parameter is drawn, as a full tensor, from its own
torch.Generator seeded by `param_seed(seed, name)`; a sharded layer calls `init_tensor` with the
same name and full shape and slices its part.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mpoverlap.models import fused, layers
from mpoverlap.ops.activation import swiglu
from mpoverlap.models.init import RESIDUAL_OUT_SUFFIXES, init_tensor, padded_vocab_size, param_seed  # noqa: F401
from mpoverlap.models.init import head_dim_of, qkv_rows, query_groups
from mpoverlap.models.mla import LatentAttention, rope_dim
from mpoverlap.models.mtp import MTPDepth, mtp_loss
from mpoverlap.models.rope import apply_rope, apply_rope_qk, rope_cos_sin, rope_scaling_of  # noqa: F401 (re-exported)
from mpoverlap.precision import compute_dtype
from mpoverlap.recompute import recomputed, recomputed_layers

def make_norm(cfg) -> nn.Module:
    """RMSNorm or LayerNorm over H, per `model.norm`."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
    raise ValueError(f"model.norm={cfg.norm!r} is not supported; use model.norm=rmsnorm "
                     f"or model.norm=layernorm")


def causal_sdpa(q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor) -> torch.Tensor:
    """The default core attention: causal SDPA over the whole local sequence; k and v hold
    G <= N heads (grouped-query attention when G < N)."""
    gqa = k_BGSD.shape[1] != q_BNSD.shape[1]
    return F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, is_causal=True, enable_gqa=gqa)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg, prefix: str = "attn", seed: int = 1234, core_attention=causal_sdpa,
                 tp: Optional[dict] = None, math: Optional[dict] = None):
        super().__init__()
        self.math = math  # train.compile: the compiled regions (models/fused.py), else None
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(f"model.hidden_size={cfg.hidden_size} must be divisible by "
                             f"model.num_attention_heads={cfg.num_attention_heads}")
        H = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads // layers.tp_size(tp)  # local heads under TP
        self.num_groups = query_groups(cfg) // layers.tp_size(tp)  # local K/V groups under TP
        if cfg.num_attention_heads % query_groups(cfg):
            raise ValueError(f"model.num_query_groups={query_groups(cfg)} must divide "
                             f"model.num_attention_heads={cfg.num_attention_heads}")
        self.head_dim = head_dim_of(cfg)
        # q [B, N, S, D], k, v [B, G, S, D] -> y [B, N, S, D], causal over global positions. Context
        # parallelism hands in ring or all-to-all attention here; the model never sees a group.
        self.core_attention = core_attention
        # model.recompute=selective: the attention core keeps only q, k, v (recomputed in backward).
        self.recompute_core = getattr(cfg, "recompute", "none") == "selective"
        rows = qkv_rows(cfg)
        # model.qkv_bias: the bias rows split over TP with their heads, like the weight's.
        self.qkv = layers.column(f"{prefix}.qkv", H, sum(rows), cfg, seed, tp,
                                 blocks=3 if len(set(rows)) == 1 else rows, bias=bool(getattr(cfg, "qkv_bias", False)))
        # model.qk_norm: one RMSNorm over D, shared by every head (so replicated over TP; each
        # rank's gradient covers its own heads only: GPT.tp_partial_grad_params sums them).
        self.q_norm = self.k_norm = None
        if getattr(cfg, "qk_norm", False):
            self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps)
        self.proj = layers.row(f"{prefix}.proj", rows[0], H, cfg, seed, tp)

    def forward(self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor):
        """x_BSH -> y_BSH: qkv_BSq -> q_BNSD, k,v_BGSD -> RoPE(q, k) -> core attention -> proj.
        (N, G local under TP; h = N*D, g = G*D, q = h + 2g; under SP x and y hold S/tp
        positions, q/k/v all S.)"""
        qkv_BSq = self.qkv(x_BSH)
        B, S, _ = qkv_BSq.shape
        h, g = self.num_heads * self.head_dim, self.num_groups * self.head_dim
        q_BShD, k_BSgD, v_BSgD = qkv_BSq.split([h, g, g], dim=-1)
        q_BSND = q_BShD.view(B, S, self.num_heads, self.head_dim)
        k_BSGD = k_BSgD.view(B, S, self.num_groups, self.head_dim)
        if self.q_norm is not None:
            q_BSND, k_BSGD = self.q_norm(q_BSND), self.k_norm(k_BSGD)
        q_BNSD, k_BGSD = q_BSND.transpose(1, 2), k_BSGD.transpose(1, 2)
        v_BGSD = v_BSgD.view(B, S, self.num_groups, self.head_dim).transpose(1, 2)
        if self.math is not None:
            q_BNSD, k_BGSD = self.math["rope"](q_BNSD, k_BGSD, cos_SD, sin_SD)
        else:
            q_BNSD, k_BGSD = apply_rope_qk(q_BNSD, k_BGSD, cos_SD, sin_SD)
        if self.recompute_core:
            y_BNSD = recomputed(self.core_attention, q_BNSD, k_BGSD, v_BGSD)
        else:
            y_BNSD = self.core_attention(q_BNSD, k_BGSD, v_BGSD)
        return self.proj(y_BNSD.transpose(1, 2).reshape(B, S, h))


class MLP(nn.Module):
    def __init__(self, cfg, prefix: str = "mlp", seed: int = 1234, tp: Optional[dict] = None,
                 ffn_hidden_size: Optional[int] = None, math: Optional[dict] = None):
        super().__init__()
        self.math = math  # train.compile: the compiled regions (models/fused.py), else None
        H, Fh = cfg.hidden_size, ffn_hidden_size or cfg.ffn_hidden_size
        self.activation = cfg.activation
        if cfg.activation == "swiglu":
            self.gate_up = layers.column(f"{prefix}.gate_up", H, 2 * Fh, cfg, seed, tp, blocks=2)
        elif cfg.activation == "gelu":
            self.up = layers.column(f"{prefix}.up", H, Fh, cfg, seed, tp)
        else:
            raise ValueError(f"model.activation={cfg.activation!r} is not supported; use "
                             f"model.activation=swiglu or model.activation=gelu")
        self.down = layers.row(f"{prefix}.down", Fh, H, cfg, seed, tp)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """swiglu: down(silu(gate) * up); gelu: down(gelu(up)). (F local under TP.)"""
        if self.math is not None:
            h_BSF = (self.math["swiglu"](self.gate_up(x_BSH)) if self.activation == "swiglu"
                     else self.math["gelu"](self.up(x_BSH)))
        elif self.activation == "swiglu":
            h_BSF = swiglu(self.gate_up(x_BSH))  # silu(gate) * up over the GEMM's two halves
        else:
            h_BSF = F.gelu(self.up(x_BSH))
        return self.down(h_BSF)


def is_moe_layer(cfg, layer_index: int) -> bool:
    """Layer i's MLP is a mixture of experts when the model has experts, i is past the
    model.moe_first_dense_layers leading dense layers and i % model.moe_layer_freq == 0."""
    return (cfg.num_experts > 0 and layer_index >= getattr(cfg, "moe_first_dense_layers", 0)
            and layer_index % cfg.moe_layer_freq == 0)


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is a mixture of
    experts on MoE layers (`moe`: the expert-parallel context, None on one process)."""

    def __init__(self, cfg, prefix: str = "layers.0", seed: int = 1234, core_attention=causal_sdpa,
                 tp: Optional[dict] = None, moe: Optional[dict] = None, layer_index: int = 0,
                 compile_backend: Optional[str] = None):
        super().__init__()
        # train.compile: the block's elementwise math as compiled regions (models/fused.py)
        self.math = fused.regions(compile_backend) if compile_backend else None
        self.attn_norm = make_norm(cfg)
        # model.attention: mha (multi-head, grouped-query with model.num_query_groups) | mla
        attention = LatentAttention if getattr(cfg, "attention", "mha") == "mla" else CausalSelfAttention
        self.attn = attention(cfg, f"{prefix}.attn", seed, core_attention, tp, self.math)
        self.mlp_norm = make_norm(cfg)
        if is_moe_layer(cfg, layer_index):
            # Experts and router are not split over TP: under SP each TP rank routes its own
            # S/tp tokens (their gradients are then summed over TP like the norms'). The shared
            # expert is a dense MLP and is split over TP like one (column- then row-parallel,
            # with SP and collective matmul); its names do not depend on the layout.
            shared = (MLP(cfg, f"{prefix}.mlp.shared_expert", seed, tp, layers.shared_expert_ffn(cfg))
                      if cfg.shared_expert else None)
            self.mlp = layers.moe_mlp(f"{prefix}.mlp", cfg, seed, moe, shared)
        else:
            self.mlp = MLP(cfg, f"{prefix}.mlp", seed, tp, math=self.math)

    def forward(self, x_BSH, cos_SD, sin_SD):
        if self.math is not None:
            # norm (+ its cast for the GEMM), then the residual add fused with the MLP's norm
            dtype = compute_dtype(x_BSH)
            h_BSH = self.math["norm"](x_BSH, *fused.norm_args(self.attn_norm), dtype)
            x_BSH, h_BSH = self.math["add_norm"](x_BSH, self.attn(h_BSH, cos_SD, sin_SD),
                                                 *fused.norm_args(self.mlp_norm), dtype)
            y_BSH = self.mlp(h_BSH)
        else:
            x_BSH = x_BSH + self.attn(self.attn_norm(x_BSH), cos_SD, sin_SD)
            y_BSH = self.mlp(self.mlp_norm(x_BSH))
        if isinstance(y_BSH, tuple):  # MoE: (y, router output)
            y_BSH = y_BSH[0]
        return x_BSH + y_BSH


class GPT(nn.Module):
    """The decoder, or one pipeline chunk of it.

    `core_attention`: see CausalSelfAttention (default: causal SDPA on one process).
    `moe`: the expert-parallel context (`mpoverlap.moe.moe_kwargs`), None on one process.
    `compile_backend` (train.compile): each block's elementwise math as torch.compile'd regions
    with that backend (models/fused.py), None = eager.
    `tp`: the tensor-parallel context (`mpoverlap.tensor_parallel.tp_kwargs`), None on one
    process: projections, embedding, head and loss then come from the TP layers, and with
    sequence parallelism the residual stream holds S/tp positions per rank.
    `layer_ids` (default all), `pre_process` (owns the embedding: takes tokens) and
    `post_process` (owns the final norm and head: returns logits) cut out a pipeline chunk;
    blocks keep their global names (`layers.<i>`), so every layout starts from the same weights.
    A tied head on a chunk without the embedding keeps its own copy of `embedding.weight`
    (kept equal by summing the two copies' gradients over the embedding group).
    model.mtp_num_layers > 0: the chunk with post_process also holds the multi-token
    prediction depths (`mtp`, models/mtp.py), which read the embedding (a copy on a chunk
    without pre_process, summed like the tied one's) and the output head; `with_mtp=False`
    leaves them to a chunk of their own (models/mtp_chunk.py, parallel.mtp_stage=0 in a loop
    schedule), which the forward's `with_hidden` output feeds.
    """

    def __init__(self, cfg, seed: int = 1234, core_attention=causal_sdpa, tp: Optional[dict] = None,
                 layer_ids: Optional[Sequence[int]] = None, pre_process: bool = True,
                 post_process: bool = True, moe: Optional[dict] = None, compile_backend: Optional[str] = None,
                 with_mtp: bool = True):
        super().__init__()
        self.cfg = cfg
        self.tp = tp if layers.tp_size(tp) > 1 else None
        self.pre_process, self.post_process = pre_process, post_process
        self.vocab_size = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
        ids = range(cfg.num_layers) if layer_ids is None else layer_ids
        has_mtp = with_mtp and post_process and getattr(cfg, "mtp_num_layers", 0) > 0
        needs_embedding = pre_process or (post_process and cfg.tie_embeddings) or has_mtp
        self.embedding = (layers.embedding(self.vocab_size, cfg.hidden_size, cfg, seed, self.tp)
                          if needs_embedding else None)
        self.layers = nn.ModuleDict({str(i): Block(cfg, f"layers.{i}", seed, core_attention, self.tp, moe, i,
                                                   compile_backend) for i in ids})
        self.final_norm = make_norm(cfg) if post_process else None
        self.mtp = None
        if has_mtp:
            L = cfg.num_layers
            self.mtp = nn.ModuleDict({str(d): MTPDepth(cfg, make_norm, Block(
                cfg, f"mtp.{d}.block", seed, core_attention, self.tp, moe, L + d, compile_backend))
                for d in range(cfg.mtp_num_layers)})
        self._pending_mtp_loss = None  # set by forward (with mtp_targets), taken by loss
        self.last_loss_parts = None  # (LM loss, MTP loss), detached: the last loss() with MTP
        # model.recompute=full: the chunk's first blocks keep only their input (see mpoverlap/recompute).
        self.num_recomputed = recomputed_layers(getattr(cfg, "recompute", "none"), len(self.layers),
                                                getattr(cfg, "recompute_num_layers", None))
        # Tied: the head reuses self.embedding.weight and there is no separate head parameter.
        self.output = (None if cfg.tie_embeddings or not post_process
                       else layers.column("output", cfg.hidden_size, self.vocab_size, cfg, seed, self.tp))
        # train.compile: the loss's upcast, log-softmax and gradient as one compiled region
        self.loss_math = fused.regions(compile_backend)["loss"] if compile_backend and post_process else None
        self._rope_tables = None  # (positions tensor, dtype, cos, sin): see embed
        self.init_weights(seed)
        if self.embedding is not None and not pre_process:
            self.embedding.weight.pipeline_duplicate = True  # counted once, on the first stage

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Every parameter from its own generator: depends only on seed, name and shape.
        Tensor-parallel layers already sliced their shard of the same full tensor; stacked
        experts (`expert_names`) drew each expert's slice from its per-expert name."""
        for name, p in self.named_parameters():
            if not hasattr(p, "tensor_model_parallel") and not hasattr(p, "expert_names"):
                p.copy_(init_tensor(name, p.shape, self.cfg, seed))

    def forward(self, tokens_BS: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                fp32_logits: bool = True, mtp_targets: Optional[torch.Tensor] = None,
                with_hidden: bool = False):
        """tokens_BS (int64) -> logits_BSV (fp32; V/tp per rank under TP). position_ids [S]
        default 0..S-1 (context parallelism passes the global positions of its share).
        A chunk without pre_process takes hidden states x_BSH instead of tokens; one without
        post_process returns hidden states. `fp32_logits=False`: the logits as the head's GEMM
        made them (bf16 under bf16 autocast), for `loss`, which upcasts them itself (in one
        kernel with the log-softmax under train.compile). `mtp_targets` [B, S, 1 + D]
        (models/mtp.py) on the chunk holding the MTP depths: their loss is computed here and
        added by the next `loss` call. `with_hidden` (post_process): (logits, the last block's
        output), the input of MTP depths held elsewhere (models/mtp_chunk.py)."""
        x_BSH, cos_SD, sin_SD = self.embed(tokens_BS, position_ids)
        for j, layer in enumerate(self.layers.values()):
            if j < self.num_recomputed:
                x_BSH = recomputed(layer, x_BSH, cos_SD, sin_SD, replaying=[layer.mlp])
            else:
                x_BSH = layer(x_BSH, cos_SD, sin_SD)
        if not self.post_process:
            return x_BSH
        if self.mtp is not None and mtp_targets is not None:
            self.run_mtp(x_BSH, mtp_targets, cos_SD, sin_SD)
        logits = self.head(x_BSH, fp32_logits)
        return (logits, x_BSH) if with_hidden else logits

    def run_mtp(self, x_BSH: torch.Tensor, mtp_targets: torch.Tensor, cos_SD, sin_SD) -> None:
        """The MTP depths on the last block's output: their loss, added by the next `loss`."""
        # The lookup without the embedding module's hooks: the depths declare the read
        # (foreign_reads), and a ZeRO-3 depth unit holds the embedding around it.
        self._pending_mtp_loss = mtp_loss(self.mtp, x_BSH, mtp_targets, cos_SD, sin_SD,
                                          embed=self.embedding.forward, project=self.project, tp=self.tp,
                                          seq_length=self.cfg.seq_length)

    def embed(self, tokens_BS: torch.Tensor, position_ids: Optional[torch.Tensor] = None):
        """The forward up to the first block: (x_BSH, cos_SD, sin_SD). Tokens are embedded on
        the chunk that embeds; another chunk passes its hidden states through."""
        S = tokens_BS.shape[1] if self.pre_process else None
        if position_ids is None:
            if S is None:
                raise ValueError("a pipeline chunk without the embedding needs position_ids")
            position_ids = torch.arange(S, device=tokens_BS.device)
        x_BSH = self.embedding(tokens_BS) if self.pre_process else tokens_BS
        # The tables of the last positions tensor seen: a caller handing the same tensor to every
        # microbatch (the Trainer's split) gets them made once (~15 operators each time).
        held = self._rope_tables
        if held is None or held[0] is not position_ids or held[1] != x_BSH.dtype:
            cos_SD, sin_SD = rope_cos_sin(position_ids, rope_dim(self.cfg), self.cfg.rope_base,
                                          rope_scaling_of(self.cfg))
            held = self._rope_tables = (position_ids, x_BSH.dtype, cos_SD.to(x_BSH.dtype), sin_SD.to(x_BSH.dtype))
        return x_BSH, held[2], held[3]

    def head(self, x_BSH: torch.Tensor, fp32_logits: bool = True) -> torch.Tensor:
        """The forward after the last block: final norm and output layer -> logits_BSV (fp32,
        or as the GEMM made them with fp32_logits=False)."""
        logits_BSV = self.project(self.final_norm(x_BSH))
        return logits_BSV.float() if fp32_logits else logits_BSV

    def project(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """The output head alone (tied or not): normed hidden states -> logits as the GEMM made them."""
        if self.output is None:
            return layers.tied_head(x_BSH, self.embedding, self.tp)
        return self.output(x_BSH)

    def loss(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Mean token cross entropy over B*S tokens, in fp32 from logits of any float dtype
        (vocab-parallel under TP; train.compile: the compiled `loss` region on one TP rank).
        With MTP targets [B, S, 1 + D] (models/mtp.py): the LM loss on column 0 plus
        model.mtp_loss_scale times the MTP loss the forward computed; `last_loss_parts` keeps
        both, detached, for the metrics."""
        if targets_BS.dim() == 2:
            return layers.token_loss(logits_BSV, targets_BS, self.tp, self.loss_math)
        main = layers.token_loss(logits_BSV, targets_BS[..., 0], self.tp, self.loss_math)
        extra, self._pending_mtp_loss = self._pending_mtp_loss, None
        if extra is None:
            raise RuntimeError("MTP targets reached loss() without an MTP forward: pass mtp_targets to the forward")
        self.last_loss_parts = (main.detach(), extra.detach())
        return main + float(self.cfg.mtp_loss_scale) * extra

    def foreign_reads(self) -> list:
        """[(module, parameters)]: the parameters a module's forward reads although another
        module owns them. The tied head (from the final norm on) reads `embedding.weight`
        without calling the embedding: whatever waits a parameter's gather before its module
        runs (ZeRO's param all-gather, FSDP units) must also wait it before the head. So does
        each MTP depth, which looks its input tokens up in the embedding."""
        out = []
        if self.post_process and self.output is None and self.embedding is not None:
            out.append((self.final_norm, list(self.embedding.parameters())))
        if self.mtp is not None:
            out += [(depth, list(self.embedding.parameters())) for depth in self.mtp.values()]
        return out

    def moe_layers(self) -> list:
        """This model's (or chunk's) MoE layers, in layer order."""
        blocks = [*self.layers.values(), *([d.block for d in self.mtp.values()] if self.mtp is not None else [])]
        return [b.mlp for b in blocks if not isinstance(b.mlp, MLP)]

    def sequence_parallel_params(self) -> list:
        """Parameters replicated over TP whose gradients are partial on each TP rank: they need
        a sum over the TP group. Under sequence parallelism every replicated one (norms: each
        rank saw S/tp positions); without it the q/k norms of model.qk_norm (each rank saw its
        own heads). MLA's replicated down-projections and norms get complete gradients
        without SP (models/mla.py)."""
        if self.tp is None:
            return []
        if not self.tp["sequence_parallel"]:
            blocks = [*self.layers.values(), *([d.block for d in self.mtp.values()] if self.mtp is not None else [])]
            return [p for b in blocks if getattr(b.attn, "q_norm", None) is not None
                    for p in (*b.attn.q_norm.parameters(), *b.attn.k_norm.parameters())]
        return [p for p in self.parameters() if not getattr(p, "tensor_model_parallel", False)]


def num_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (a tied head is counted once)."""
    return sum(p.numel() for p in model.parameters())
