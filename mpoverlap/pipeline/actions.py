"""The vocabulary of a pipeline schedule: messages, p2p ops and compute actions.

Model chunks are numbered along the model (chunk 0 reads data, chunk pp*vpp-1 computes the
loss) and placed on stages by a layout:

- "loop" (1F1B, interleaved, zb1p; Megatron's interleaved assignment): model chunk
  `c = vchunk * pp + stage`, so chunk c lives on stage `c % pp` as local vchunk `c // pp`.
- "loop_mtp" (the loop layouts with parallel.mtp_stage=0 where the head is on stage pp-1): the
  loop placement plus one terminal chunk N = pp*vpp holding the multi-token prediction depths,
  which the formula puts on stage 0 as local vchunk vpp. The head's chunk N-1 sends its last
  block's output there and receives its gradient back like any middle chunk.
  With parallel.mtp_stage=s on a middle stage (0 < s < pp-1) the layout value carries s and vpp
  ("loop_mtp:s:vpp", `loop_mtp_layout`): chunk N is local vchunk vpp of stage s, every other
  chunk where the loop formula puts it. The formula alone cannot say which chunk is N there
  (it would put pp*vpp on stage 0), hence vpp in the value.
- "v" (zbv, exactly two chunks per stage): stage s holds chunk s (vchunk 0) and chunk
  2pp-1-s (vchunk 1), so stage 0 holds the first and the last chunk, and the hand-over from
  chunk pp-1 to chunk pp stays on stage pp-1 (a "local" message: no p2p).

The forward of chunk c consumes the activation of chunk c-1 (same microbatch); the backward
of chunk c consumes the gradient sent back by chunk c+1.

Everything here is plain frozen data: tables can be built, printed, compared and checked
without any process group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

# F: forward; B: backward (the full backward, or with a W action of its own only the input
# gradient); W: the weight gradients the B of the same (microbatch, vchunk) deferred.
FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
ACTIVATION, GRADIENT = "act", "grad"
SEND, RECV = "send", "recv"


class ScheduleError(ValueError):
    """A schedule table is inconsistent (the message lists every problem found)."""


LOOP, LOOP_MTP, V_SHAPE = "loop", "loop_mtp", "v"
CHUNK_LAYOUTS = (LOOP, LOOP_MTP, V_SHAPE)


def loop_mtp_layout(stage: int, vpp: int) -> str:
    """The loop_mtp layout with the MTP chunk on `stage` (vpp main chunks per stage)."""
    return LOOP_MTP if stage == 0 else f"{LOOP_MTP}:{int(stage)}:{int(vpp)}"


def _middle_mtp(layout: str) -> Optional[Tuple[int, int]]:
    """(stage, vpp) of a loop_mtp layout whose MTP chunk is on a stage other than 0, else None."""
    if isinstance(layout, str) and layout.startswith(LOOP_MTP + ":"):
        _, stage, vpp = layout.split(":")
        return int(stage), int(vpp)
    return None


def mtp_stage_of(layout: str) -> Optional[int]:
    """The stage of a loop_mtp layout's MTP chunk; None for a layout without one."""
    if layout == LOOP_MTP:
        return 0
    middle = _middle_mtp(layout)
    return None if middle is None else middle[0]


def is_loop_mtp(layout: str) -> bool:
    """Whether `layout` is a loop_mtp layout (the MTP depths a model chunk of their own)."""
    return mtp_stage_of(layout) is not None


def num_model_chunks(pp: int, vpp: int, layout: str = LOOP) -> int:
    """Model chunks of a layout with `vpp` main chunks per stage (loop_mtp: one more, the MTP chunk)."""
    return pp * vpp + (1 if is_loop_mtp(layout) else 0)


def chunk_index(stage: int, vchunk: int, pp: int, layout: str = LOOP) -> int:
    """Model chunk index of local virtual chunk `vchunk` on `stage`."""
    if layout == V_SHAPE:
        return stage if vchunk == 0 else 2 * pp - 1 - stage
    middle = _middle_mtp(layout)
    if middle is not None and (stage, vchunk) == middle:
        return pp * vchunk
    return vchunk * pp + stage


def stage_of(chunk: int, pp: int, layout: str = LOOP) -> int:
    if layout == V_SHAPE:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    middle = _middle_mtp(layout)
    if middle is not None and chunk == pp * middle[1]:
        return middle[0]
    return chunk % pp


def vchunk_of(chunk: int, pp: int, layout: str = LOOP) -> int:
    if layout == V_SHAPE:
        return 0 if chunk < pp else 1
    return chunk // pp


def is_local(message: "Message", pp: int, layout: str = LOOP) -> bool:
    """Both ends of `message` on one stage (the V's turn at stage pp-1): handed over in memory."""
    return stage_of(message.src_chunk, pp, layout) == stage_of(message.dst_chunk, pp, layout)


