"""This rank's local experts (SwiGLU or GeLU MLPs): stacked weights run by grouped GEMMs
(`GroupedExperts`, model.moe_grouped_gemm=true, the default) or one module per expert
(`Experts`, model.moe_grouped_gemm=false: a Python loop over the experts, kept as the
reference the grouped path is tested against).

Each local expert l holds global expert g = first_expert_index + l and is initialised from
its global name, so placement over ep never changes a weight:
    swiglu: f"{name_prefix}.experts.{g}.gate_up.weight" [2F, H], ".down.weight" [H, F]
    gelu:   f"{name_prefix}.experts.{g}.up.weight"      [F, H],  ".down.weight" [H, F]
forward(x [N, H] grouped by local expert, counts [L]) -> [N, H] in the same order.

GroupedExperts holds the same per-expert tensors stacked, w_in [L, 2F, H] (gelu [L, F, H]) and
w_out [L, H, F]; each stacked parameter lists its experts' names above in `expert_names`, so
checkpoints, resharding and the Hugging Face import see the per-expert names and layouts
(`per_expert_tensors`, checkpoint/train_state.py): a checkpoint of either path loads into either.
With etp > 1 each rank holds F/etp of every local expert's hidden units and its output is a
partial sum over the etp group (see expert_tp.py).
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from mpoverlap.models.init import init_tensor
from mpoverlap.moe.grouped import grouped_mlp
from mpoverlap.precision import compute_dtype
from mpoverlap.tensor_parallel.layers import shard_tensor
from mpoverlap.wgrad.functions import Linear

ACTIVATIONS = ("swiglu", "gelu")


class ExpertMLP(nn.Module):
    """One expert: swiglu down(silu(gate) * up) or gelu down(gelu(up)). x [N, H] -> [N, H].
    Its parameters are marked `expert_parallel` (reduced over the expert-data-parallel group,
    their squares summed over the expert-parallel group in the gradient norm)."""

    def __init__(self, hidden: int, ffn: int, *, global_index: int, name_prefix: str, cfg, seed: int,
                 activation: str, etp_rank: int = 0, etp_size: int = 1) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}; one of {ACTIVATIONS}")
        self.global_index, self.activation = global_index, activation
        base = f"{name_prefix}.experts.{global_index}"
        first = "gate_up" if activation == "swiglu" else "up"
        width = 2 * ffn if activation == "swiglu" else ffn
        self.name_in = f"{base}.{first}.weight"
        self.name_out = f"{base}.down.weight"
        # Submodule names make the parameter paths equal the init names, so a model that
        # re-initialises every parameter by its path draws the same expert weights.
        # Expert tensor parallelism (etp > 1): the full weights are drawn from the seed, then
        # rank etp_rank keeps its rows of w_in (per block: [gate_r | up_r]) and its columns of
        # w_out, as ColumnParallelLinear / RowParallelLinear slice theirs.
        if ffn % etp_size:
            raise ValueError(f"expert ffn={ffn} is not divisible by etp={etp_size}")
        blocks = 2 if activation == "swiglu" else 1
        # nn.Linear whose weight gradient a zero-bubble pipeline can defer (mpoverlap/wgrad)
        setattr(self, first, Linear(hidden, width // etp_size, bias=False))
        self.down = Linear(ffn // etp_size, hidden, bias=False)
        with torch.no_grad():
            self.w_in.copy_(shard_tensor(init_tensor(self.name_in, (width, hidden), cfg, seed), 0, etp_rank,
                                         etp_size, blocks))
            self.w_out.copy_(shard_tensor(init_tensor(self.name_out, (hidden, ffn), cfg, seed), 1, etp_rank,
                                          etp_size))
        for p in self.parameters():
            p.expert_parallel = True
        if etp_size > 1:  # split over the tp group: checkpoints gather them like TP layers' weights
            for p, dim, b in ((self.w_in, 0, blocks), (self.w_out, 1, 1)):
                p.tensor_model_parallel, p.partition_dim, p.partition_blocks = True, dim, b

    @property
    def w_in(self) -> nn.Parameter:
        return (self.gate_up if self.activation == "swiglu" else self.up).weight

    @property
    def w_out(self) -> nn.Parameter:
        return self.down.weight

    def forward(self, x_NH: torch.Tensor) -> torch.Tensor:
        # Call the Linear modules rather than reading their weights: the distributed
        # optimizer waits a parameter's all-gather in a forward pre-hook of the module that
        # owns it, so a weight read without calling its module would race the gather on a GPU.
        # (F.linear without bias is the same matmul as x @ W.t().)
        h = (self.gate_up if self.activation == "swiglu" else self.up)(x_NH)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.down(h)


class Experts(nn.Module):
    """This rank's experts, keyed by GLOBAL index (`experts.<g>.*`), so checkpoints and
    initialisation do not depend on the expert-parallel layout."""

    def __init__(self, num_local_experts: int, hidden: int, ffn: int, *, first_expert_index: int,
                 name_prefix: str, cfg, seed: int, activation: str = "swiglu", etp_rank: int = 0,
                 etp_size: int = 1) -> None:
        super().__init__()
        self.first_expert_index = first_expert_index
        # Children named by global index: parameter paths `experts.<g>.<proj>.weight`.
        for l in range(num_local_experts):
            g = first_expert_index + l
            self.add_module(str(g), ExpertMLP(hidden, ffn, global_index=g, name_prefix=name_prefix,
                                              cfg=cfg, seed=seed, activation=activation,
                                              etp_rank=etp_rank, etp_size=etp_size))

    @property
    def local(self):
        """The local experts in order of global index."""
        return list(self.children())

    @property
    def num_local_experts(self) -> int:
        return len(self.local)

    def global_names(self):
        """{global parameter name: parameter} of the local experts (for checkpoints/buckets)."""
        out = {}
        for mlp in self.local:
            out[mlp.name_in], out[mlp.name_out] = mlp.w_in, mlp.w_out
        return out

    def global_grads(self):
        """{global parameter name: its gradient (None if none)} of the local experts."""
        return {n: p.grad for n, p in self.global_names().items()}

    def forward(self, x_NH: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        counts = [int(c) for c in counts]
        if len(counts) != len(self.local) or sum(counts) != x_NH.shape[0]:
            raise ValueError(f"counts {counts} do not match {len(self.local)} experts / {x_NH.shape[0]} rows")
        outs = [mlp(part) for mlp, part in zip(self.local, torch.split(x_NH, counts, dim=0))]
        return torch.cat(outs, dim=0) if outs else x_NH


def _expert_weights(hidden: int, ffn: int, global_index: int, name_prefix: str, cfg, seed: int, activation: str,
                    etp_rank: int, etp_size: int):
    """(name_in, w_in [W/etp, H], name_out, w_out [H, F/etp]) of one expert, as ExpertMLP draws them."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}; one of {ACTIVATIONS}")
    if ffn % etp_size:
        raise ValueError(f"expert ffn={ffn} is not divisible by etp={etp_size}")
    base = f"{name_prefix}.experts.{global_index}"
    swiglu = activation == "swiglu"
    name_in, name_out = f"{base}.{'gate_up' if swiglu else 'up'}.weight", f"{base}.down.weight"
    width = 2 * ffn if swiglu else ffn
    w_in = shard_tensor(init_tensor(name_in, (width, hidden), cfg, seed), 0, etp_rank, etp_size, 2 if swiglu else 1)
    w_out = shard_tensor(init_tensor(name_out, (hidden, ffn), cfg, seed), 1, etp_rank, etp_size)
    return name_in, w_in, name_out, w_out


