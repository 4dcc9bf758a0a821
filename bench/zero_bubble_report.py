"""bench/zero_bubble.py's figures: the per-side summary (with the bubble formulas evaluated at
the measured F, B, W), the activation-memory runs (bench/memory.py's method), and the
results.md section."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from bench.common import stats

KIND_LABEL = {"1f1b": "1F1B", "interleaved": "interleaved 1F1B", "zb1p": "ZB-H1 (zb1p)", "zbv": "ZB-V (zbv)"}
TORCH_LABEL = {"torch_1f1b": "torch Schedule1F1B", "torch_zb1p": "torch ScheduleInterleavedZeroBubble",
               "torch_zbv": "torch ScheduleZBVZeroBubble"}


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def split_name(name: str) -> tuple:
    """("mpo", kind, m) / ("torch", peer name, m) / ("mpo", kind, None) of a side's name."""
    base, _, m = name.rpartition("_m")
    if not base or not m.isdigit():
        base, m = name, None
    if base.startswith("mpo_"):
        return "mpo", base[4:], int(m) if m else None
    return "torch", base, int(m) if m else None


# torch's sides run the same schedules (their F, B, W measured the same way).
TORCH_KIND = {"torch_1f1b": "1f1b", "torch_zb1p": "zb1p", "torch_zbv": "zbv"}


def closed_form(kind: str, vpp: int, pp: int, f: float, b: float, w: float):
    """The schedule's closed-form bubble per step (mpoverlap/pipeline/bubble.py: the paper's
    Table 2 forms and where each is exact) with per-chunk costs F, B (the full backward for
    schedules without W), W; a BubbleForm, or None for a side that is no schedule."""
    from mpoverlap.pipeline.bubble import closed_form_bubble

    try:
        return closed_form_bubble(TORCH_KIND.get(kind, kind), pp, vpp, f, b, w)
    except ValueError:
        return None


def timed_table(kind: str, pp: int, vpp: int, m: int, f: float, b: float, w: float, cost_of=None,
                latency: float = 0.0, start: Optional[List[float]] = None) -> Dict[str, List[float]]:
    """The schedule's own table run with costs F, B, W (or `cost_of(kind, stage, vchunk)`),
    p2p taking `latency` per message and each stage entering the step at `start[stage]` (0 for
    all when None): per stage the idle time from its own start to its last action's end (what
    pp_bubble_s counts) and over the whole makespan."""
    from mpoverlap.pipeline.schedules import _timed_run, build_schedule

    begin = list(start) if start is not None else [0.0] * pp
    times = _timed_run(build_schedule(kind, pp, vpp, m), f, b, w, cost_of=cost_of, latency=latency, start=begin)
    makespan = max(t[-1][1] for t in times if t)
    busy = [sum(e - s for s, e in t) for t in times]
    return {"in_window_s": [t[-1][1] - s0 - bz for t, s0, bz in zip(times, begin, busy)],
            "makespan_s": [makespan - bz for bz in busy]}


def per_step_pipe(per_step: List[tuple], coords: List[tuple]) -> List[List[Dict[str, Any]]]:
    """Per step, per stage (its first rank): the step's own per-chunk action costs (ms), gap
    per action (ms), start (s, perf_counter) and bubble (ms): the inputs of one timed table
    per step (see `_formulas`). Empty where the results hold no start stamps."""
    pp = 1 + max(c[0] for c in coords)
    out = []
    for step in per_step:
        rows = []
        for s in range(pp):
            p = step[next(r for r, c in enumerate(coords) if c[0] == s)]["pipe"]
            started = p.get("messages", {}).get("started")
            if started is None:
                return []
            busy = sum(v[0] for v in p["actions"].values())
            n = max(1, sum(v[1] for v in p["actions"].values()))
            rows.append({"chunk_ms": {k: v[0] / v[1] * 1e3 for k, v in p.get("chunk_actions", {}).items() if v[1]},
                         "gap_ms": max(0.0, p["window_s"] - p["bubble_s"] - busy) / n * 1e3,
                         "started": started, "bubble_ms": p["bubble_s"] * 1e3})
        out.append(rows)
    return out


