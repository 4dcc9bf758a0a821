"""Forward/backward pairing of MoE microbatches (`overlap.ep_pairing`): what it hides.

Megatron's combined 1F1B and DeepSeek's DualPipe hide one microbatch's expert all-to-alls
under another microbatch's computation. mpoverlap/pairing runs it at pp 1 with m
microbatches: microbatch 0's forward alone, then the forward of microbatch i beside the
backward of microbatch i-1 (m-1 pairs), then the last backward alone. Each microbatch is a
program of sub-steps (per MoE layer, forward: pre-dispatch compute = the previous layer's
combine segment, attention, norms, router and the counts exchange; the dispatches; the
experts chunk by chunk, each chunk's combine issued after it; backward: the mirror), and the
executor runs the two programs of a pair on one thread round-robin, each up to the point
where it has just issued exchanges of its own (a YIELD), the backward first (Megatron's
combined 1F1B order). Forward layer j meets backward layer L-1-j; on the link:

    B's reverse combines   under  F's pre-dispatch (the embedding first)
    F's dispatches         under  B's experts backward (and shared expert backward)
    B's reverse dispatches under  F's shared expert and experts
    F's combines           under  B's pre-dispatch backward (and the next layer's post-combine
                                  backward; at the pair's end B's embedding backward)

so every exchange of either has a compute of the other beside it, the forward's first
dispatch included (a forward-first order leaves F's first dispatch beside B's head backward
only and B's last reverse dispatch beside F's head only: at 1:1 it exposes one exchange of
each per pair, this order none).

`forward_program` / `backward_program` write those programs as mpoverlap/pairing/steps.py and
tape.py run them, `round_robin` interleaves them (the backward first, as executor.run_pair), and
`overlap.serial_link_waits` runs the result on one serial link, first come first served (a
transfer queues behind what the link still carries: the pre-dispatch's counts exchange too).
The unpaired first forward and last backward are the same programs run alone
(`alone_exposed`): in backward every reverse combine is waited before the experts' backward
(one autograd call over the chunks), so the lone backward hides nothing of its own.

`apply_pairing` turns the per-microbatch costs (costs.ChunkCost, one chunk at pp 1) into the
per-microbatch average the pipeline engine adds up: exposed ep per forward =
(alone + (m-1) x paired) / m, the same for the backward; the counts exchanges' latency joins
the forward's ep in flight.

At pp > 1 (the paired interleaved, zb1p and zbv tables, pipeline/paired.py and zbv_paired.py)
a pair is a forward of one (microbatch, chunk) beside a backward of another chunk of the same
stage, and the lone forwards and backwards of the table's warm-up and drain run the same
programs alone. `PipelinePairing` gives the engine (engine.run_pipeline's `pair_duration`)
each pair's exposed seconds per side from the two chunks' layer passes, and each lone action's;
the step's ep exposed is the sum over the critical stage's actions (core.simulate).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from mpoverlap.simulate.overlap import serial_link_waits

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class LayerPass:
    """One layer's pass of one microbatch on a rank (its forward, or its backward), in seconds:
    `pre` = the compute outside the experts (attention, norms, router, permutation; a dense
    layer's whole MLP; recomputation), `experts` and `shared` (the shared expert) compute, and
    the token exchanges `dispatch` and `combine` (0 for a dense layer; in backward the reverse
    exchanges, named after the forward's they reverse; `counts` the forward's counts exchange)."""
    pre: float
    experts: float = 0.0
    shared: float = 0.0
    dispatch: float = 0.0
    combine: float = 0.0
    counts: float = 0.0  # the forward's exchange of the chunks' token counts (before the dispatch)

    @property
    def compute(self) -> float:
        return self.pre + self.experts + self.shared


def requested(cfg: Any) -> str:
    """`overlap.ep_pairing` as "auto" | "true" | "false" ("false" when the key does not exist:
    a build without pairing)."""
    from mpoverlap.config import normalize_tristate

    ov = getattr(cfg, "overlap", None)
    value = ov.get("ep_pairing", "false") if ov is not None and hasattr(ov, "get") else "false"
    return str(normalize_tristate(value))


def pairing_state(cfg: Any, pp: int, vpp: int, ep: int, ep_overlap: bool, microbatches: int,
                  resolved: Any = None) -> Tuple[bool, str]:
    """(whether the simulator pairs forward and backward microbatches, why). `resolved`: the
    build's own resolution of `overlap.ep_pairing` (CommOverlapConfig's ModeState, where the
    build has it: its rules say where pairing runs); without it, `overlap.ep_pairing` true or
    auto where it applies: ep > 1 with EP overlap on (the exchanges asynchronous), at least 2
    microbatches (a pair needs two), and at pp > 1 a schedule with a paired table
    (pipeline.pairing_constraints: interleaved, zb1p at vpp >= 2, zbv)."""
    if resolved is not None:
        if not resolved.enabled:
            return False, resolved.reason if resolved.reason.startswith("off") else f"off: {resolved.reason}"
        return _modelled(cfg, pp, vpp, microbatches)
    want = requested(cfg)
    if want not in ("true", "auto"):
        return False, "off (overlap.ep_pairing=false)" if want == "false" else f"off (overlap.ep_pairing={want})"
    if ep <= 1:
        return False, "off: ep = 1, no expert exchanges"
    if not ep_overlap:
        return False, "off: EP overlap is off (the exchanges are waited where issued)"
    if microbatches < 2:
        return False, "off: 1 microbatch, nothing to pair with"
    return _modelled(cfg, pp, vpp, microbatches)


def _modelled(cfg: Any, pp: int, vpp: int, microbatches: int) -> Tuple[bool, str]:
    if pp == 1:
        if vpp > 1:
            return False, f"not modelled at pp 1 x vpp {vpp}"
        return True, (f"on: microbatch 0's forward alone, {microbatches - 1} forward/backward pair(s), the last "
                      "backward alone")
    from mpoverlap.pipeline import resolve_schedule
    from mpoverlap.pipeline.schedules import pairing_constraints

    par = getattr(cfg, "parallel", None)
    kind = resolve_schedule(getattr(par, "pp_schedule", "auto") if par is not None else "auto", vpp)
    problems = pairing_constraints(kind, pp, vpp)
    if problems:
        return False, "off: " + problems[0]
    return True, (f"on: the paired {kind} table (pp {pp} x vpp {vpp}, {microbatches} microbatches), each pair one "
                  "action of a forward beside a backward of another chunk of the stage, the warm-up forwards and "
                  "the drain's backwards alone")


YIELD = ("yield",)


def forward_program(passes: Sequence[LayerPass], chunks: int, other_f: float = 0.0) -> List:
    """One microbatch's forward as the pairing runs it (mpoverlap/pairing/steps.py), the steps of
    `overlap.serial_link_waits` plus YIELD where it hands over to the other microbatch. Per MoE
    layer j: wait the previous layer's combines (its combine segment is in `pre`), pre-dispatch
    compute, the counts exchange (issued and waited: it queues behind whatever the link still
    carries), issue the k dispatches, YIELD; the shared expert, then per chunk wait its
    dispatch, its experts, issue its combine, YIELD. A dense layer: its compute. Last: wait the
    last combines, `other_f` (embedding, head and loss)."""
    k, prog, pending = max(1, chunks), [], []
    for j, f in enumerate(passes):
        prog += [("wait", name) for name in pending]
        pending = []
        prog.append(("compute", f.pre))
        if f.dispatch <= 0:
            continue
        prog += [("issue", f"F:N{j}", f.counts), ("wait", f"F:N{j}")]  # queues behind the link's transfers
        prog += [("issue", f"F:D{j}.{c}", f.dispatch / k) for c in range(k)] + [YIELD, ("compute", f.shared)]
        for c in range(k):
            prog += [("wait", f"F:D{j}.{c}"), ("compute", f.experts / k), ("issue", f"F:C{j}.{c}", f.combine / k)]
        prog.append(YIELD)
        pending = [f"F:C{j}.{c}" for c in range(k)]
    return prog + [("wait", name) for name in pending] + [("compute", other_f)]


def backward_program(passes: Sequence[LayerPass], chunks: int, other_b: float = 0.0) -> List:
    """The mirror (the tape run backwards): `other_b` (loss and head backward) first, then per MoE
    layer from the last: issue the k reverse combines, YIELD; wait them all, the experts'
    backward (all chunks in one autograd call), issue the k reverse dispatches, the shared
    expert's backward, YIELD; wait them all, the pre-dispatch backward. A dense layer: its
    compute. `passes` in forward order."""
    k, prog = max(1, chunks), [("compute", other_b)]
    for j in reversed(range(len(passes))):
        b = passes[j]
        if b.combine > 0:
            prog += [("issue", f"B:C{j}.{c}", b.combine / k) for c in range(k)] + [YIELD]
            prog += [("wait", f"B:C{j}.{c}") for c in range(k)] + [("compute", b.experts)]
            prog += [("issue", f"B:D{j}.{c}", b.dispatch / k) for c in range(k)] + [("compute", b.shared), YIELD]
            prog += [("wait", f"B:D{j}.{c}") for c in range(k)]
        else:
            prog.append(("compute", b.experts + b.shared))
        prog.append(("compute", b.pre))
    return prog


def round_robin(first: List, second: List) -> List:
    """Two programs as the pairing executor runs them on one thread: `first` up to its next
    YIELD, then `second` up to its next, and so on; the one left runs to its end."""
    def pieces(prog: List) -> List[List]:
        out: List[List] = [[]]
        for step in prog:
            if step == YIELD:
                out.append([])
            else:
                out[-1].append(step)
        return out

    a, b = pieces(first), pieces(second)
    merged: List = []
    for i in range(max(len(a), len(b))):
        merged += (a[i] if i < len(a) else []) + (b[i] if i < len(b) else [])
    return merged


def pair_program(fwd: Sequence[LayerPass], bwd: Sequence[LayerPass], chunks: int,
                 other_f: float = 0.0, other_b: float = 0.0) -> List:
    """One pair: the backward of a microbatch (`bwd`, layers in forward order; it runs them last
    to first, and runs first) beside the forward of another (`fwd`, in forward order: at pp 1
    the same layers, in a pipeline table those of another chunk of the stage), round-robin at
    their YIELDs. Exchange names start with "F:" or "B:" (whose microbatch waits)."""
    return round_robin(backward_program(bwd, chunks, other_b), forward_program(fwd, chunks, other_f))


def _by_side(program: List) -> Dict[str, float]:
    out = {FORWARD: 0.0, BACKWARD: 0.0}
    for name, waited in serial_link_waits(program).items():
        out[name.split(":", 1)[0]] += waited
    return out


def pair_exposed(fwd: Sequence[LayerPass], bwd: Sequence[LayerPass], chunks: int, other_f: float = 0.0,
                 other_b: float = 0.0) -> Dict[str, float]:
    """{"F": seconds the pair waits on the forward's exchanges, "B": on the backward's}."""
    return _by_side(pair_program(fwd, bwd, chunks, other_f, other_b))


def alone_exposed(fwd: Sequence[LayerPass], bwd: Sequence[LayerPass], chunks: int, other_f: float = 0.0,
                  other_b: float = 0.0) -> Dict[str, float]:
    """{"F": the first forward's exposed seconds, "B": the last backward's}: the same programs,
    each run with no other microbatch beside it (the executor runs them alone)."""
    f = _by_side(round_robin(forward_program(fwd, chunks, other_f), []))[FORWARD]
    b = _by_side(round_robin([], backward_program(bwd, chunks, other_b)))[BACKWARD]
    return {FORWARD: f, BACKWARD: b}


def _others(cost: Any) -> Tuple[float, float]:
    """The compute of a chunk outside its layer passes (embedding, head and loss), F and B."""
    return tuple(max(0.0, cost.compute[k] - sum(p.compute for p in cost.layers[k])) for k in (FORWARD, BACKWARD))


class PipelinePairing:
    """Pairing in a pipeline table: per chunk the lone forward's and backward's exposed ep
    (`alone(chunk)`), per (forward's chunk, backward's chunk) the pair's (`pair(f, b)`), from
    `costs` (costs.ChunkCost per model chunk) and `chunks` (overlap.ep_chunks); memoised."""

    def __init__(self, costs: Sequence[Any], chunks: int) -> None:
        self.costs, self.chunks = costs, chunks
        self._alone: Dict[int, Dict[str, float]] = {}
        self._pairs: Dict[Tuple[int, int], Dict[str, float]] = {}

    def alone(self, chunk: int) -> Dict[str, float]:
        if chunk not in self._alone:
            c = self.costs[chunk]
            self._alone[chunk] = alone_exposed(c.layers[FORWARD], c.layers[BACKWARD], self.chunks, *_others(c))
        return self._alone[chunk]

    def pair(self, f_chunk: int, b_chunk: int) -> Dict[str, float]:
        key = (f_chunk, b_chunk)
        if key not in self._pairs:
            f, b = self.costs[f_chunk], self.costs[b_chunk]
            self._pairs[key] = pair_exposed(f.layers[FORWARD], b.layers[BACKWARD], self.chunks, _others(f)[0],
                                            _others(b)[1])
        return self._pairs[key]

    def stage_exposed(self, run: Any, stage: int) -> Tuple[float, Dict[str, float]]:
        """(ep exposed over the actions of `stage` in `run`, an engine.PipelineRun of the paired
        table; for the report the mean per pair of each side, {"F", "B"}, and per lone pass,
        {"F_alone", "B_alone"})."""
        from mpoverlap.pipeline.actions import chunk_index

        pp, total = len(run.orders), 0.0
        sides: Dict[str, List[float]] = {"F": [], "B": [], "F_alone": [], "B_alone": []}
        for (kind, _mb, v), (role, partner) in zip(run.orders[stage], run.pairs[stage]):
            if kind not in (FORWARD, BACKWARD):
                continue
            chunk = chunk_index(stage, v, pp, run.layout)
            if role == 0:
                x = self.alone(chunk)[kind]
                sides[kind + "_alone"].append(x)
            else:
                x = (self.pair(chunk, partner) if role == 1 else self.pair(partner, chunk))[kind]
                sides[kind].append(x)
            total += x
        return total, {k: sum(v) / len(v) if v else 0.0 for k, v in sides.items()}

    def counts(self, chunk: int) -> float:
        """The counts exchanges of one forward of `chunk` (in flight, beside its dispatches)."""
        return sum(p.counts for p in self.costs[chunk].layers[FORWARD])


def apply_pairing(cost: Any, microbatches: int, chunks: int) -> Dict[str, float]:
    """Rewrites `cost` (a costs.ChunkCost of the one chunk at pp 1) so that its ep exposure per
    forward and per backward is the step's average over `microbatches` with pairing: the lone
    forward and backward (`alone_exposed`) and m-1 pairs (`pair_exposed` of its layer passes).
    Returns {"F", "B": exposed per pair} and the lone {"F_alone", "B_alone"}, for the report."""
    m, one = microbatches, PipelinePairing([cost], chunks)
    paired, alone = one.pair(0, 0), one.alone(0)
    for kind in (FORWARD, BACKWARD):
        cost.exposed[kind]["ep"] = (alone[kind] + (m - 1) * paired[kind]) / m
    # the counts exchanges' calls, on the link in these programs (the unpaired model leaves
    # their latency out), are in flight too
    cost.in_flight[FORWARD]["ep"] = cost.in_flight[FORWARD].get("ep", 0.0) + one.counts(0)
    return {**paired, "F_alone": alone[FORWARD], "B_alone": alone[BACKWARD]}
