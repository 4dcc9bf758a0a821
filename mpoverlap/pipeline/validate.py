"""validate_schedule: a pure checker for pipeline action tables (no processes).

Checked, for the whole table and for both posting programs (overlap off and on):

1. Coverage: every stage runs exactly one F and one B per (microbatch, local vchunk), F first;
   a table with W actions (zero-bubble) has exactly one W per B, after it, on the same stage
   (W sends and receives nothing); the MTP chunk of a loop_mtp layout (its stage's vchunk
   vpp, actions.py) has an F and a full B per microbatch and no W.
2. Data flow: each compute's `recv` / `send` is the activation of the previous model chunk /
   the gradient of the next one for the same microbatch, with the chunks placed by the
   tables' layout (actions.py: "loop", chunk = vchunk * pp + stage; or the zbv "v": exactly
   two chunks per stage, stage s holding chunks s and 2pp-1-s).
3. Matching: every receive posted is matched by exactly one send of the right peer, and
   vice versa; each message is posted once per end; a receive is posted before the compute
   that consumes it and a send after the compute that produces it. A local message (both
   ends on one stage, the V's turn) is never posted, and its producer runs before its
   consumer on that stage.
4. Link order: on every pair of stages both ends post their ops in a compatible order (per
   direction the same FIFO sequence, and no two messages in opposite order at the two ends;
   ops in one batch count as simultaneous).
6. Pairs (overlap.ep_pairing, paired.py): a paired F is followed by a B of another
   (microbatch, vchunk) on the same stage with nothing posted between them; the pair runs as
   one compute, so both receives must be posted before it (checked in 3) and waited before it
   (in 5's simulation): a B that needs the F's own output deadlocks there.
5. No deadlock: a simulation advances a stage only when its next step can complete, with
   rendezvous semantics (a send completes only once the peer posted the receive), in two
   flavours: "blocking" (every batch waited right after it is posted, as overlap=False and
   as NCCL's serialised stream would) and "deferred" (a batch waited only before the compute
   that needs its receive, sends at the end, as overlap=True).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Dict, List, Tuple

from mpoverlap.pipeline.actions import (BACKWARD, FORWARD, RECV, SEND, V_SHAPE, WEIGHT, Action,
                                        Message, ScheduleError, chunk_index, input_message,
                                        is_local, layout_of_tables, main_vpp, mtp_stage_of, num_model_chunks,
                                        output_message, stage_of)

Step = Tuple[str, object]  # ("post", Batch) | ("compute", action_index)


def _program(actions: List[Action], prefetch: bool) -> List[Step]:
    """A stage's posting program: ("post", Batch) and ("compute", index) steps in order."""
    steps: List[Step] = []
    for index, action in enumerate(actions):
        before, after = action.batches(prefetch)
        steps += [("post", b) for b in before] + [("compute", index)] + [("post", b) for b in after]
    return steps