def start_offsets_ms(steps: List[List[Dict[str, Any]]]) -> Optional[List[float]]:
    """Per stage, the median over the steps (`per_step_pipe`) of when it entered the schedule
    (`executor.run`) after the earliest stage (ms; one perf_counter clock for every process on
    the machine): a stage with less work after its last action (the optimizer's share, the
    last W's) starts the next step first and waits for the others. None where the results
    hold no start stamps (older results.json)."""
    if not steps:
        return None
    return [_median([(st[s]["started"] - min(x["started"] for x in st)) * 1e3 for st in steps])
            for s in range(len(steps[0]))]


def _side(blocks_per_rank: List[List[dict]], name: str, coords: List[tuple]) -> Dict[str, Any]:
    idx = [i for i, b in enumerate(blocks_per_rank[0]) if b["name"] == name]
    row: Dict[str, Any] = {"blocks": len(idx)}
    per_rank = [[blocks[i] for i in idx] for blocks in blocks_per_rank]
    steps = [max(ts) for blocks in zip(*per_rank) for ts in zip(*(b["times"] for b in blocks))]
    row["step"] = stats(steps)
    extras = [[e for b in blocks for e in b["extras"]] for blocks in per_rank]
    if not extras[0] or "pipe" not in extras[0][0]:
        return row
    pp = 1 + max(c[0] for c in coords)
    stages = []
    for s in range(pp):
        ranks = [r for r, c in enumerate(coords) if c[0] == s]
        pipes = [e["pipe"] for r in ranks for e in extras[r]]
        kinds = sorted({k for p in pipes for k in p["actions"]})
        stages.append({"stage": s, "bubble_ms": _median([p["bubble_s"] * 1e3 for p in pipes]),
                       "bubble_q_ms": [stats([p["bubble_s"] * 1e3 for p in pipes])[q] for q in ("q1_s", "q3_s")],
                       "window_ms": _median([p["window_s"] * 1e3 for p in pipes]),
                       "busy_ms": _median([sum(v[0] for v in p["actions"].values()) * 1e3 for p in pipes]),
                       # in the window but neither compute nor bubble (posting, reaping sends,
                       # the data-parallel hooks, Python between actions), per action
                       "gap_per_action_ms": _median([max(0.0, p["window_s"] - p["bubble_s"] - sum(
                           v[0] for v in p["actions"].values())) / max(1, sum(v[1] for v in p["actions"].values()))
                           * 1e3 for p in pipes]),
                       "action_ms": {k: _median([p["actions"][k][0] / p["actions"][k][1] * 1e3 for p in pipes
                                                 if k in p["actions"]]) for k in kinds},
                       "chunk_action_ms": {k: _median([p["chunk_actions"][k][0] / p["chunk_actions"][k][1] * 1e3
                                                       for p in pipes if k in p.get("chunk_actions", {})])
                                           for k in sorted({k for p in pipes for k in p.get("chunk_actions", {})})}})
    # makespan idle per stage: the longest window of the step minus the stage's own compute
    per_step = list(zip(*(extras[r] for r in range(len(coords)))))
    for s, st in enumerate(stages):
        ranks = [r for r, c in enumerate(coords) if c[0] == s]
        st["makespan_idle_ms"] = _median([
            (max(e["pipe"]["window_s"] for e in step) - sum(v[0] for v in step[r]["pipe"]["actions"].values())) * 1e3
            for step in per_step for r in ranks])
    row["stages"] = stages
    row["p2p_latency_ms"] = p2p_latency_ms(per_step)
    row["per_step_pipe"] = per_step_pipe(per_step, coords)
    row["start_offset_ms"] = start_offsets_ms(row["per_step_pipe"])
    comm: Dict[str, Any] = {}
    for mode in sorted({m for ex in extras for e in ex for m in e.get("comm", {})}):
        exp = [e["comm"][mode]["exposed_s"] * 1e3 for ex in extras for e in ex if mode in e.get("comm", {})]
        fl = [e["comm"][mode]["time_s"] * 1e3 for ex in extras for e in ex if mode in e.get("comm", {})]
        comm[mode] = {"exposed_ms": _median(exp), "exposed_q_ms": [stats(exp)["q1_s"], stats(exp)["q3_s"]],
                      "in_flight_ms": _median(fl), "n": len(exp)}
    row["comm"] = comm
    return row


