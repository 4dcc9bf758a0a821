"""`mpoverlap-check --search`: the layouts of one model on one world size and machine, ranked
by predicted throughput.

Candidates: tp (powers of two up to 2 nodes), pp (divisors of the layer count), vpp 1/2/4,
cp 1/2, ep (MoE: powers of two dividing the experts), micro batch 1/2/4, sequence parallel,
distributed optimizer; dp = world / (tp pp cp); with pp > 1, every pipeline schedule of
`pipeline.SCHEDULE_KINDS` whose constraints accept the layout (pp, vpp, microbatches), e.g.
1f1b and zb1p at vpp 1; interleaved, zb1p and zbv at vpp 2 (pp = 1: `auto`). A key given on the
command line is kept fixed.
Each candidate goes through, in order:
  1. the validator (every rule; each rejection is counted under its rule id),
  2. memory: the estimate's heaviest stage under the lightest recomputation that fits
     (none, then selective, then full) within 90% of HBM; heavier recomputation is only
     slower, so it is not simulated ("dominated"),
  3. with TP overlap on, a tp > 1 layout without sequence parallelism is dominated by the same
     one with it (its all-reduces are exposed, its activations larger),
  4. the simulator, with the overlap settings given (default auto: every mode on where it
     applies); overlap.dp_bucket_mb=auto (the default) is simulated at bucket_size.PROVISIONAL_MB
     here, then for the `BUCKETS_FOR_TOP` fastest layouts at every candidate size
     (bucket_size.choose_bucket_mb), and those are ranked again at their best size. overlap=none is never faster in the model (exposed <= in flight), so it is not
     enumerated; the output gives the best layout's step with overlap=none beside it, and,
     pipelined, its step under each other schedule that was simulated.
A schedule the simulator cannot cost (it raises) is dropped under "simulator: ...".
"""
from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from mpoverlap.overlap.estimate.core import estimate
from mpoverlap.overlap.rules import validate
from mpoverlap.simulate.bucket_size import PROVISIONAL_MB, choose_bucket_mb, requested_bucket_mb
from mpoverlap.simulate.core import SimResult, simulate
from mpoverlap.simulate.hardware import Hardware
from mpoverlap.simulate.plain import plain, with_values

HBM_USABLE = 0.9  # the CUDA context, NCCL buffers and fragmentation take the rest
SEARCHED = ("parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.ep", "train.micro_batch_size",
            "parallel.sequence_parallel", "train.distributed_optimizer", "parallel.pp_schedule", "model.recompute",
            "overlap.dp_bucket_mb")
BUCKETS_FOR_TOP = 10  # layouts whose bucket size is searched (it moves the DP tail, not what fits)


@dataclass
class Candidate:
    values: Dict[str, Any]
    result: SimResult
    memory_gb: float


@dataclass
class SearchResult:
    ranked: List[Candidate]
    dropped: Counter
    considered: int
    seconds: float


def fixed_keys(overrides: List[str]) -> set:
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


def _pow2(limit: int) -> List[int]:
    return [2 ** i for i in range(int(math.log2(max(1, limit))) + 1)]


def candidates(cfg: Any, world: int, hw: Hardware, fixed: set) -> List[Dict[str, Any]]:
    m = cfg.model
    choices = {
        "parallel.tp": [t for t in _pow2(2 * hw.gpus_per_node) if world % t == 0],
        "parallel.pp": [p for p in range(1, m.num_layers + 1) if m.num_layers % p == 0 and world % p == 0],
        "parallel.vpp": [1, 2, 4],
        "parallel.cp": [1, 2],
        "parallel.ep": [e for e in _pow2(m.num_experts) if m.num_experts % e == 0] if m.num_experts else [1],
        "train.micro_batch_size": [1, 2, 4],
        "parallel.sequence_parallel": [True, False],
        "train.distributed_optimizer": [False, True],
    }
    for key in fixed & set(choices):
        group, name = key.split(".", 1)
        choices[key] = [getattr(getattr(cfg, group), name)]
    keys = list(choices)
    out = []
    for combo in itertools.product(*(choices[k] for k in keys)):
        v = dict(zip(keys, combo))
        tp, pp, cp = v["parallel.tp"], v["parallel.pp"], v["parallel.cp"]
        if world % (tp * pp * cp):
            continue
        if v["parallel.sequence_parallel"] and tp == 1:
            continue  # the same layout as without SP
        if pp == 1 and v["parallel.vpp"] > 1:
            continue
        if m.num_layers % (pp * v["parallel.vpp"]):
            continue
        v["parallel.dp"] = world // (tp * pp * cp)
        for kind in _schedules(cfg, v, fixed):
            out.append({**v, "parallel.pp_schedule": kind})
    return out


