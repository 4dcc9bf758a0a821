"""How the GPT is cut into pipeline chunks and run forward-only for evaluation.

Model chunk k (k = vchunk * pp + stage, Megatron's interleaved assignment) holds layers
[k L / (pp vpp), (k+1) L / (pp vpp)); chunk 0 owns the embedding, the last chunk the final
norm, head and loss.

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

# The residual stream's dtype in every layout and precision (the fp32 master parameters').
RESIDUAL_DTYPE = torch.float32


def chunk_layer_ids(num_layers: int, pp: int, vpp: int, stage: int, vchunk: int) -> List[int]:
    chunks = pp * vpp
    per = num_layers // chunks
    k = vchunk * pp + stage
    return list(range(k * per, (k + 1) * per))


def build_chunks(cfg: Any, pp: int, vpp: int, stage: int, seed: int, **gpt_kwargs) -> List[GPT]:
    """This stage's model chunks in vchunk order."""
    last = pp * vpp - 1
    return [GPT(cfg, seed=seed, layer_ids=chunk_layer_ids(cfg.num_layers, pp, vpp, stage, v),
                pre_process=(v * pp + stage == 0), post_process=(v * pp + stage == last), **gpt_kwargs)
            for v in range(vpp)]


@torch.no_grad()
def forward_only(chunks: List[GPT], stage: int, pp_ranks: List[int], num_microbatches: int,
                 run_chunk: Callable[[int, int, Optional[torch.Tensor]], torch.Tensor],
                 hidden_shape: tuple, dtype: torch.dtype, device: torch.device,
                 pp_group: Any = None) -> List[torch.Tensor]:
    """Evaluation through the pipeline, one microbatch at a time, model chunk by model chunk
    (blocking p2p in a chain: no schedule needed, no overlap wanted). `run_chunk(vchunk, mb,
    hidden_or_None)` returns the chunk's output (the loss on the last chunk). Returns the
    losses on the last stage, [] elsewhere. The p2p runs on `pp_group` (ranks are global):
    on NCCL a send/recv on the default group would set up extra communicators."""
    pp = len(pp_ranks)
    total = pp * len(chunks)
    losses = []
    for mb in range(num_microbatches):
        for k in range(total):
            if k % pp != stage:
                continue
            hidden = None
            if k > 0:
                hidden = torch.empty(hidden_shape, dtype=dtype, device=device)
                dist.recv(hidden, src=pp_ranks[(k - 1) % pp], group=pp_group)
            out = run_chunk(k // pp, mb, hidden)
            if k < total - 1:
                dist.send(out.contiguous(), dst=pp_ranks[(k + 1) % pp], group=pp_group)
            else:
                losses.append(out)
    return losses


class PipelineRunner:
    """Runs one optimizer step's microbatches through this stage's chunks with the pipeline
    executor, and evaluation forward-only. `split(mb)` gives (tokens, targets, positions)."""

    def __init__(self, chunks: List[GPT], state: Any, cfg: Any, num_microbatches: int, overlap: bool,
                 ledger: Any, ddp: Any, split: Callable, autocast: Any) -> None:
        from mpoverlap.pipeline import (PipelineExecutor, build_schedule, defers_weight_grads,
                                        resolve_schedule)

        self.chunks, self.state, self.split, self.autocast = chunks, state, split, autocast
        pp, vpp = state.grid.pp, len(chunks)
        self.stage = state.coords.pp
        m, p = cfg.model, cfg.parallel
        seq = m.seq_length // state.grid.cp
        if p.sequence_parallel and state.grid.tp > 1:
            seq //= state.grid.tp
        self.hidden_shape = (cfg.train.micro_batch_size, seq, m.hidden_size)
        self.num_microbatches = num_microbatches
        self.schedule = resolve_schedule(cfg.parallel.pp_schedule, vpp)
        tables = build_schedule(self.schedule, pp, vpp, num_microbatches)
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
            weight_grads=weight_grads)

    def _forward_step(self, vchunk: int, mb: int, hidden: Optional[torch.Tensor]) -> torch.Tensor:
        chunk = self.chunks[vchunk]
        tokens, targets, positions = self.inputs[mb]
        with self.autocast:
            out = chunk(tokens if chunk.pre_process else hidden, position_ids=positions)
        if chunk.post_process:
            return chunk.loss(out.float(), targets) / self.num_microbatches
        return out  # the residual stream as it is (the executor checks its dtype)

    def train_microbatches(self, micro: List[torch.Tensor]) -> torch.Tensor:
        """Forward and backward of every microbatch; returns this stage's summed loss (the
        global batch's mean on the last stage, 0 elsewhere)."""
        self.inputs = [self.split(mb) for mb in micro]
        losses = self.executor.run(len(micro))
        self.bubble_since_log += self.executor.bubble_s
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

        losses = forward_only(self.chunks, self.stage, list(self.state.ranks("pp")), n, run_chunk,
                              self.hidden_shape, RESIDUAL_DTYPE, self.state.device, pp_group=self.state.group("pp"))
        total = torch.zeros((), device=self.state.device)
        for loss in losses:
            total += loss
        return total