class GroupedExperts(nn.Module):
    """This rank's L experts as two stacked parameters, computed by grouped GEMMs
    (moe/grouped.py): w_in [L, W/etp, H], w_out [L, H, F/etp], expert l = global expert
    first_expert_index + l, each slice drawn and etp-sliced exactly as ExpertMLP's weights.

    Parameter attributes: `expert_parallel` (as ExpertMLP's); `expert_names` (the per-expert
    layout-free names of the slices, for checkpoints and imports); with etp > 1
    `tensor_model_parallel`, `partition_dim` (1 for w_in, 2 for w_out: the per-expert dim + 1)
    and `partition_blocks`, as a stack of the per-expert partitions.

    forward(x [N, H] grouped by local expert, counts [L] rows per expert: a device tensor, or
    host ints) -> [N, H]. With `padded` (a capacity factor may drop slots) rows past the last
    expert's are dropped slots: zeros out, zero gradient. Its weight gradients are deferrable
    by a zero-bubble pipeline (`wgrad`, set by attach_deferral)."""

    wgrad = None
    defers_weight_grad = True  # attach_deferral hands it the deferral
    # train.precision=fp8: the recipe (set by the FP8 marking of the model's GEMMs; None: not
    # FP8). The experts run torchao's one grouped recipe, rowwise, under either recipe
    # (precision/fp8_grouped.py); `fp8_emulate` runs its fp32 reference instead.
    fp8_recipe = None
    fp8_emulate = False

    def __init__(self, num_local_experts: int, hidden: int, ffn: int, *, first_expert_index: int,
                 name_prefix: str, cfg, seed: int, activation: str = "swiglu", etp_rank: int = 0,
                 etp_size: int = 1, padded: bool = False) -> None:
        super().__init__()
        self.first_expert_index, self.activation, self.padded = first_expert_index, activation, padded
        drawn = [_expert_weights(hidden, ffn, first_expert_index + l, name_prefix, cfg, seed, activation,
                                 etp_rank, etp_size) for l in range(num_local_experts)]  # init only
        self.w_in = nn.Parameter(torch.stack([d[1] for d in drawn]))
        self.w_out = nn.Parameter(torch.stack([d[3] for d in drawn]))
        self.w_in.expert_names = tuple(d[0] for d in drawn)
        self.w_out.expert_names = tuple(d[2] for d in drawn)
        for p in (self.w_in, self.w_out):
            p.expert_parallel = True
        if etp_size > 1:  # split over the tp group: checkpoints gather them like TP layers' weights
            blocks = 2 if activation == "swiglu" else 1
            for p, dim, b in ((self.w_in, 1, blocks), (self.w_out, 2, 1)):
                p.tensor_model_parallel, p.partition_dim, p.partition_blocks = True, dim, b
        # state_dict() / load_state_dict() in the per-expert modules' names ("<g>.gate_up.weight"
        # under this module): torch-format weights of either path load into the other.
        self._per_expert_keys = {attr: [n.split(".experts.", 1)[1] for n in getattr(self, attr).expert_names]
                                 for attr in ("w_in", "w_out")}
        self.register_state_dict_post_hook(_state_dict_per_expert)
        self.register_load_state_dict_pre_hook(_load_per_expert)

    @property
    def num_local_experts(self) -> int:
        return self.w_in.shape[0]

    def global_names(self) -> Dict[str, torch.Tensor]:
        """{global parameter name: that expert's slice (a view)} of the local experts."""
        return per_expert_tensors({"w_in": self.w_in, "w_out": self.w_out})

    def global_grads(self) -> Dict[str, torch.Tensor]:
        """{global parameter name: that expert's gradient slice (None if no gradient)}."""
        out = {}
        for p in (self.w_in, self.w_out):
            out.update({n: (None if p.grad is None else p.grad[l]) for l, n in enumerate(p.expert_names)})
        return out

    def forward(self, x_NH: torch.Tensor, counts) -> torch.Tensor:
        if not isinstance(counts, torch.Tensor):
            counts = torch.tensor(list(counts), dtype=torch.long).to(x_NH.device, non_blocking=True)
        if counts.shape != (self.num_local_experts,):
            raise ValueError(f"counts of shape {tuple(counts.shape)} do not match {self.num_local_experts} experts")
        # The module's own forward reads its parameters: the distributed optimizer's forward
        # pre-hook on this module waits their all-gather first.
        return grouped_mlp(x_NH, self.w_in, self.w_out, counts, activation=self.activation, padded=self.padded,
                           deferral=self.wgrad, fp8=self._fp8_products(x_NH))

    def _fp8_products(self, x_NH: torch.Tensor):
        """The FP8 grouped products under `fp8_recipe` (None: not FP8): bf16 out on CUDA, as the
        kernel's; elsewhere in the compute dtype."""
        if self.fp8_recipe is None:
            return None
        from mpoverlap.precision.fp8 import RECIPES
        from mpoverlap.precision.fp8_grouped import ALIGN, Fp8Grouped  # torchao: the optional fp8 extra
        if self.fp8_recipe not in RECIPES:
            raise ValueError(f"train.fp8_recipe={self.fp8_recipe}: not a recipe; use one of {', '.join(RECIPES)}, "
                             "e.g. train.fp8_recipe=rowwise")
        hidden, ffn = self.w_in.shape[2], self.w_out.shape[2]
        if hidden % ALIGN or ffn % ALIGN:
            # torch._scaled_grouped_mm's rule on every GEMM dimension but the grouped one; refused
            # on every device, so a layout that trains on CPU trains on a GPU
            etp = " per parallel.etp rank" if getattr(self.w_out, "tensor_model_parallel", False) else ""
            raise ValueError(f"model.hidden_size={hidden}, the expert width{etp} {ffn} (model.moe_ffn_hidden_size): "
                             f"the FP8 grouped experts need both multiples of {ALIGN} (torch._scaled_grouped_mm); "
                             f"fix: model.moe_ffn_hidden_size={-(-ffn // ALIGN) * ALIGN} (times parallel.etp), or "
                             "train.precision=bf16")
        dtype = torch.bfloat16 if x_NH.device.type == "cuda" else compute_dtype(x_NH)
        return Fp8Grouped(out_dtype=dtype, emulate=self.fp8_emulate)