def _schedules(cfg: Any, v: Dict[str, Any], fixed: set) -> List[str]:
    """The pipeline schedules to try for layout `v`: the one given on the command line, `auto`
    without a pipeline, else every kind whose constraints accept pp, vpp and the microbatches."""
    from mpoverlap.pipeline.schedules import SCHEDULE_KINDS, schedule_constraints

    if "parallel.pp_schedule" in fixed:
        return [cfg.parallel.pp_schedule]
    if v["parallel.pp"] == 1:
        return ["auto"]
    micro = max(1, cfg.train.global_batch_size // (v["train.micro_batch_size"] * v["parallel.dp"]))
    return [k for k in SCHEDULE_KINDS if not schedule_constraints(k, v["parallel.pp"], v["parallel.vpp"], micro)]


def search(cfg: Any, hw: Hardware, overrides: List[str], world: int) -> SearchResult:
    t0 = time.perf_counter()
    base = plain(cfg)
    fixed = fixed_keys(overrides)
    auto_bucket = requested_bucket_mb(base) is None
    if auto_bucket:
        base = with_values(base, {"overlap.dp_bucket_mb": PROVISIONAL_MB})
    dropped: Counter = Counter()
    ranked: List[Candidate] = []
    cands = candidates(base, world, hw, fixed)
    recomputes = [base.model.recompute] if "model.recompute" in fixed else ["none", "selective", "full"]
    tp_overlap = str(base.overlap.tp).lower() != "false"
    for values in cands:
        if (tp_overlap and values["parallel.tp"] > 1 and not values["parallel.sequence_parallel"]
                and "parallel.sequence_parallel" not in fixed):
            # Without SP only the backward's input-gradient all-reduces hide (under the wgrad
            # GEMMs; the forward's are waited at once) and every rank holds the whole sequence's
            # activations: never faster nor smaller than with SP while TP overlap is on.
            dropped["dominated: parallel.sequence_parallel=false (SP hides the forward's TP traffic too, "
                    "and holds less)"] += 1
            continue
        c = with_values(base, {**values, "model.recompute": "none", "parallel.world_size": world})
        problems = validate(c)
        if problems:
            for rule in sorted({p.rule for p in problems}):
                dropped[f"rule {rule}"] += 1
            continue
        est = estimate(c)
        # all but the activations, which depend on the recomputation: parameters, gradients,
        # optimizer state, the step's weight casts, the loss's backward, CP's attention work
        state = sum(v for k, v in est.memory_bytes.items() if k != "activations")
        fits = [r for r in recomputes if state + est.activations_by_recompute[r] <= HBM_USABLE * hw.hbm_bytes]
        if not fits:
            dropped["memory: does not fit in HBM under any model.recompute"] += 1
            continue
        dropped["dominated: more recomputation than needed to fit"] += len(recomputes) - recomputes.index(fits[0]) - 1
        chosen = {**values, "model.recompute": fits[0]}
        c = with_values(c, {"model.recompute": fits[0]})
        if fits[0] != "none" and validate(c):
            dropped[f"rule {validate(c)[0].rule}"] += 1
            continue
        try:
            result = simulate(c, hw)
        except (NotImplementedError, ValueError) as exc:  # ScheduleError is a ValueError
            if values["parallel.pp_schedule"] == "auto":
                raise
            dropped[f"simulator: cannot cost parallel.pp_schedule={values['parallel.pp_schedule']} "
                    f"({type(exc).__name__})"] += 1
            continue
        ranked.append(Candidate(chosen, result, (state + est.activations_by_recompute[fits[0]]) / 1e9))
    ranked.sort(key=lambda cand: -cand.result.tokens_per_s)
    if auto_bucket:
        ranked = _with_best_buckets(ranked, base, hw, world)
    return SearchResult(ranked, dropped, len(cands), time.perf_counter() - t0)


def _with_best_buckets(ranked: List[Candidate], base: Any, hw: Hardware, world: int) -> List[Candidate]:
    """The `BUCKETS_FOR_TOP` first of `ranked`, each at the bucket size the simulator predicts
    fastest for it, ranked again; the rest keep the provisional size."""
    out = []
    for cand in ranked[:BUCKETS_FOR_TOP]:
        c = with_values(base, {**cand.values, "parallel.world_size": world})
        mb = choose_bucket_mb(c, hw).mb
        values = {**cand.values, "overlap.dp_bucket_mb": mb}
        out.append(Candidate(values, simulate(with_values(c, {"overlap.dp_bucket_mb": mb}), hw), cand.memory_gb))
    out.sort(key=lambda cand: -cand.result.tokens_per_s)
    return out + ranked[BUCKETS_FOR_TOP:]


def _layout(v: Dict[str, Any]) -> str:
    return (f"tp{v['parallel.tp']} pp{v['parallel.pp']} vpp{v['parallel.vpp']} cp{v['parallel.cp']} "
            f"ep{v['parallel.ep']} dp{v['parallel.dp']} mbs{v['train.micro_batch_size']}"
            f"{' ' + v['parallel.pp_schedule'] if v.get('parallel.pp_schedule', 'auto') != 'auto' else ''}"
            f"{' sp' if v['parallel.sequence_parallel'] else ''}{' zero1' if v['train.distributed_optimizer'] else ''}"
            f" rc={v['model.recompute']}"
            + (f" bucket={v['overlap.dp_bucket_mb']:g}MiB" if "overlap.dp_bucket_mb" in v else ""))


def render_search(cfg: Any, hw: Hardware, res: SearchResult, world: int, top: int = 10) -> str:
    from mpoverlap.simulate.report import render
    from mpoverlap.simulate.hardware import describe

    m, t = cfg.model, cfg.train
    lines = [f"mpoverlap search: {m.name} ({m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}) on "
             f"{world} ranks, global batch {t.global_batch_size}",
             f"  hardware {describe(hw)}",
             f"  {res.considered} layouts considered, {len(res.ranked)} simulated, in {res.seconds:.1f} s",
             "  rank | layout | step (ms) | tokens/s | MFU | mem (GB) | exposed ms: dp tp pp cp ep | pipeline idle (ms)",
             "  ---- | ------ | --------- | -------- | --- | -------- | -------------------------- | ------------------"]
    for i, cand in enumerate(res.ranked[:top], 1):
        r = cand.result
        exp = " ".join(f"{r.exposed_s.get(k, 0.0) * 1e3:.1f}" for k in ("dp", "tp", "pp", "cp", "ep"))
        lines.append(f"  {i:>4} | {_layout(cand.values)} | {r.step_s * 1e3:,.1f} | {r.tokens_per_s:,.0f} | "
                     f"{100 * r.mfu:.1f}% | {cand.memory_gb:.1f} | {exp} | {r.bubble_s * 1e3:,.1f}")
    lines.append("  dropped (counts per reason; a layout broken by several rules counts under each):")
    for reason, n in sorted(res.dropped.items(), key=lambda kv: -kv[1]):
        if n:
            lines.append(f"    {n:>6}  {reason}")
    if res.ranked:
        best = res.ranked[0]
        lines.append("  best layout in detail:")
        c = with_values(plain(cfg), {**best.values, "parallel.world_size": world})
        lines.extend("  " + line for line in render(c, hw, best.result).splitlines())
        lines.append("  as overrides: " + " ".join(f"{k}={_show(v)}" for k, v in best.values.items()))
        off = with_values(c, {f"overlap.{k}": False for k in ("dp", "tp", "pp", "cp", "ep", "dp_param_gather")})
        r_off = simulate(off, hw)
        lines.append(f"  the same layout with overlap=none: step {r_off.step_s * 1e3:,.1f} ms "
                     f"({r_off.step_s / best.result.step_s - 1:+.1%}), MFU {100 * r_off.mfu:.1f}%")
        for other in other_schedules(res.ranked, best):
            r = other.result
            lines.append(f"  the same layout with parallel.pp_schedule={other.values['parallel.pp_schedule']}: step "
                         f"{r.step_s * 1e3:,.1f} ms ({r.step_s / best.result.step_s - 1:+.1%}), pipeline idle "
                         f"{r.bubble_s * 1e3:,.1f} ms (best: {best.result.bubble_s * 1e3:,.1f} ms)")
    return "\n".join(lines)


def other_schedules(ranked: List[Candidate], best: Candidate) -> List[Candidate]:
    """The simulated candidates that differ from `best` in the pipeline schedule only (and in
    the recomputation it needed to fit), in rank order."""
    same = {k: v for k, v in best.values.items() if k not in ("parallel.pp_schedule", "model.recompute")}
    return [c for c in ranked if c is not best
            and {k: v for k, v in c.values.items() if k not in ("parallel.pp_schedule", "model.recompute")} == same]


def _show(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def parse_top(args: List[str]) -> Tuple[int, List[str]]:
    """`--top N` out of the argument list."""
    if "--top" in args:
        i = args.index("--top")
        return int(args[i + 1]), args[:i] + args[i + 2:]
    return 10, args