def _check_structure(tables: List[List[Action]], layout: str, problems: List[str]) -> None:
    pp = len(tables)
    vpp = main_vpp(tables)
    mbs = 1 + max((a.microbatch for t in tables for a in t), default=-1)
    num_chunks = num_model_chunks(pp, vpp, layout)
    if layout == V_SHAPE and vpp != 2:
        problems.append(f"the V layout holds exactly two chunks per stage, the tables have vpp={vpp}")
    kinds = (FORWARD, BACKWARD, WEIGHT) if any(a.kind == WEIGHT for t in tables for a in t) \
        else (FORWARD, BACKWARD)
    for stage, actions in enumerate(tables):
        seen = Counter((a.kind, a.microbatch, a.vchunk) for a in actions)
        for kind in set(seen_kind for seen_kind, _, _ in seen) - set(kinds):
            problems.append(f"stage {stage}: unknown action kind {kind!r}")
        expected = {(kind, v): 1 for v in range(vpp) for kind in kinds}
        if stage == mtp_stage_of(layout):  # the MTP chunk (vchunk vpp): an F and a full B, no W
            expected.update({(kind, vpp): int(kind != WEIGHT) for kind in kinds})
        for mb in range(mbs):
            for (kind, v), count in expected.items():
                if seen[(kind, mb, v)] != count:
                    problems.append(f"stage {stage}: {kind}(mb{mb},v{v}) appears {seen[(kind, mb, v)]} times")
        done = set()
        for index, a in enumerate(actions):
            chunk = chunk_index(stage, a.vchunk, pp, layout)
            if a.chunk != chunk:
                problems.append(f"stage {stage} action {index} {a}: chunk {a.chunk} != {chunk}")
            if a.kind == BACKWARD and (FORWARD, a.microbatch, a.vchunk) not in done:
                problems.append(f"stage {stage} action {index} {a}: backward before its forward")
            if a.kind == WEIGHT and (BACKWARD, a.microbatch, a.vchunk) not in done:
                problems.append(f"stage {stage} action {index} {a}: weight gradients before their B")
            done.add((a.kind, a.microbatch, a.vchunk))
            if a.paired:
                nxt = actions[index + 1] if index + 1 < len(actions) else None
                if a.kind != FORWARD or nxt is None or nxt.kind != BACKWARD or nxt.paired:
                    problems.append(f"stage {stage} action {index} {a} (paired): a pair is an F followed by a B, got {nxt}")
                elif (nxt.microbatch, nxt.vchunk) == (a.microbatch, a.vchunk):
                    problems.append(f"stage {stage} action {index} {a} (paired): paired with its own backward")
                if a.posts_after or a.prefetch_after:
                    problems.append(f"stage {stage} action {index} {a} (paired): posts between the F and the B of a pair")
            if a.recv != input_message(a.kind, a.microbatch, chunk, num_chunks):
                problems.append(f"stage {stage} action {index} {a}: consumes {a.recv}, expected "
                                f"{input_message(a.kind, a.microbatch, chunk, num_chunks)}")
            if a.send != output_message(a.kind, a.microbatch, chunk, num_chunks):
                problems.append(f"stage {stage} action {index} {a}: produces {a.send}, expected "
                                f"{output_message(a.kind, a.microbatch, chunk, num_chunks)}")


def _check_matching(tables, programs, layout: str, label: str, problems: List[str]) -> None:
    pp = len(tables)
    posted: Dict[Tuple[str, Message], List[int]] = defaultdict(list)
    for stage, steps in enumerate(programs):
        available, sent_ok = set(), set()
        for kind, item in steps:
            if kind == "post":
                for op in item:
                    posted[(op.op, op.message)].append(stage)
                    msg = op.message
                    if is_local(msg, pp, layout):
                        problems.append(f"{label} stage {stage}: {op} is posted, but both ends of "
                                        f"{msg} are on stage {stage} (a local hand-over)")
                    expected_peer = stage_of(msg.src_chunk if op.op == RECV else msg.dst_chunk, pp, layout)
                    owner = stage_of(msg.dst_chunk if op.op == RECV else msg.src_chunk, pp, layout)
                    if op.peer != expected_peer or owner != stage:
                        problems.append(f"{label} stage {stage}: {op} has the wrong peer or stage")
                    if op.op == RECV:
                        available.add(op.message)
                    elif op.message not in sent_ok:
                        problems.append(f"{label} stage {stage}: {op} posted before its producer ran")
            else:
                action = tables[stage][item]
                for needed in _needs(tables[stage], item):
                    if needed not in available:
                        problems.append(f"{label} stage {stage}: {action} runs before {needed} is received")
                if action.send is not None:
                    sent_ok.add(action.send)
                    if is_local(action.send, pp, layout):
                        available.add(action.send)
    messages = {msg for _, msg in posted} | {a.send for t in tables for a in t
                                             if a.send and not is_local(a.send, pp, layout)}
    for msg in sorted(messages, key=str):
        sends, recvs = posted.get((SEND, msg), []), posted.get((RECV, msg), [])
        if len(sends) != 1 or len(recvs) != 1:
            problems.append(f"{label}: {msg} has {len(sends)} send(s) and {len(recvs)} receive(s); "
                            "every receive needs exactly one matching send")


def _link_sequences(programs, pp: int):
    """{(a, b): [(batch_position, index_in_batch, op)] as posted by a toward b}."""
    seqs = defaultdict(list)
    for stage, steps in enumerate(programs):
        position = 0
        for kind, batch in steps:
            if kind != "post":
                continue
            for i, op in enumerate(batch):
                seqs[(stage, op.peer)].append((position, i, op))
            position += 1
    return seqs