def per_expert_tensors(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """{name: tensor} with every stacked expert parameter (one carrying `expert_names`) replaced
    by its experts' slices under their per-expert names, each slice a view carrying the
    per-expert partition attributes (partition_dim - 1); other entries unchanged."""
    out = {}
    for name, t in tensors.items():
        names = getattr(t, "expert_names", None)
        if names is None:
            out[name] = t
            continue
        for l, n in enumerate(names):
            view = t.detach()[l]
            if getattr(t, "tensor_model_parallel", False):
                view.tensor_model_parallel, view.partition_dim = True, t.partition_dim - 1
                view.partition_blocks = t.partition_blocks
            out[n] = view
    return out


def _state_dict_per_expert(module: GroupedExperts, state_dict, prefix: str, local_metadata) -> None:
    for attr, keys in module._per_expert_keys.items():
        stacked = state_dict.pop(prefix + attr)
        for l, key in enumerate(keys):
            state_dict[prefix + key] = stacked[l]


def _load_per_expert(module: GroupedExperts, state_dict, prefix: str, *args) -> None:
    for attr, keys in module._per_expert_keys.items():
        if all(prefix + key in state_dict for key in keys):
            state_dict[prefix + attr] = torch.stack([state_dict.pop(prefix + key) for key in keys])
