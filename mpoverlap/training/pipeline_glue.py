"""How the GPT is cut into pipeline chunks and run forward-only for evaluation.

Model chunk k holds layers [k L / (pp vpp), (k+1) L / (pp vpp)); chunk 0 owns the embedding,
chunk pp vpp - 1 the final norm, head and loss, and with MTP (model.mtp_num_layers) the
depths. parallel.mtp_stage=s < pp-1 in a loop schedule (the "loop_mtp" layouts, `mtp_chunk_layout`)
moves the depths to a chunk of their own, pp vpp, on stage s (models/mtp_chunk.py, with copies
of the embedding and an untied output layer): the head chunk's forward sends its last block's
output there with its LM loss riding on it (`ride_loss`), and its backward receives that
output's gradient back. The schedule's chunk layout (pipeline/actions.py)
places chunk k on a stage: "loop" (k = vchunk * pp + stage, Megatron's interleaved
assignment) or zbv's "v" (stage s holds chunks s and 2pp-1-s). In the V stage 0 holds both the
embedding and the head: a tied head then reuses the embedding chunk's module (one parameter,
no copy on another stage, no embedding-group sum; `tie_spans_stages`).

Activations and their gradients cross stages in the residual stream's dtype, fp32 under
train.precision=bf16 too (autocast leaves the residual adds in fp32): the stream is rounded
nowhere a single process does not round it, so the curve does not depend on where the stages
are cut (docs/invariants.md, "The bf16 residual stream"). The cost: twice the pp bytes of a
bf16 p2p.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from mpoverlap.models.gpt import GPT
from mpoverlap.models.mtp_chunk import MTPChunk
from mpoverlap.pipeline.actions import (LOOP, chunk_index, is_loop_mtp, loop_mtp_layout, mtp_stage_of, stage_of,
                                        vchunk_of)

# The residual stream's dtype in every layout and precision (the fp32 master parameters').
RESIDUAL_DTYPE = torch.float32


def chunk_layer_ids(num_layers: int, pp: int, vpp: int, stage: int, vchunk: int,
                    layout: str = LOOP) -> List[int]:
    chunks = pp * vpp
    per = num_layers // chunks
    k = chunk_index(stage, vchunk, pp, layout)
    return list(range(k * per, (k + 1) * per))


def schedule_layout(parallel_cfg: Any, vpp: int, model_cfg: Any = None, pp: int = 1) -> str:
    """The chunk layout `parallel.pp_schedule` runs ("v" for zbv, else "loop"; with `model_cfg`
    and `pp`, a loop_mtp layout where the MTP depths are a chunk of their own, `mtp_chunk_layout`)."""
    from mpoverlap.pipeline import chunk_layout, resolve_schedule

    layout = chunk_layout(resolve_schedule(getattr(parallel_cfg, "pp_schedule", "auto"), vpp))
    if model_cfg is not None and mtp_chunk_layout(model_cfg, parallel_cfg, pp, layout):
        return loop_mtp_layout(int(parallel_cfg.mtp_stage), vpp)
    return layout


def mtp_chunk_layout(model_cfg: Any, parallel_cfg: Any, pp: int, layout: str) -> bool:
    """Whether the MTP depths are a chunk of their own: parallel.mtp_stage=s with 0 <= s < pp-1 in
    a loop layout at pp >= 2 (the head on the last stage; zbv's V holds the head on stage 0 already)."""
    return (layout == LOOP and pp > 1 and getattr(model_cfg, "mtp_num_layers", 0) > 0
            and 0 <= getattr(parallel_cfg, "mtp_stage", -1) < pp - 1)


def shares_embedding(model_cfg: Any) -> bool:
    """Whether the head's chunk reads the embedding: a tied head, or the MTP depths (models/mtp.py)."""
    return bool(model_cfg.tie_embeddings) or getattr(model_cfg, "mtp_num_layers", 0) > 0


def tie_spans_stages(model_cfg: Any, pp: int, layout: str) -> bool:
    """Whether the embedding has copies on two stages (first and last, summed over the
    embedding group): a tied head or MTP, pipelined in the loop layout; the V keeps both ends
    on stage 0. In a loop_mtp layout: a tied head (the head's and the depths' copies)."""
    if is_loop_mtp(layout):
        return bool(model_cfg.tie_embeddings)
    return shares_embedding(model_cfg) and pp > 1 and layout == LOOP


def pipeline_ties(model_cfg: Any, pp: int, layout: str) -> dict:
    """{layout-free name: the group kind (parallel/grid.py) its copies' gradients are summed
    over, or None for copies all on one stage} of the weights held more than once in the
    pipeline (each copy's gradient becomes the sum of all of theirs): the embedding where
    `tie_spans_stages`, over "embedding" (the first and the last stage); in the loop_mtp layout
    with the MTP chunk on stage 0 also the embedding beside its copy there (a sum on the stage)
    and an untied output layer, held by the head's stage and the MTP chunk (over "embedding").
    With the MTP chunk on a middle stage s the copies span other stages: a tied embedding
    stages {0, s, pp-1} ("mtp_tied"); untied, the embedding {0, s} ("mtp_embedding") and the
    output layer {s, pp-1} ("mtp_output")."""
    ties: dict = {}
    stage = mtp_stage_of(layout)
    if stage is not None and stage > 0:
        if model_cfg.tie_embeddings:
            return {"embedding.weight": "mtp_tied"}
        return {"embedding.weight": "mtp_embedding", "output.weight": "mtp_output"}
    if tie_spans_stages(model_cfg, pp, layout) or stage is not None:
        ties["embedding.weight"] = "embedding" if tie_spans_stages(model_cfg, pp, layout) else None
    if stage is not None and not model_cfg.tie_embeddings:
        ties["output.weight"] = "embedding"
    return ties


def build_chunks(cfg: Any, pp: int, vpp: int, stage: int, seed: int, layout: str = LOOP,
                 **gpt_kwargs) -> List[GPT]:
    """This stage's model chunks in vchunk order (loop_mtp: the MTP stage's last is the MTPChunk)."""
    last = pp * vpp - 1
    ks = [chunk_index(stage, v, pp, layout) for v in range(vpp)]
    chunks = [GPT(cfg, seed=seed, layer_ids=chunk_layer_ids(cfg.num_layers, pp, vpp, stage, v, layout),
                  pre_process=(k == 0), post_process=(k == last), with_mtp=not is_loop_mtp(layout), **gpt_kwargs)
              for v, k in zip(range(vpp), ks)]
    if stage == mtp_stage_of(layout):  # the MTP chunk pp * vpp, vchunk vpp
        chunks.append(MTPChunk(cfg, seed=seed, **gpt_kwargs))
    if shares_embedding(cfg) and 0 in ks and last in ks and len(chunks) > 1:
        # The V: the head chunk reads the embedding chunk's weight (GPT.foreign_reads), one
        # parameter whose gradient both chunks' W actions feed (PipelineExecutor.shared_params).
        chunks[ks.index(last)].embedding = chunks[ks.index(0)].embedding
    return chunks


class _RideLoss(torch.autograd.Function):
    """h_0 passed on unchanged, a scalar loss riding on it: the backward from h_0's gradient
    also backpropagates the loss with gradient 1, so the head chunk's B (driven by the MTP
    chunk's gradient) runs the LM loss's backward with it, like a middle chunk's."""

    @staticmethod
    def forward(ctx, h_BSH: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype = loss.dtype
        return h_BSH.clone()

    @staticmethod
    def backward(ctx, grad_BSH: torch.Tensor):
        return grad_BSH, torch.ones((), dtype=ctx.loss_dtype, device=grad_BSH.device)


def ride_loss(h_BSH: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """h_BSH with `loss` riding on it (_RideLoss)."""
    return _RideLoss.apply(h_BSH, loss)


def shared_parameters(chunks: List[GPT]) -> List[torch.nn.Parameter]:
    """Parameters held by more than one of this stage's chunks (the V's tied embedding)."""
    seen: dict = {}
    for chunk in chunks:
        for p in {id(p): p for p in chunk.parameters()}.values():
            seen.setdefault(id(p), [p, 0])[1] += 1
    return [p for p, count in seen.values() if count > 1]


@torch.no_grad()
def forward_only(chunks: List[GPT], stage: int, pp_ranks: List[int], num_microbatches: int,
                 run_chunk: Callable[[int, int, Optional[torch.Tensor]], torch.Tensor],
                 hidden_shape: tuple, dtype: torch.dtype, device: torch.device,
                 pp_group: Any = None, layout: str = LOOP) -> List[torch.Tensor]:
    """Evaluation through the pipeline, one microbatch at a time, model chunk by model chunk
    (blocking p2p in a chain: no schedule needed, no overlap wanted). `run_chunk(vchunk, mb,
    hidden_or_None)` returns the chunk's output (the loss on the last chunk). Returns the
    losses on the last stage, [] elsewhere. The p2p runs on `pp_group` (ranks are global):
    on NCCL a send/recv on the default group would set up extra communicators. Consecutive
    chunks on one stage (the V's turn) hand the hidden state over in memory."""
    pp = len(pp_ranks)
    total = pp * len(chunks)
    losses = []
    for mb in range(num_microbatches):
        out = None
        for k in range(total):
            if stage_of(k, pp, layout) != stage:
                continue
            hidden = None
            if k > 0:
                src = stage_of(k - 1, pp, layout)
                if src == stage:
                    hidden = out
                else:
                    hidden = torch.empty(hidden_shape, dtype=dtype, device=device)
                    dist.recv(hidden, src=pp_ranks[src], group=pp_group)
            out = run_chunk(vchunk_of(k, pp, layout), mb, hidden)
            if k == total - 1:
                losses.append(out)
            elif stage_of(k + 1, pp, layout) != stage:
                dist.send(out.contiguous(), dst=pp_ranks[stage_of(k + 1, pp, layout)], group=pp_group)
    return losses


class PipelineRunner:
    """Runs one optimizer step's microbatches through this stage's chunks with the pipeline
    executor, and evaluation forward-only. `split(mb)` gives (tokens, targets, positions).
    With MTP, `mtp_loss_sum` holds the step's MTP loss on the stage of its depths (0 elsewhere),
    `main_loss_sum` the LM loss on the head's stage."""

    def __init__(self, chunks: List[GPT], state: Any, cfg: Any, num_microbatches: int, overlap: bool,
                 ledger: Any, ddp: Any, split: Callable, autocast: Any, pairing: bool = False) -> None:
        from mpoverlap.pipeline import PipelineExecutor, build_schedule, defers_weight_grads, resolve_schedule

        self.chunks, self.state, self.split, self.autocast = chunks, state, split, autocast
        # the main model's chunks (loop_mtp: the MTP chunk runs in training only)
        self.main_chunks = [c for c in chunks if not getattr(c, "is_mtp_chunk", False)]
        pp, vpp = state.grid.pp, len(self.main_chunks)
        self.stage = state.coords.pp
        m, p = cfg.model, cfg.parallel
        seq = m.seq_length // state.grid.cp
        if p.sequence_parallel and state.grid.tp > 1:
            seq //= state.grid.tp
        self.hidden_shape = (cfg.train.micro_batch_size, seq, m.hidden_size)
        self.num_microbatches = num_microbatches
        self.schedule = resolve_schedule(cfg.parallel.pp_schedule, vpp)
        self.layout = schedule_layout(cfg.parallel, vpp, m, pp)
        self.mtp_depths, self.mtp_loss_scale = int(m.mtp_num_layers), float(m.mtp_loss_scale)
        # overlap.ep_pairing: the paired table (interleaved, zb1p at vpp >= 2, or the zbv V), every
        # chunk run as sub-step programs (rules ep_pairing.pp_needs_vpp / pp_needs_interleaved keep
        # the one-chunk tables off).
        tables = build_schedule(self.schedule, pp, vpp, num_microbatches, pairing=pairing,
                                mtp_chunk=is_loop_mtp(self.layout), mtp_stage=mtp_stage_of(self.layout) or 0)
        self.paired = None
        if pairing:
            from mpoverlap.pairing.pipeline import PairedChunks

            self.paired = PairedChunks(chunks, ddp, lambda mb: self.inputs[mb], num_microbatches, autocast)
        self.inputs: List[tuple] = []
        self.bubble_since_log = 0.0  # seconds this stage waited on receives (PipelineExecutor.bubble_s)
        # Zero-bubble schedules: the chunks' linears defer their weight gradients to the W
        # actions, and the data-parallel hooks learn which accumulate calls carry nothing.
        weight_grads = None
        if defers_weight_grads(self.schedule):
            from mpoverlap.wgrad import WeightGradDeferral, attach_deferral

            weight_grads = WeightGradDeferral()
            for chunk in chunks:
                attach_deferral(chunk, weight_grads)
            ddp.weight_grads = weight_grads
        self.executor = PipelineExecutor(
            tables[self.stage], stage=self.stage, pp_ranks=list(state.ranks("pp")), group=state.group("pp"),
            overlap=overlap, ledger=ledger, tensor_shape=self.hidden_shape, dtype=RESIDUAL_DTYPE,
            device=state.device, forward_step=self._forward_step,
            # A chunk's gradients are reduced over dp during its last backward (B or W) of the step.
            backward_hook=lambda vchunk, mb, is_last: ddp.set_last_microbatch(is_last),
            weight_grads=weight_grads, shared_params=shared_parameters(chunks), paired=self.paired)

    def _forward_step(self, vchunk: int, mb: int, hidden: Optional[torch.Tensor]) -> torch.Tensor:
        chunk = self.chunks[vchunk]
        tokens, targets, positions = self.inputs[mb]
        if getattr(chunk, "is_mtp_chunk", False):  # loop_mtp: the depths on h_0 from the head's stage
            with self.autocast:
                extra = chunk(hidden, positions, targets)
            self.mtp_loss_sum += extra.detach() / self.num_microbatches
            return extra * (self.mtp_loss_scale / self.num_microbatches)
        if chunk.post_process and is_loop_mtp(self.layout) and targets.dim() == 3 and torch.is_grad_enabled():
            # the head chunk sends h_0 on to the MTP chunk, its LM loss riding on it
            with self.autocast:
                logits, h_BSH = chunk(hidden, position_ids=positions, fp32_logits=False, with_hidden=True)
            loss = chunk.loss(logits, targets[..., 0]) / self.num_microbatches
            self.main_loss_sum += loss.detach()
            return ride_loss(h_BSH, loss)
        # MTP (targets [B, S, 1 + D]): its depths run in training forwards; evaluation is the LM loss
        mtp = chunk.mtp is not None and targets.dim() == 3 and torch.is_grad_enabled()
        if targets.dim() == 3 and not mtp:
            targets = targets[..., 0]
        with self.autocast:
            out = chunk(tokens if chunk.pre_process else hidden, position_ids=positions, fp32_logits=False,
                        **({"mtp_targets": targets} if mtp else {}))
        if chunk.post_process:
            loss = chunk.loss(out, targets) / self.num_microbatches
            if mtp:  # the LM loss reported, the MTP loss apart (loss: their sum, for backward)
                main, extra = chunk.last_loss_parts
                self.main_loss_sum += main / self.num_microbatches
                self.mtp_loss_sum += extra / self.num_microbatches
            return loss
        return out  # the residual stream as it is (the executor checks its dtype)

    def train_microbatches(self, micro: List[torch.Tensor], trace: Optional[list] = None) -> torch.Tensor:
        """Forward and backward of every microbatch; returns this stage's summed loss (the
        global batch's mean on the last stage, 0 elsewhere). `trace`: the paired sub-steps'
        events (PairedChunks), when the table is paired."""
        self.inputs = [self.split(mb) for mb in micro]
        self.main_loss_sum = torch.zeros((), device=self.state.device)
        self.mtp_loss_sum = torch.zeros((), device=self.state.device)
        if self.paired is not None:  # the head chunk's sub-steps add both losses as _forward_step does
            self.paired.trace, self.paired.mtp_sums = trace, (self.main_loss_sum, self.mtp_loss_sum)
        losses = self.executor.run(len(micro))
        self.bubble_since_log += self.executor.bubble_s
        if self.mtp_depths:
            return self.main_loss_sum
        total = torch.zeros((), device=self.state.device)
        for loss in losses:
            total += loss.detach()
        return total

    def take_bubble(self, steps: int) -> float:
        """This stage's mean bubble per step since the last call (seconds)."""
        value, self.bubble_since_log = self.bubble_since_log / max(1, steps), 0.0
        return value

    @torch.no_grad()
    def eval_microbatches(self, micro: List[torch.Tensor]) -> torch.Tensor:
        self.inputs = [self.split(mb) for mb in micro]
        n = len(micro)

        def run_chunk(vchunk: int, mb: int, hidden: Optional[torch.Tensor]) -> torch.Tensor:
            return self._forward_step(vchunk, mb, hidden) * self.num_microbatches / n

        losses = forward_only(self.main_chunks, self.stage, list(self.state.ranks("pp")), n, run_chunk,
                              self.hidden_shape, RESIDUAL_DTYPE, self.state.device, pp_group=self.state.group("pp"),
                              layout=self.layout)
        total = torch.zeros((), device=self.state.device)
        for loss in losses:
            total += loss
        return total