def _check_link_order(programs, pp: int, label: str, problems: List[str]) -> None:
    seqs = _link_sequences(programs, pp)
    for a in range(pp):
        for b in range(a + 1, pp):
            ours, theirs = seqs.get((a, b), []), seqs.get((b, a), [])
            for direction, mine, peer in ((f"s{a}->s{b}", SEND, RECV), (f"s{b}->s{a}", RECV, SEND)):
                x = [op.message for _, _, op in ours if op.op == mine]
                y = [op.message for _, _, op in theirs if op.op == peer]
                if x != y:
                    first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                    problems.append(f"{label} link s{a}<->s{b}: {direction} FIFO order differs at "
                                    f"message #{first}: {x[first] if first < len(x) else None} vs "
                                    f"{y[first] if first < len(y) else None}")
            pos_b = {op.message: pos for pos, _, op in theirs}
            last_b, prev_pos, group_max = -1, None, -1
            for pos, _, op in ours:  # b's positions must never go back when a's advance
                if op.message not in pos_b:
                    continue
                if pos != prev_pos:
                    last_b, prev_pos = max(last_b, group_max), pos
                if pos_b[op.message] < last_b:
                    problems.append(f"{label} link s{a}<->s{b}: {op.message} is posted in a different "
                                    "order at the two ends (deadlock with blocking p2p)")
                    break
                group_max = max(group_max, pos_b[op.message])


def _needs(actions: List[Action], index: int) -> List[Message]:
    """The messages compute `index` needs before it starts: its own input, and for a paired
    F its B's too (the pair starts as one compute); none for the B of a pair (already had)."""
    action = actions[index]
    own = [action.recv] if action.recv is not None else []
    if index and actions[index - 1].paired:
        return []
    if action.paired and index + 1 < len(actions) and actions[index + 1].recv is not None:
        own.append(actions[index + 1].recv)
    return own


def _simulate(tables, programs, deferred: bool, label: str, problems: List[str]) -> None:
    """Rendezvous simulation; records the stuck steps if some stage can never finish."""
    plans = []
    for stage, steps in enumerate(programs):
        plan, pending = [], []
        for kind, item in steps:
            if kind == "post":
                plan.append(("post", item))
                if deferred:
                    pending.append(item)
                else:
                    plan.append(("wait", item))
            else:
                need = _needs(tables[stage], item)
                for batch in [b for b in pending if any(op.message in need and op.op == RECV for op in b)]:
                    plan.append(("wait", batch))
                    pending.remove(batch)
                plan.append(("compute", item))
        plans.append(plan + [("wait", b) for b in pending])
    posted, pcs = set(), [0] * len(plans)
    counterpart = {SEND: RECV, RECV: SEND}
    progressed = True
    while progressed:
        progressed = False
        for stage, plan in enumerate(plans):
            while pcs[stage] < len(plan):
                kind, item = plan[pcs[stage]]
                if kind == "post":
                    posted.update((op.op, op.message) for op in item)
                elif kind == "wait" and not all((counterpart[op.op], op.message) in posted for op in item):
                    break
                pcs[stage] += 1
                progressed = True
    stuck = {s: plan[pcs[s]] for s, plan in enumerate(plans) if pcs[s] < len(plan)}
    if stuck:
        shown = {s: (k, str(tables[s][i]) if k == "compute" else " ".join(map(str, i)))
                 for s, (k, i) in stuck.items()}
        mode = "deferred waits" if deferred else "blocking p2p"
        problems.append(f"{label}: deadlock with {mode}; stuck stages: {shown}")


def validate_schedule(tables: List[List[Action]]) -> None:
    """Raise ScheduleError listing every problem found (see the module docstring)."""
    problems: List[str] = []
    layout = layout_of_tables(tables)
    _check_structure(tables, layout, problems)
    pp = len(tables)
    for prefetch in (False, True):
        label = "overlap=on" if prefetch else "overlap=off"
        programs = [_program(actions, prefetch) for actions in tables]
        _check_matching(tables, programs, layout, label, problems)
        _check_link_order(programs, pp, label, problems)
        for deferred in (False, True):
            _simulate(tables, programs, deferred, label, problems)
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise ScheduleError("invalid pipeline schedule:\n  " + "\n  ".join(shown))
