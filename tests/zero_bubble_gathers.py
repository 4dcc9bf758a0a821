"""What ZeRO-3 keeps gathered around the B and W actions of a zero-bubble pipeline step
(tests/test_invariants.py records the buckets gathered after every action)."""


def gathered(gatherer):
    """Sharded buckets whose full parameters are allocated now."""
    return {b for b, sharded in enumerate(gatherer.sharded)
            if sharded and gatherer.ddp.buffer.buckets[b].param_data.untyped_storage().nbytes() > 0}


def held_beyond_pending_w(gatherer, after_action):
    """The zero-bubble bound (docs/invariants.md), after every pipeline action: W reads no
    parameter, so a B frees each unit once its input gradient exists; only the embedding (no
    input gradient; the V's tied head shares it) stays gathered until the W that completes it,
    while a microbatch that ran B for a chunk reading it has W's left on this stage. -> [(action,
    buckets gathered beyond that)], the most units with a bucket gathered after an action."""
    excess, most = [], 0
    backward_done, weight_done, chunks_of = {}, {}, {}  # microbatch -> chunks with B / W / any action
    for _, vchunk, mb, _ in after_action:
        chunks_of.setdefault(mb, set()).add(vchunk)
    # bucket -> the first unit that reads it (a shared bucket counts once)
    owner = {b: i for i, bs in reversed(list(enumerate(gatherer.buckets_of))) for b in bs}
    embedding = {b for i, u in enumerate(gatherer.units) if u.name == "embedding" for b in gatherer.buckets_of[i]}
    for kind, vchunk, mb, held in after_action:
        if kind == "B":
            backward_done.setdefault(mb, set()).add(vchunk)
        elif kind == "W":
            weight_done.setdefault(mb, set()).add(vchunk)
        chunks = {c for m, cs in backward_done.items() if weight_done.get(m, set()) != chunks_of[m] for c in cs}
        allowed = {b for i, u in enumerate(gatherer.units) if u.chunk in chunks for b in gatherer.buckets_of[i]}
        if held - (allowed & embedding):
            excess.append((kind, vchunk, mb, sorted(held - (allowed & embedding))))
        most = max(most, len({owner[b] for b in held}))
    return excess, most
