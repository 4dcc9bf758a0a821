"""Where a zero-bubble pipeline step's weight gradients reach their parameters: which action of
the stage's table was computing when each accumulated (tests/test_pipeline_executor.py on the
toy chunks, tests/test_zero_bubble_parity.py on the paired tables' GPT chunks)."""


def watch_landings(trace, deferral, named_params):
    """Hook every (name, parameter): its gradient accumulations are recorded in the returned
    list as (name, index of the action computing then: the last "compute" event of `trace()`,
    the PipelineExecutor's trace of the step running). The accumulate call a B makes for a
    weight it deferred (nothing added, `deferral.withheld`) is skipped, as the data-parallel
    hooks skip it. Returns (landings, hook handles)."""
    landings, handles = [], []

    def hook(name):
        def landed(param):
            if not deferral.withheld(param):
                landings.append((name, next(i for event, i, _ in reversed(trace()) if event == "compute")))
        return landed
    for name, param in named_params:
        handles.append(param.register_post_accumulate_grad_hook(hook(name)))
    return landings, handles


def assert_weight_grads_land_in_their_w(table, landings, expected, where):
    """table: the stage's actions as (kind, microbatch, vchunk, chunk); landings: (weight, action
    index) of the deferred weights. Each lands while a W action computes, never inside a B or
    an F; that W belongs to a (microbatch, vchunk) whose B ran before it; one W per B; and,
    where `expected(w_index)` gives a set (None skips it), that W lands exactly those weights
    (it is not a no-op). A W folded back into B (the queue run inside B, or B's deferral
    region skipped) lands them in B's slot and fails here."""
    outside_w = [(weight, table[i]) for weight, i in landings if table[i][0] != "W"]
    assert not outside_w, (where, outside_w[:4])
    b_at = {(mb, v): i for i, (kind, mb, v, _) in enumerate(table) if kind == "B"}
    landed = {}
    for weight, i in landings:
        _, mb, v, _ = table[i]
        assert i > b_at[(mb, v)], (where, table[i])
        landed.setdefault(i, set()).add(weight)
    w_actions = [i for i, (kind, *_) in enumerate(table) if kind == "W"]
    assert w_actions and len(w_actions) == len(b_at)  # one W per B
    assert set(landed) <= set(w_actions)
    for i in w_actions:
        want = expected(i)
        if want is not None:
            assert landed.get(i) == want, (where, table[i], sorted(want ^ landed.get(i, set()))[:6])