def p2p_latency_ms(per_step: List[tuple]) -> Dict[str, Any]:
    """The time a message takes on the wire as the schedule sees it: over every message whose
    consumer was already waiting when the producer posted it, consumer compute start minus
    the producer's post (the transfer, gloo's hand-off and the waiting thread's wake-up);
    median, quartiles and count over the steps."""
    samples = []
    for step in per_step:
        sent, recv = {}, {}
        for e in step:
            msgs = e["pipe"].get("messages") or {}
            sent.update(msgs.get("sent", {}))
            recv.update(msgs.get("recv", {}))
        samples += [(start - sent[k]) * 1e3 for k, (wait, start) in recv.items() if k in sent and wait < sent[k]]
    if not samples:
        return {"median": 0.0, "n": 0}
    st = stats([x / 1e3 for x in samples])
    return {"median": st["median_s"] * 1e3, "q": [st["q1_s"] * 1e3, st["q3_s"] * 1e3], "n": len(samples)}


def _formulas(row: Dict[str, Any], kind: str, vpp: int, m: int) -> None:
    """Bubble formulas at this side's measured per-action costs (mean over stages)."""
    acts = [st["action_ms"] for st in row["stages"]]
    f = _median([a.get("F", float("nan")) for a in acts]) / 1e3
    b = _median([a.get("B", float("nan")) for a in acts]) / 1e3
    w = _median([a["W"] for a in acts if "W" in a]) / 1e3 if any("W" in a for a in acts) else 0.0
    pp = len(acts)
    row["costs_ms"] = {"F": f * 1e3, "B": b * 1e3, "W": w * 1e3}
    form = closed_form(kind, vpp, pp, f, b, w)
    row["closed_form_ms"] = None if form is None else form.seconds * 1e3
    row["closed_form"] = None if form is None else form.describe()
    # the same form at each stage's own per-action costs (stage 0 holds the embedding, the last
    # stage, or zbv's stage 0, the head): a stage slower than the pooled figure bounds the others
    at_stage = [closed_form(kind, vpp, pp, a.get("F", float("nan")) / 1e3, a.get("B", float("nan")) / 1e3,
                            a.get("W", 0.0) / 1e3) for a in acts]
    row["closed_form_stage_ms"] = [None if x is None else x.seconds * 1e3 for x in at_stage]
    try:
        tt = timed_table(kind, pp, vpp, m, f, b, w)
        row["timed_table_ms"] = {k: [x * 1e3 for x in v] for k, v in tt.items()}
    except Exception as exc:  # a kind the timed run does not know: say so in the report
        row["timed_table_ms"] = {"error": f"{type(exc).__name__}: {exc}"}
    # The same table with each stage's own per-chunk costs (stage 0's chunks hold the
    # embedding, the last ones the head and loss; zbv's stage 0 holds both), each action
    # occupying its stage for its compute plus the stage's measured gap per action (what the
    # executor does between computes), and the measured p2p latency: what the goal "measured
    # bubble within 25% of the formula given the measured F, B, W" compares with.
    per = [st.get("chunk_action_ms", {}) for st in row["stages"]]
    gaps = [st.get("gap_per_action_ms", 0.0) / 1e3 for st in row["stages"]]
    pooled = {"F": f, "B": b, "W": w}

    def cost_of(kind_: str, stage: int, vchunk: int) -> float:
        x = per[stage].get(f"{kind_}{vchunk}")
        return (pooled[kind_] if x is None or x != x else x / 1e3) + gaps[stage]

    latency = row.get("p2p_latency_ms", {}).get("median", 0.0) / 1e3
    offsets = row.get("start_offset_ms")
    start = [x / 1e3 for x in offsets] if offsets else None
    row["costs_chunk_ms"] = per
    try:
        tt = timed_table(kind, pp, vpp, m, f, b, w, cost_of=cost_of, latency=latency, start=start)
        row["timed_chunk_ms"] = {k: [x * 1e3 for x in v] for k, v in tt.items()}
    except Exception as exc:
        row["timed_chunk_ms"] = {"error": f"{type(exc).__name__}: {exc}"}
    # The same table once per step, with that step's own per-chunk costs, gaps and start
    # offsets: a stage waits when the other is late, so the bubble is convex in the offsets
    # and costs, and the table at their medians under-predicts the median bubble when they
    # spread (which stage enters later, and by how much, changes from step to step).
    steps = row.get("per_step_pipe") or []
    if steps:
        predicted: List[List[float]] = [[] for _ in range(pp)]
        for st in steps:
            first = min(x["started"] for x in st)

            def step_cost(kind_: str, stage: int, vchunk: int, st=st) -> float:
                x = st[stage]["chunk_ms"].get(f"{kind_}{vchunk}")
                return (cost_of(kind_, stage, vchunk) - gaps[stage] if x is None else x / 1e3) + st[stage]["gap_ms"] / 1e3

            try:
                tt = timed_table(kind, pp, vpp, m, f, b, w, cost_of=step_cost, latency=latency,
                                 start=[x["started"] - first for x in st])
            except Exception as exc:
                row["timed_step_ms"] = {"error": f"{type(exc).__name__}: {exc}"}
                break
            for s_, x in enumerate(tt["in_window_s"]):
                predicted[s_].append(x * 1e3)
        else:
            row["timed_step_ms"] = {"in_window_s": [_median(p) for p in predicted], "steps": len(steps)}


