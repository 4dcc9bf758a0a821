"""MoELayer: router -> chunked dispatch -> experts -> combine, with EP overlap.

forward(x [..., H]) -> (y [..., H], RouterOutput). The router runs once over all T tokens of
the microbatch (so its losses do not depend on chunking); tokens are then split into
`num_chunks` contiguous chunks, each dispatched, computed and combined on its own.

overlap=True (forward), with D = dispatch exchange, E = expert compute, C = combine exchange:
    issue D0; shared expert (while D0 is in flight);
    for i: issue D(i+1); wait D(i); E(i); issue C(i)   (C(i) is in flight while E(i+1) runs)
    wait C(0..n-1).
  Every chunk's token counts travel in ONE all_to_all before D0, waited at once (they size
  the token exchanges). The collective issue order (counts, D0, D1, C0, D2, C1, ...) is the
  same on every rank.
overlap=False: the same chunks and ops, each exchange waited right after it is issued; the
  math and its summation order are identical, so outputs and gradients are bitwise equal.

Backward: with overlap=True the reverse exchanges are asynchronous (see dispatcher.py), so
the reverse dispatch of chunk i+1 is in flight while the experts of chunk i run backward, and
the combine's reverse exchanges while the unpermute backward runs; overlap=False waits each
one inside its autograd node.

Auxiliary losses: with `aux_loss_scale` set (the model sets it; the trainer makes it
1 / microbatches), the router's load-balancing and z losses are attached to the output by an
identity autograd node whose backward feeds them the gradient `aux_loss_scale`: the losses
train the router on every pipeline stage without changing the language-model loss value.
Their raw values, dropped slots and routed slots are summed in `stats_since()` for metrics.

`trace` (a list, optional) receives (event, chunk) tuples in program order: "dispatch_issued",
"dispatch_waited", "compute", "combine_issued", "combine_waited", and ("shared", -1); in
backward, ("bwd_compute", i) when chunk i's experts start their backward and the
dispatcher's ("bwd_exchange_issued"/"bwd_exchange_waited", id) events.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn

from mpoverlap.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from mpoverlap.moe.experts import Experts, GroupedExperts
from mpoverlap.moe.expert_tp import ExpertTP, expert_tp
from mpoverlap.moe.router import TopKRouter
from mpoverlap.moe.sequence_shards import SequenceShards, sequence_shards


class _AttachAuxLoss(torch.autograd.Function):
    """y unchanged; backward also gives the scalar `aux` the gradient `scale`."""

    @staticmethod
    def forward(ctx, y, aux, scale: float):
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full((), ctx.scale, dtype=torch.float32), None


class _BackwardMark(torch.autograd.Function):
    """Identity; logs `event` when its backward runs (tests read the backward order)."""

    @staticmethod
    def forward(ctx, x, log, event):
        ctx.log, ctx.event = log, event
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log(ctx.event)
        return grad, None, None


# load_ratio / bias_updates: max load over mean load of each aux-loss-free bias update (see
# update_expert_bias), summed, and the number of updates.
STAT_KEYS = ("aux_loss", "z_loss", "dropped_slots", "routed_slots", "calls", "load_ratio", "bias_updates")


class MoELayer(nn.Module):
    def __init__(self, router: TopKRouter, experts: Experts, dispatcher, *, overlap: bool,
                 num_chunks: int = 2, shared_expert: Optional[nn.Module] = None,
                 expert_tp: Optional[ExpertTP] = None) -> None:
        super().__init__()
        if num_chunks < 1:
            raise ValueError(f"num_chunks={num_chunks} must be >= 1")
        if experts.num_local_experts != dispatcher.num_local or \
                experts.first_expert_index != dispatcher.first_expert:
            raise ValueError("experts and dispatcher disagree on this rank's expert range")
        self.router, self.experts, self.shared_expert = router, experts, shared_expert
        self.dispatcher, self.overlap, self.num_chunks = dispatcher, overlap, num_chunks
        self.expert_tp = expert_tp
        # Routed slots per expert (before drops) since the last bias update, summed over the
        # ranks sharing this rank's sequences; only with the aux-loss-free bias.
        self._load: Optional[torch.Tensor] = None
        self.aux_loss_scale: Optional[float] = None
        self._stats = dict.fromkeys(STAT_KEYS, 0.0)
        # Set while activation recomputation replays this layer's forward in backward: the
        # router statistics were recorded by the first forward already.
        self.recomputing = False

    def stats_since(self) -> dict:
        """Sums since the last call (training forwards only): raw aux_loss and z_loss summed
        over calls, dropped and routed slots, calls. Resets them. A host sync: log steps only."""
        out = {k: float(v) for k, v in self._stats.items()}
        self._stats = dict.fromkeys(STAT_KEYS, 0.0)
        return out

    def _record(self, r) -> None:
        st, k = self._stats, r.expert_ids.shape[1]
        st["aux_loss"] = st["aux_loss"] + r.stats["aux_loss"]
        st["z_loss"] = st["z_loss"] + r.stats["z_loss"]
        st["dropped_slots"] = st["dropped_slots"] + r.stats["dropped"]
        st["routed_slots"] += r.expert_ids.shape[0] * k
        st["calls"] += 1
        if self.router.expert_bias is not None:
            load = r.stats["load"]
            self._load = load if self._load is None else self._load + load

    def pending_load(self) -> torch.Tensor:
        """[E] slots routed to each expert since the last update (zeros when none), for the
        trainer's one all-reduce of every layer's loads."""
        if self._load is None:
            return self.router.expert_bias.new_zeros(self.router.num_experts)
        return self._load

    def discard_load(self) -> None:
        """Forget the loads of a step that was skipped (no update, no metric)."""
        self._load = None

    @torch.no_grad()
    def update_expert_bias(self, global_load_E: torch.Tensor) -> None:
        """Apply the aux-loss-free update from the step's GLOBAL loads and record the metric."""
        ratio = self.router.update_bias(global_load_E)
        self._load = None
        self._stats["load_ratio"] = self._stats["load_ratio"] + ratio
        self._stats["bias_updates"] += 1

    def route(self, x: torch.Tensor):
        """x [..., H] -> (x_own [T, H] for the shared expert, parts, r): the router over all T
        tokens (fp32 logits and losses, whatever the autocast state), the tokens in the compute
        dtype, gathered over the expert-tp group, split into `num_chunks` chunks
        parts = [(x [T_i, H], ids [T_i, k], weights [T_i, k])]."""
        xf = x.reshape(-1, x.shape[-1])
        r = self.router(xf)
        if torch.is_autocast_enabled(x.device.type):
            # Tokens travel (dispatch, combine) and experts compute in the compute dtype; the
            # norm before the layer returns fp32 under autocast, which would double the bytes.
            xf = xf.to(torch.get_autocast_dtype(x.device.type))
        x_own, ids, weights = xf, r.expert_ids, r.weights
        if self.expert_tp is not None:  # experts split over tp: run them on the tp group's tokens
            xf, ids, weights = self.expert_tp.gather(xf, ids, weights)
        T = xf.shape[0]
        # Capacity-padded dispatch (all-to-all at ep > 1 with a capacity): one part, the
        # dispatcher chunks the experts' queue positions instead (moe/padded.py).
        n = self.dispatcher.token_chunks(self.num_chunks, T)
        bounds = [i * T // n for i in range(n + 1)]  # host arithmetic: no tensor read
        return x_own, [(xf[a:b], ids[a:b], weights[a:b]) for a, b in zip(bounds, bounds[1:])], r

    def attaches_aux(self) -> bool:
        return self.aux_loss_scale is not None and torch.is_grad_enabled()

    def output(self, y: torch.Tensor, shared: Optional[torch.Tensor], aux: Optional[torch.Tensor],
               shape) -> torch.Tensor:
        """The combined tokens y [T', H] -> the layer's output [..., H]: summed over the expert-tp
        group, plus the shared expert's output, with the router losses `aux` attached."""
        if self.expert_tp is not None:  # partial sums over the expert-tp group -> own tokens
            y = self.expert_tp.reduce(y)
        if shared is not None:  # [B, S, H] (split over TP like the dense MLP) -> rows of y
            y = y + shared.reshape(y.shape)
        if aux is not None:
            y = _AttachAuxLoss.apply(y, aux, self.aux_loss_scale)
        return y.view(shape)

    def forward(self, x: torch.Tensor, trace: Optional[List] = None):
        shape = x.shape
        x_own, parts, r = self.route(x)
        log = trace.append if trace is not None else (lambda _e: None)
        d = self.dispatcher
        d.backward_trace = trace

        # Every chunk's token counts in one exchange and one host read (they size the token
        # exchanges and the experts' row blocks); nothing else in the layer reads the device.
        # With a capacity at ep > 1 the sizes are known on the host: no exchange, no read (the
        # one part is then handed to every chunk of queue positions).
        # One chunk of this rank's own tokens: the router counted its slots already.
        own = len(parts) == 1 and self.expert_tp is None
        parts, counts = d.chunk_counts(parts, r, self.num_chunks, r.stats["tokens_per_expert"] if own else None)

        def issue(i):
            pending = d.dispatch_start(*parts[i], counts=counts[i])
            log(("dispatch_issued", i))
            return pending

        def compute(i, pending):
            tokens, rows_per_expert, ctx = d.dispatch_finish(pending)
            log(("dispatch_waited", i))
            out = self.experts(tokens, rows_per_expert)
            if trace is not None and out.requires_grad:
                out = _BackwardMark.apply(out, log, ("bwd_compute", i))
            log(("compute", i))
            combine = d.combine_start(out, ctx)
            log(("combine_issued", i))
            return combine

        def finish(i, combine):
            y = d.combine_finish(combine)
            log(("combine_waited", i))
            return y

        shared = None
        ys = []
        if self.overlap:
            pending = [issue(0)]
            if self.shared_expert is not None:
                shared = self.shared_expert(x_own.view(shape))
                log(("shared", -1))
            combines = []
            for i in range(len(parts)):
                if i + 1 < len(parts):
                    pending.append(issue(i + 1))
                combines.append(compute(i, pending[i]))
                if self.recomputing:
                    # A replay (model.recompute=full) ends where torch's non-reentrant
                    # checkpoint has recomputed the region's last saved tensor: with the
                    # all-gather dispatcher that is the last chunk's unpermute, before its
                    # combine. Combines left in flight for later would be abandoned there,
                    # never waited: in a replay each one's handles are waited before the next
                    # chunk (only the handles: `finish` keeps its place, so the replay saves
                    # its tensors in the forward's order, as the checkpoint requires).
                    for handle in combines[i].handles:
                        if handle is not None:  # None: one rank's identity exchange
                            handle.wait()
            ys = [finish(i, c) for i, c in enumerate(combines)]
        else:
            if self.shared_expert is not None:
                shared = self.shared_expert(x_own.view(shape))
                log(("shared", -1))
            for i in range(len(parts)):
                ys.append(finish(i, compute(i, issue(i))))
        y = d.assemble(ys, counts)
        d.backward_trace = None
        if self.training and torch.is_grad_enabled() and not self.recomputing:  # training forwards, once
            self._record(r)
        return self.output(y, shared, r.aux_loss + r.z_loss if self.attaches_aux() else None, shape), r


def build_moe_layer(hidden: int, ffn: int, num_experts: int, top_k: int, *, name: str, cfg, seed: int,
                    ep_group, ep_size: int, ep_rank: int, overlap: bool, num_chunks: int = 2,
                    dispatcher: str = "alltoall", ledger=None, activation: str = "swiglu",
                    aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                    capacity_factor: Optional[float] = None,
                    shared_expert: Optional[nn.Module] = None,
                    shards: Optional[SequenceShards] = None, router_options: Optional[dict] = None,
                    expert_tp: Optional[ExpertTP] = None, grouped_gemm: bool = True,
                    capacity_padding: bool = True, dispatch_wire=None) -> MoELayer:
    """Router f"{name}.router.weight", experts f"{name}.experts.{g}.*", this rank's experts
    [ep_rank * E/ep, (ep_rank + 1) * E/ep). `shards`: the ranks holding the other parts of
    this rank's sequences (SP, CP), over which the router's statistics are summed.
    `grouped_gemm` (model.moe_grouped_gemm): stacked experts run by grouped GEMMs, no host
    read at ep 1; False: one module per expert, a Python loop over host row counts.
    `capacity_padding`: with a capacity factor at ep > 1 (all-to-all dispatcher, grouped
    experts, etp 1), every expert's queue is padded to the capacity so no size is read on the
    host; False (forward/backward pairing, whose sub-steps chunk the tokens) keeps the exchanged
    counts and their one host read per layer and microbatch. `dispatch_wire`
    (moe/dispatch_wire.py; None: the compute dtype): the dispatch's forward token exchange's format."""
    kinds = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
    if dispatcher not in kinds:
        raise ValueError(f"dispatcher {dispatcher!r}; one of {sorted(kinds)}")
    pads = capacity_padding and capacity_factor is not None and dispatcher == "alltoall" and expert_tp is None
    disp = kinds[dispatcher](ep_group, ep_size, ep_rank, num_experts, overlap, ledger, host_counts=not grouped_gemm,
                             capacity_padding=pads, dispatch_wire=dispatch_wire)
    router = TopKRouter(hidden, num_experts, top_k, name=f"{name}.router", cfg=cfg, seed=seed,
                        aux_loss_coeff=aux_loss_coeff, z_loss_coeff=z_loss_coeff,
                        capacity_factor=capacity_factor, shards=shards, random_stream=ep_rank,
                        **(router_options or {}))
    etp = dict(etp_rank=expert_tp.rank if expert_tp else 0, etp_size=expert_tp.size if expert_tp else 1)
    if grouped_gemm:
        # Dropped slots travel as rows past the last expert's when nothing reads the counts.
        experts = GroupedExperts(disp.num_local, hidden, ffn, first_expert_index=disp.first_expert,
                                 name_prefix=name, cfg=cfg, seed=seed, activation=activation,
                                 padded=capacity_factor is not None and ep_size == 1 and not disp.reads_host, **etp)
    else:
        experts = Experts(disp.num_local, hidden, ffn, first_expert_index=disp.first_expert,
                          name_prefix=name, cfg=cfg, seed=seed, activation=activation, **etp)
    return MoELayer(router, experts, disp, overlap=overlap, num_chunks=num_chunks,
                    shared_expert=shared_expert, expert_tp=expert_tp)


def moe_kwargs(state, *, overlap: bool, num_chunks: int, ledger, sequence_parallel: bool = False,
               etp: int = 1, capacity_padding: bool = True, dispatch_wire=None) -> dict:
    """The expert-parallel context a model hands to its MoE layers (see models/layers.py)."""
    return {"ep_group": state.group("ep"), "ep_size": state.grid.ep, "ep_rank": state.coords.ep,
            "overlap": bool(overlap), "num_chunks": int(num_chunks), "ledger": ledger,
            "capacity_padding": bool(capacity_padding), "dispatch_wire": dispatch_wire,
            "shards": sequence_shards(state, sequence_parallel=sequence_parallel, ledger=ledger),
            "expert_tp": expert_tp(state, etp=etp, sequence_parallel=sequence_parallel, ledger=ledger)}
