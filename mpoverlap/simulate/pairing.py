"""Forward/backward pairing of MoE microbatches (`overlap.ep_pairing`, issue 31): what it hides.

Megatron's combined 1F1B and DeepSeek's DualPipe hide one microbatch's expert all-to-alls
under another microbatch's computation. At pp 1 with m microbatches: microbatch 0's forward
runs alone, then the forward of microbatch i is paired with the backward of microbatch i-1
(m-1 pairs), then the last backward runs alone. Within a pair, forward layer j runs beside
backward layer L-1-j, each layer cut into four sub-steps (forward: pre-dispatch compute =
attention, norms, router; dispatch; experts; combine; backward: the mirror), interleaved so
that every exchange of one microbatch is in flight while the other computes:

    link (exchanges)            compute
    combine_bwd(B)          |   pre_dispatch_fwd(F)  (+ F's shared expert)
    dispatch_fwd(F)         |   mlp_bwd(B)
    dispatch_bwd(B)         |   mlp_fwd(F)           (+ B's shared expert backward)
    combine_fwd(F)          |   pre_dispatch_bwd(B)  (and the next pair's pre_dispatch_fwd)

`pair_program` writes one pair as the single-threaded issue/compute/wait program a rank runs
(the exchanges on one serial link, first come first served: `overlap.serial_link_waits`);
with `overlap.ep_chunks` = k each exchange goes in k chunks, an expert chunk starting when its
own chunk has arrived (the chunked programs of today's EP overlap, with the other
microbatch's sub-steps between them). The unpaired first forward and last backward keep
today's exposure (`overlap.ep_chunks_exposed`, in the chunk's costs already).

`apply_pairing` turns the per-microbatch costs (costs.ChunkCost, one chunk at pp 1) into the
per-microbatch average the pipeline engine adds up: exposed ep per forward =
(unpaired + (m-1) x paired) / m, the same for the backward. Not modelled: pp > 1 (Megatron
pairs there across virtual chunks with one more warm-up microbatch).
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
    exchanges, named after the forward's they reverse)."""
    pre: float
    experts: float = 0.0
    shared: float = 0.0
    dispatch: float = 0.0
    combine: float = 0.0

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


def pairing_state(cfg: Any, pp: int, vpp: int, ep: int, ep_overlap: bool, microbatches: int) -> Tuple[bool, str]:
    """(whether the simulator pairs forward and backward microbatches, why): `overlap.ep_pairing`
    true or auto, and where it applies: ep > 1 with EP overlap on (the exchanges asynchronous),
    pp 1 (the only layout modelled), at least 2 microbatches (a pair needs two)."""
    want = requested(cfg)
    if want not in ("true", "auto"):
        return False, "off (overlap.ep_pairing=false)" if want == "false" else f"off (overlap.ep_pairing={want})"
    if ep <= 1:
        return False, "off: ep = 1, no expert exchanges"
    if not ep_overlap:
        return False, "off: EP overlap is off (the exchanges are waited where issued)"
    if pp > 1 or vpp > 1:
        return False, f"not modelled at pp {pp} x vpp {vpp} (pp 1 only)"
    if microbatches < 2:
        return False, "off: 1 microbatch, nothing to pair with"
    return True, (f"on: microbatch 0's forward alone, {microbatches - 1} forward/backward pair(s), the last "
                  "backward alone")