def summarize(gathered: List[Dict[str, Any]], order: List[str], args) -> Dict[str, Any]:
    coords = [g["coords"] for g in gathered]
    blocks = [g["blocks"] for g in gathered]
    out: Dict[str, Any] = {"variants": {}, "variants_quiet": {}, "quiet_threshold_cores": args.quiet_cores,
                           "block_foreign_cores": [round(b["foreign_cores"], 3) for b in blocks[0]],
                           "first_loss": {k: [g["first_loss"][k] for g in gathered] for k in order}}
    for name in order:
        out["variants"][name] = row = _side(blocks, name, coords)
        quiet = [i for i, b in enumerate(blocks[0]) if b["name"] == name and b["foreign_cores"] <= args.quiet_cores]
        if quiet:
            out["variants_quiet"][name] = _side([[bl[i] for i in quiet] for bl in blocks], name, coords)
        side, kind, m = split_name(name)
        if side == "mpo" and "stages" in row and m is not None:
            vpp = int(next(x.split("=")[1] for x in args_overrides(args, name) if x.startswith("parallel.vpp=")))
            row["kind"], row["vpp"], row["m"] = kind, vpp, m
            _formulas(row, kind, vpp, m)
    return out


def args_overrides(args, name: str) -> List[str]:
    from bench.zero_bubble import scenario_overrides

    return scenario_overrides(args)["variants"][name]


# ---- activation memory (bench/memory.py's method) ----------------------------------------------
def memory_layouts(args, m: int) -> Dict[str, List[str]]:
    """{name: mpoverlap-train overrides} of the activation-memory runs: one per schedule kind
    pp 2 can run at `m` microbatches, on the benchmark's model."""
    from bench.zero_bubble import COMMON, model_overrides, schedule_vpp
    from mpoverlap.pipeline.schedules import SCHEDULE_KINDS

    run_keys = ("train.steps", "checkpoint", "data.", "train.progress")  # bench.common.run_train sets these
    layouts = {}
    for kind in SCHEDULE_KINDS:
        vpp = schedule_vpp(kind, 2, m, args.layers)
        if vpp is not None:
            layouts[f"zb_{kind}_m{m}"] = [o for o in COMMON if not o.startswith(run_keys)] + [
                "parallel.pp=2", f"parallel.vpp={vpp}", f"parallel.pp_schedule={kind}",
                f"train.global_batch_size={args.micro_batch * m}"] + model_overrides(args)
    return layouts