def layout_of_tables(tables) -> str:
    """The chunk layout a set of per-stage action tables was built for (from their chunks):
    loop_mtp when a stage holds one vchunk more than the last stage (the MTP chunk), else loop
    or the V."""
    pp = len(tables)
    vpp = main_vpp(tables)
    layout = LOOP
    if pp > 1:
        extra = [stage for stage, t in enumerate(tables) if vpp < 1 + max((a.vchunk for a in t), default=-1)]
        if extra:
            layout = loop_mtp_layout(extra[0], vpp)
    if any(a.chunk != chunk_index(stage, a.vchunk, pp, layout) for stage, t in enumerate(tables) for a in t):
        return V_SHAPE
    return layout


def main_vpp(tables) -> int:
    """The main model chunks per stage of a set of tables (the last stage's vchunks: the MTP
    chunk of loop_mtp is on stage 0 only)."""
    return 1 + max((a.vchunk for a in tables[-1]), default=0)


@dataclass(frozen=True)
class Message:
    """One tensor crossing stages: the activation of `src_chunk` for `dst_chunk = src_chunk+1`
    (kind "act"), or the gradient of `dst_chunk`'s output sent back by `src_chunk = dst_chunk+1`
    (kind "grad"), for one microbatch. Identity of a transfer; both ends hold an equal copy."""

    kind: str
    microbatch: int
    src_chunk: int
    dst_chunk: int

    def __str__(self) -> str:
        return f"{self.kind}[mb{self.microbatch} c{self.src_chunk}->c{self.dst_chunk}]"


@dataclass(frozen=True)
class P2POp:
    """One half of a transfer as seen by one stage: `op` "send" or "recv", with `peer` stage."""

    op: str
    peer: int
    message: Message

    def __str__(self) -> str:
        return f"{self.op}{'->' if self.op == SEND else '<-'}s{self.peer}:{self.message}"


# Ops posted together as one batched send_recv call; all with the same peer, at most one recv.
Batch = Tuple[P2POp, ...]


@dataclass(frozen=True)
class Action:
    """One compute step of one stage, with the p2p posted around it.

    kind: "F", "B" or "W" (a W has no p2p: recv and send are None); microbatch; vchunk (local virtual chunk); chunk (model chunk index).
    recv: the message this compute consumes (None: data / the loss); from another stage, or
        from this stage itself (a local hand-over, zbv's turn: no p2p op is posted for it).
    send: the message it produces (None: the last / first model chunk), likewise.
    posts_before / posts_after: batches posted before / after this compute when p2p is not
        overlapped (each receive posted as late as the link order allows).
    prefetch_before / prefetch_after: the same ops for overlap=True, with each receive
        posted as early as the link order allows (at least one compute ahead where possible).
    Only a stage's first action has non-empty `*_before`; every later post follows a compute.
    paired: on an F only (overlap.ep_pairing, pipeline/paired.py): this forward and the next
        action, a backward of another (microbatch, vchunk), run as ONE overlapped "FB" action;
        both inputs are received before it, both outputs sent after it (this F posts nothing
        after itself: its `*_after` are empty, its send goes out after the B).
    """

    kind: str
    microbatch: int
    vchunk: int
    chunk: int
    recv: Optional[Message] = None
    send: Optional[Message] = None
    posts_before: Tuple[Batch, ...] = ()
    posts_after: Tuple[Batch, ...] = ()
    prefetch_before: Tuple[Batch, ...] = ()
    prefetch_after: Tuple[Batch, ...] = ()
    paired: bool = False

    def batches(self, prefetch: bool) -> Tuple[Tuple[Batch, ...], Tuple[Batch, ...]]:
        """(before, after) batches of the posting program for overlap on (prefetch) or off."""
        if prefetch:
            return self.prefetch_before, self.prefetch_after
        return self.posts_before, self.posts_after

    def __str__(self) -> str:
        return f"{self.kind}(mb{self.microbatch},v{self.vchunk})"


def input_message(kind: str, microbatch: int, chunk: int, num_chunks: int) -> Optional[Message]:
    """The message the compute (kind, microbatch, chunk) consumes, or None."""
    if kind == WEIGHT:
        return None
    if kind == FORWARD:
        return Message(ACTIVATION, microbatch, chunk - 1, chunk) if chunk > 0 else None
    return Message(GRADIENT, microbatch, chunk + 1, chunk) if chunk < num_chunks - 1 else None


def output_message(kind: str, microbatch: int, chunk: int, num_chunks: int) -> Optional[Message]:
    """The message the compute (kind, microbatch, chunk) produces, or None."""
    if kind == WEIGHT:
        return None
    if kind == FORWARD:
        return Message(ACTIVATION, microbatch, chunk, chunk + 1) if chunk < num_chunks - 1 else None
    return Message(GRADIENT, microbatch, chunk, chunk - 1) if chunk > 0 else None


def producer_of(message: Message) -> Tuple[str, int, int]:
    """(kind, microbatch, chunk) of the compute that produces `message`."""
    kind = FORWARD if message.kind == ACTIVATION else BACKWARD
    return kind, message.microbatch, message.src_chunk