def pair_program(fwd: Sequence[LayerPass], bwd: Sequence[LayerPass], chunks: int,
                 other_f: float = 0.0, other_b: float = 0.0) -> List:
    """One pair as a rank runs it: the forward of one microbatch (`fwd`, layers in forward
    order) beside the backward of the previous one (`bwd`, the same layers in forward order;
    it runs them last to first). Steps as `overlap.serial_link_waits` takes them; exchange
    names start with "F:" or "B:" (whose microbatch waits). `other_b`: the backward's compute
    outside the layers (the loss and output head's backward, run first); `other_f`: the
    forward's (embedding, head and loss, run last, after the last layer's combine)."""
    k = max(1, chunks)
    n = len(fwd)
    if len(bwd) != n:
        raise ValueError(f"a pair needs the same layers on both sides ({n} forward, {len(bwd)} backward)")
    prog: List = [("compute", other_b)]
    for j in range(n):
        f, b = fwd[j], bwd[n - 1 - j]
        if b.combine > 0:  # B's reverse combines first (autograd's order), under F's pre-dispatch
            prog += [("issue", f"B:C{j}.{c}", b.combine / k) for c in reversed(range(k))]
        if j > 0 and fwd[j - 1].combine > 0:  # F's layer input is the previous layer's combine
            prog += [("wait", f"F:C{j - 1}.{c}") for c in range(k)]
        prog.append(("compute", f.pre))
        if f.dispatch > 0:
            prog += [("issue", f"F:D{j}.{c}", f.dispatch / k) for c in range(k)]
        prog.append(("compute", f.shared))
        for c in reversed(range(k)):  # B's experts, chunk by chunk as its reverse combines land
            if b.combine > 0:
                prog.append(("wait", f"B:C{j}.{c}"))
            prog.append(("compute", b.experts / k))
            if b.dispatch > 0:
                prog.append(("issue", f"B:D{j}.{c}", b.dispatch / k))
        for c in range(k):  # F's experts under B's reverse dispatches
            if f.dispatch > 0:
                prog.append(("wait", f"F:D{j}.{c}"))
            prog.append(("compute", f.experts / k))
            if f.combine > 0:
                prog.append(("issue", f"F:C{j}.{c}", f.combine / k))
        prog.append(("compute", b.shared))
        if b.dispatch > 0:
            prog += [("wait", f"B:D{j}.{c}") for c in range(k)]
        prog.append(("compute", b.pre))  # under F's combines
    if n and fwd[-1].combine > 0:
        prog += [("wait", f"F:C{n - 1}.{c}") for c in range(k)]
    prog.append(("compute", other_f))
    return prog


def pair_exposed(fwd: Sequence[LayerPass], bwd: Sequence[LayerPass], chunks: int, other_f: float = 0.0,
                 other_b: float = 0.0) -> Dict[str, float]:
    """{"F": seconds the pair waits on the forward's exchanges, "B": on the backward's}."""
    out = {FORWARD: 0.0, BACKWARD: 0.0}
    for name, waited in serial_link_waits(pair_program(fwd, bwd, chunks, other_f, other_b)).items():
        out[name.split(":", 1)[0]] += waited
    return out


def apply_pairing(cost: Any, microbatches: int, chunks: int) -> Dict[str, float]:
    """Rewrites `cost` (a costs.ChunkCost of the one chunk at pp 1) so that its ep exposure per
    forward and per backward is the step's average over `microbatches` with pairing: one
    unpaired forward and backward (today's exposure, already in `cost`) and m-1 pairs
    (`pair_exposed` of its layer passes). Returns {"F", "B": exposed per pair} and the unpaired
    {"F_alone", "B_alone"}, for the report."""
    m = microbatches
    layers_f, layers_b = cost.layers[FORWARD], cost.layers[BACKWARD]
    other_f = max(0.0, cost.compute[FORWARD] - sum(p.compute for p in layers_f))
    other_b = max(0.0, cost.compute[BACKWARD] - sum(p.compute for p in layers_b))
    paired = pair_exposed(layers_f, layers_b, chunks, other_f, other_b)
    alone = {kind: cost.exposed[kind].get("ep", 0.0) for kind in (FORWARD, BACKWARD)}
    for kind in (FORWARD, BACKWARD):
        cost.exposed[kind]["ep"] = (alone[kind] + (m - 1) * paired[kind]) / m
    return {**paired, "F_alone": alone[FORWARD], "B_alone": alone[BACKWARD]}