def memory_runs(args, out: Path, m: int, steps: int = 3) -> Dict[str, Any]:
    """Peak RSS of one short mpoverlap-train run per schedule kind at `m` microbatches and of
    its near-empty baseline (bench/memory.py), the activations per rank against the estimate."""
    from bench import memory

    layouts = memory_layouts(args, m)
    memory.LAYOUTS.update(layouts)  # memory.run takes its layouts by name from memory.LAYOUTS
    res = memory.run(list(layouts), steps, out)
    for r in res["layouts"].values():
        r["activations"] = memory.activation_rows(r)
    return res


# ---- results.md --------------------------------------------------------------------------------
def _ms(x: Optional[float]) -> str:
    return "-" if x is None or x != x else f"{x:.1f}"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.3f}" if a and b else "-"


def render(results: Dict[str, Any]) -> str:
    zb = results.get("zero_bubble")
    if not zb:
        return ""
    lines: List[str] = []
    sched = zb.get("schedules")
    if sched:
        s, v = sched["setup"], sched["variants"]
        lines += ["## Zero-bubble pipeline schedules, pp=2", "", f"Link: {sched['link']}.",
                  f"Overrides: `{' '.join(sched['base_overrides'])}`; model hidden {s['hidden']}, ffn {s['ffn']}, seq "
                  f"{s['seq']}, {s['layers']} layers, micro batch {s['micro_batch']}; blocks of {s['block']} steps "
                  f"(first {s['block_warmup']} discarded), all sides rotating in the same two processes; step time = "
                  "slowest rank; all blocks used (the quiet ones are in results.json).", "",
                  "| side | m | vpp | median step (ms) | IQR (ms) | F / B / W per action (ms) | pp_bubble_s per stage "
                  "(ms) | timed table, same F/B/W (ms) | measured / table | timed table per step (its per-chunk costs "
                  "and stage start offsets, the p2p latency; median over steps, ms) | measured / that | makespan idle per stage (ms) | closed form at the pooled F/B/W; at each stage's own (ms) |",
                  "|---|---:|---:|---:|---:|---|---|---|---|---|---|---|---:|"]
        for name, row in v.items():
            side, kind, m = split_name(name)
            st = row["step"]
            label = KIND_LABEL.get(kind, kind) if side == "mpo" else TORCH_LABEL.get(kind, kind)
            if "stages" not in row:
                lines.append(f"| {label} | {m} | - | {_ms(st['median_s'] * 1e3)} | {_ms(st['q1_s'] * 1e3)}-"
                             f"{_ms(st['q3_s'] * 1e3)} | - | - | - | - | - | - | - | - |")
                continue
            c = row.get("costs_ms", {})
            tt = row.get("timed_table_ms", {})
            bub = [x["bubble_ms"] for x in row["stages"]]
            table = tt.get("in_window_s")
            ratio = " / ".join(f"{a / b:.2f}" if b > 1e-6 else "-" for a, b in zip(bub, table)) if table else "-"
            chunk = (row.get("timed_step_ms") or row.get("timed_chunk_ms") or {}).get("in_window_s")
            ratio_c = " / ".join(f"{a / b:.2f}" if b > 1e-6 else "-" for a, b in zip(bub, chunk)) if chunk else "-"
            lat = row.get("p2p_latency_ms", {})
            offsets = row.get("start_offset_ms")
            late = (", starts +" + " / +".join(f"{x:.1f}" for x in offsets)) if offsets else ""
            chunk_s = (" / ".join(_ms(x) for x in chunk) + f" (lat {lat.get('median', 0.0):.1f}{late})") if chunk else "-"
            lines.append(
                f"| {label} | {m} | {row.get('vpp', '-')} | {_ms(st['median_s'] * 1e3)} | {_ms(st['q1_s'] * 1e3)}-"
                f"{_ms(st['q3_s'] * 1e3)} | {_ms(c.get('F'))} / {_ms(c.get('B'))} / {_ms(c.get('W'))} | "
                f"{' / '.join(_ms(x) for x in bub)} | {' / '.join(_ms(x) for x in table) if table else tt.get('error', '-')}"
                f" | {ratio} | {chunk_s} | {ratio_c} | {' / '.join(_ms(x['makespan_idle_ms']) for x in row['stages'])} | "
                f"{_ms(row.get('closed_form_ms'))}; {' / '.join(_ms(x) for x in row.get('closed_form_stage_ms') or [])}"
                f"{' (' + row['closed_form'] + ')' if row.get('closed_form') else ''} |")
        lines += ["", _ratios_line(v), "", _bubble_line(v), ""]
        fl = sched.get("first_loss", {})
        if fl:
            last = {k: max(vals, key=abs) for k, vals in fl.items()}
            lines += ["First-step loss (last stage): " + "; ".join(f"{k} {x:.6f}" for k, x in last.items()) + ".", ""]
    mems = zb.get("memory") or []
    for mem in mems if isinstance(mems, list) else [mems]:  # one dict per m (older results: one)
        lines += [f"Peak activation memory per rank at m = {mem['m']} (bench/memory.py's method: RSS - baseline RSS "
                  "- the estimate's weights, gradients and optimizer; MALLOC_MMAP_THRESHOLD_=131072):", "",
                  "| schedule | rank (stage) | measured (MiB) | estimate (MiB) | measured / estimate | vs 1F1B, same rank |",
                  "|---|---|---:|---:|---:|---:|"]
        rows = mem["runs"]["layouts"]
        ref = rows.get(f"zb_1f1b_m{mem['m']}", {}).get("activations")
        for name, r in rows.items():
            for a in r["activations"]:
                vs = _ratio(a["measured"], ref[a["rank"]]["measured"]) if ref else "-"
                lines.append(f"| {name[3:].rsplit('_m', 1)[0]} | {a['rank']} ({a['stage']}) | {a['measured'] / 2**20:.1f} | "
                             f"{a['estimate'] / 2**20:.1f} | {a['ratio']:.2f} | {vs} |")
        lines += ["", peak_line(rows, mem["m"]), ""]
    tpw = zb.get("tp_wgrad")
    if tpw:
        v = tpw["variants"]
        lines += ["## Exposed tp with and without W deferral: tp 2 + SP, collective matmul, pp 2 (world 4)", "",
                  f"Link: {tpw['link']}. Overrides: `{' '.join(tpw['base_overrides'])}`; 4 ranks on the 2 cores; "
                  "medians over every kept step of every rank, IQR beside.", "",
                  "| schedule | median step (ms) | step IQR (ms) | tp exposed (ms/step/rank) | IQR | tp in flight (ms) | "
                  "pp_bubble_s per stage (ms) |", "|---|---:|---:|---:|---:|---:|---|"]
        for name, row in v.items():
            st, tp = row["step"], row.get("comm", {}).get("tp", {})
            lines.append(f"| {name[4:]} | {_ms(st['median_s'] * 1e3)} | {_ms(st['q1_s'] * 1e3)}-{_ms(st['q3_s'] * 1e3)} | "
                         f"{_ms(tp.get('exposed_ms'))} | {'-'.join(_ms(x) for x in tp.get('exposed_q_ms', []))} | "
                         f"{_ms(tp.get('in_flight_ms'))} | {' / '.join(_ms(x['bubble_ms']) for x in row.get('stages', []))} |")
        lines.append("")
    return "\n".join(lines)


