"""Capacity-padded all-to-all dispatch: with a capacity C (model.moe_capacity_factor) at ep > 1,
every expert's queue on every rank is padded to C rows, so the exchanges' sizes are known on the
host and the MoE layer reads nothing from the device (Megatron's pad-to-capacity).

The layer's `overlap.ep_chunks` n split the queue POSITIONS, not the tokens: chunk i sends rows
[i c, (i + 1) c) of every expert's queue (c = ceil(C / n), C' = n c), E c rows, L c to each rank
(L local experts of R ranks). Padding rows are zero rows of the tokens' table: an expert maps a
zero row to zero (no biases; gelu(0) = silu(0) = 0) and no slot reads a padding row's output, so
padding adds nothing to any output or gradient. `PaddedQueues` is the all-to-all dispatcher's
exchange strategy for this case (moe/dispatcher.py chooses it once, at construction; the uneven
exchange sized by exchanged counts is `CountedQueues` there); it is built from these pieces:

    capacity_chunks(x [T, H], router output, n, E, L, R) -> [PaddedChunk] * n
    to_experts(received [R L c, H])   -> [L R c, H] grouped by local expert (fixed transpose)
    to_senders(expert out [L R c, H]) -> [R L c, H] (the combine exchange's input)
    assemble_padded(outputs [E c, H] * n, chunks, E) -> y [T, H]: each slot's row from the table
        [E, C', H], each token's k slots folded with its router weights as `permute.unpermute` does
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch


@dataclass
class PaddedChunk:
    """One chunk of a capacity-padded dispatch: every expert's queue positions
    [index * width, (index + 1) * width), padding as zero rows."""
    index: int
    width: int  # queue positions per chunk (c)
    x_ext: torch.Tensor  # [T + 1, H] the tokens and one zero row (row T), shared by the chunks
    src: torch.Tensor  # [E * c] long: the x_ext row each sent row holds (T: padding)
    in_splits: List[int]  # [R] L * c rows to every rank
    out_splits: List[int]  # [R] L * c rows from every rank
    device_counts: torch.Tensor  # [L] R * c rows per local expert (padding included)
    row_of_slot: torch.Tensor  # [T * k] long: a slot's row in the assembled [E * C', H] (E * C': none)
    weights: torch.Tensor  # [T, k] the router weights (0 where dropped)


def capacity_chunks(x_TH: torch.Tensor, r, num_chunks: int, num_experts: int, num_local: int,
                    ranks: int) -> List[PaddedChunk]:
    """The n chunks of one dispatch (router output `r` with its capacity and each kept slot's
    queue position); n = min(num_chunks, C). Device index arithmetic only, no host read."""
    T, k = r.expert_ids.shape
    E, L, R, C = num_experts, num_local, ranks, int(r.capacity)
    n = max(1, min(num_chunks, C))
    c = -(-C // n)
    ids, pos = r.expert_ids.reshape(-1), r.positions.reshape(-1)
    dev = ids.device
    slots = torch.arange(T * k, device=dev)
    kept = ids >= 0
    # each kept slot's row in the table; a dropped slot gets a row of its own past the table, so
    # every row below has one writer
    row = torch.where(kept, ids.clamp_min(0) * (n * c) + pos, E * n * c + slots)
    token_of_row = torch.full((E * n * c + T * k,), T, dtype=torch.long, device=dev)
    token_of_row.index_copy_(0, row, slots // k)
    by_chunk = token_of_row[:E * n * c].view(E, n, c)
    x_ext = torch.cat([x_TH, x_TH.new_zeros((1, x_TH.shape[1]))])
    splits = [L * c] * R
    counts = torch.full((L,), R * c, dtype=torch.long, device=dev)
    row_of_slot = torch.where(kept, row, torch.full_like(row, E * n * c))  # dropped: the zero row
    return [PaddedChunk(i, c, x_ext, by_chunk[:, i].reshape(-1), splits, splits, counts, row_of_slot, r.weights)
            for i in range(n)]


def to_experts(recv_NH: torch.Tensor, chunk: PaddedChunk, ranks: int, num_local: int) -> torch.Tensor:
    """Received rows [src rank][local expert][c] -> [local expert][src rank][c]."""
    return recv_NH.view(ranks, num_local, chunk.width, -1).transpose(0, 1).reshape(ranks * num_local * chunk.width, -1)


def to_senders(out_NH: torch.Tensor, chunk: PaddedChunk, ranks: int, num_local: int) -> torch.Tensor:
    """Expert outputs [local expert][src rank][c] -> [src rank][local expert][c]."""
    return out_NH.view(num_local, ranks, chunk.width, -1).transpose(0, 1).reshape(ranks * num_local * chunk.width, -1)


def assemble_padded(outputs: List[torch.Tensor], chunks: List[PaddedChunk], num_experts: int) -> torch.Tensor:
    """The chunks' combined rows [E * c, H] -> y [T, H]."""
    E, c, w = num_experts, chunks[0].width, chunks[0].weights
    table = torch.stack([o.view(E, c, -1) for o in outputs], dim=1).view(E * len(outputs) * c, -1)
    table = torch.cat([table, table.new_zeros((1, table.shape[1]))])
    slots = table.index_select(0, chunks[0].row_of_slot).view(w.shape[0], w.shape[1], -1)
    return (slots * w.to(slots.dtype).unsqueeze(-1)).sum(dim=1)


class PaddedQueues:
    """The all-to-all with every expert's queue padded to the capacity (fixed sizes, no host
    read): the layer hands it one part of all T tokens, cut into chunks of queue positions.
    The exchange context of a chunk is {"chunk": PaddedChunk, "in_splits", "out_splits"}."""

    def __init__(self, num_experts: int, num_local: int, ranks: int) -> None:
        self.num_experts, self.num_local, self.ranks = num_experts, num_local, ranks

    def token_chunks(self, num_chunks: int, num_tokens: int) -> int:
        """One part of all the tokens: the chunks split the queue positions instead."""
        return 1

    def chunk_counts(self, parts, r, num_chunks: int, known=None) -> Tuple[list, List[PaddedChunk]]:
        """(the part once per chunk, each chunk's PaddedChunk): nothing exchanged, nothing read."""
        chunks = capacity_chunks(parts[0][0], r, num_chunks, self.num_experts, self.num_local, self.ranks)
        return parts * len(chunks), chunks

    def sort_for_dispatch(self, x_TH, expert_ids_Tk, weights_Tk, chunk: PaddedChunk):
        """-> (the rows this chunk sends [E * c, H] by expert, padding included, ctx)."""
        x_perm = chunk.x_ext.index_select(0, chunk.src)
        return x_perm, dict(chunk=chunk, in_splits=chunk.in_splits, out_splits=chunk.out_splits)

    def received_to_experts(self, recv_NH, ctx):
        """[src rank][local expert][c] -> ([local expert][src rank][c], R * c rows per expert)."""
        chunk = ctx["chunk"]
        return to_experts(recv_NH, chunk, self.ranks, self.num_local), chunk.device_counts

    def experts_to_send(self, expert_out_NH, ctx):
        return to_senders(expert_out_NH, ctx["chunk"], self.ranks, self.num_local)

    def combined_tokens(self, out_NH, ctx):
        """This chunk's combined rows [E * c, H], as they are: `assemble` folds them in."""
        return out_NH

    def assemble(self, outputs: List[torch.Tensor], chunks: List[PaddedChunk]) -> torch.Tensor:
        return assemble_padded(outputs, chunks, self.num_experts)