def peak_line(rows: Dict[str, Any], m: int) -> str:
    """The pipeline's activation peak (the larger rank) of each schedule against 1F1B's, measured
    and estimated (goal for the zero-bubble kinds: within 10% of 1F1B's)."""
    ref = rows.get(f"zb_1f1b_m{m}")
    if not ref:
        return ""
    def peak(r, key):
        return max(a[key] for a in r["activations"])
    parts = []
    for name, r in rows.items():
        kind = name[3:].rsplit("_m", 1)[0]
        if kind == "1f1b":
            continue
        ratio = peak(r, "measured") / max(peak(ref, "measured"), 1)
        goal = f" (goal <= 1.10: {'met' if ratio <= 1.10 else 'NOT met'})" if kind.startswith("zb") else ""
        parts.append(f"{kind} {ratio:.2f}{goal}, estimate {peak(r, 'estimate') / max(peak(ref, 'estimate'), 1):.2f}")
    return f"Activation peak over the ranks against 1F1B's at m = {m} (measured; estimated): " + "; ".join(parts) + "."


def _bubble_line(v: Dict[str, Any]) -> str:
    """Measured pp_bubble_s against the timed table at the measured costs, per stage (goal:
    within 25%): the table run once per step with that step's per-stage, per-chunk F, B, W and
    stage start offsets and the measured p2p latency, its median over the steps (the formula
    given the measured costs); beside it the one table at the median costs and offsets and the
    pooled-cost free-p2p table."""
    parts = []
    for name, row in v.items():
        table = (row.get("timed_step_ms") or row.get("timed_chunk_ms") or {}).get("in_window_s")
        pooled = row.get("timed_table_ms", {}).get("in_window_s")
        medians = row.get("timed_chunk_ms", {}).get("in_window_s") if row.get("timed_step_ms") else None
        if not table:
            continue
        ratios = [st["bubble_ms"] / t for st, t in zip(row["stages"], table) if t > 1e-6]
        ok = all(abs(r - 1) <= 0.25 for r in ratios)

        def against(t_):
            return (" / ".join(f"{st['bubble_ms'] / t:.2f}" if t > 1e-6 else "-" for st, t in zip(row["stages"], t_))
                    if t_ else "-")
        more = f"; one table at the median costs and offsets {against(medians)}" if medians else ""
        parts.append(f"{name[4:]} {' / '.join(f'{r:.2f}' for r in ratios)} ({'met' if ok else 'NOT met'}{more}; pooled "
                     f"free-p2p table {against(pooled)})")
    return ("Measured bubble over the timed table's (run once per step with that step's per-stage, per-chunk costs "
            "and start offsets, and the measured p2p latency; medians over the steps), per "
            "stage (goal: within 25%): " + "; ".join(parts) + ".") if parts else ""


def _ratios_line(v: Dict[str, Any]) -> str:
    step = {n: r["step"]["median_s"] for n, r in v.items()}
    parts = []
    for m in sorted({split_name(n)[2] for n in v if split_name(n)[2] is not None}):
        def s(name):
            return step.get(f"{name}_m{m}")
        for a, b, goal in (("mpo_zb1p", "mpo_1f1b", 0.92), ("mpo_zbv", "mpo_interleaved", 0.95)):
            if s(a) and s(b):
                r = s(a) / s(b)
                parts.append(f"m={m}: {a[4:]}/{b[4:]} {r:.3f} (goal <= {goal}: {'met' if r <= goal else 'NOT met'})")
        for kind in ("1f1b", "zb1p", "zbv"):
            if s(f"mpo_{kind}") and s(f"torch_{kind}"):
                r = s(f"mpo_{kind}") / s(f"torch_{kind}")
                parts.append(f"m={m}: ours/torch {kind} {r:.3f} (goal <= 1: {'met' if r <= 1 else 'NOT met'})")
    return "Ratios of median steps: " + "; ".join(parts) + "." if parts else ""
