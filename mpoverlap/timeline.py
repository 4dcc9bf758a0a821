"""mpoverlap-timeline <run.dir> [--out PNG] [--steps N]: draw a profiled run's timeline.

Reads `<run.dir>/timeline/rank<R>.jsonl` (written by runs with train.profile=true, format in
mpoverlap/training/profiling.py) and draws one band per rank, one lane per lane kind:

- compute: time inside a step not blocked in a wait (what the ledger does not call exposed);
- one lane per communication mode (dp/tp/pp/cp/ep): light bars where at least one handle of
  the mode is in flight (issue -> completion; their union is the ledger's `time_s`), strong
  hatched bars where compute sat blocked in its post or wait (the ledger's `exposed_s`);
- pipelined runs: a "pp actions" lane with each pipeline action's compute (its span minus the
  rank's blocked spans), labelled with its microbatch: F forward; B the full backward
  (1F1B, interleaved); B with W deferred (zero-bubble schedules: the input gradient only,
  another colour); W the deferred weight gradients.

Vertical lines mark step boundaries; x is milliseconds from the earliest step start over all
ranks (ranks are lined up on Unix time, exact on one host). Default output:
`<run.dir>/timeline.png`. Exit 0 drawn, 2 no timeline in the run dir, 1 matplotlib missing.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mpoverlap.comm.handle import MODES
from mpoverlap.comm.ledger import union_length

Span = Tuple[float, float]  # (start, end), seconds

# (in flight, exposed) colours per mode: a light and a saturated shade of one hue.
MODE_COLOURS = {"dp": ("#9ecae1", "#08519c"), "tp": ("#fdd0a2", "#d94801"), "pp": ("#dadaeb", "#54278f"),
                "cp": ("#a1d99b", "#006d2c"), "ep": ("#fcbba1", "#a50f15"), "stop": ("#d9d9d9", "#525252")}
COMPUTE_COLOUR = "#969696"
# Pipeline actions: (colour, legend) per shown kind; "B-input" is a B whose W was deferred.
ACTION_STYLE = {"F": ("#4292c6", "F: forward"),
                "B": ("#cb181d", "B: full backward (input and weight gradients)"),
                "B-input": ("#fd8d3c", "B: input gradient only (its W deferred)"),
                "W": ("#31a354", "W: deferred weight gradients")}


@dataclass
class RankTimeline:
    """One rank's profiled window; all times in seconds on a clock shared by the ranks."""

    rank: int
    coords: Dict[str, int] = field(default_factory=dict)  # {"tp", "cp", "dp", "pp", "ep"}
    steps: List[dict] = field(default_factory=list)  # {"step", "begin", "end"}
    comms: List[dict] = field(default_factory=list)  # {"step", "mode", "op", "bytes", ...}
    actions: List[dict] = field(default_factory=list)  # {"step", "action", "microbatch", "vchunk", "begin", "end"}

    def modes(self) -> List[str]:
        return [m for m in MODES if any(c["mode"] == m for c in self.comms)]

    def in_flight(self, mode: str) -> List[Span]:
        return merge([(c["issued_at"], c["completed_at"]) for c in self.comms if c["mode"] == mode])

    def exposed(self, mode: Optional[str] = None) -> List[Span]:
        """Blocked spans (of `mode`, or of every mode), merged: in the wait, and on CPU in the
        post (from issue to `post_end`, see comm/handle.py)."""
        mine = [c for c in self.comms if mode is None or c["mode"] == mode]
        return merge([(c["wait_begin"], c["wait_end"]) for c in mine
                      if c["wait_begin"] is not None and c["wait_end"] > c["wait_begin"]]
                     + [(c["issued_at"], c["post_end"]) for c in mine if c.get("post_end") is not None])

    def shown_actions(self) -> List[Tuple[str, dict]]:
        """(shown kind, action) per pipeline action: a B whose (step, microbatch, vchunk) has a
        W is shown as "B-input" (it computed the input gradient only)."""
        deferred = {(a["step"], a["microbatch"], a["vchunk"]) for a in self.actions if a["action"] == "W"}
        return [("B-input" if a["action"] == "B" and (a["step"], a["microbatch"], a["vchunk"]) in deferred
                 else a["action"], a) for a in self.actions]

    def compute(self) -> List[Span]:
        """Step time minus every blocked span: when this rank was free to compute."""
        waits = self.exposed()
        return [piece for s in self.steps for piece in subtract((s["begin"], s["end"]), waits)]


def merge(spans: Sequence[Span]) -> List[Span]:
    """Sorted union of possibly overlapping spans."""
    out: List[Span] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def subtract(span: Span, holes: Sequence[Span]) -> List[Span]:
    """`span` with the merged, sorted `holes` cut out."""
    pieces, cursor = [], span[0]
    for start, end in holes:
        if end <= cursor or start >= span[1]:
            continue
        if start > cursor:
            pieces.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < span[1]:
        pieces.append((cursor, span[1]))
    return pieces


class NoTimelineError(FileNotFoundError):
    """The run directory holds no timeline files."""


def load(run_dir: Path, max_steps: Optional[int] = None) -> List[RankTimeline]:
    """Every rank's timeline, times moved onto Unix seconds; only the first `max_steps`
    profiled steps when given (handles outside them are dropped)."""
    files = sorted((run_dir / "timeline").glob("rank*.jsonl"), key=lambda p: int(p.stem[4:] or 0))
    if not files:
        raise NoTimelineError(
            f"{run_dir} has no communication timeline: expected {run_dir / 'timeline'}/rank<R>.jsonl, "
            "which runs write only with profiling on. Rerun the training with "
            f"`train.profile=true` (window: train.profile_start_step=2 train.profile_steps=3 by default), "
            f"e.g. `mpoverlap-train <your overrides> run.dir={run_dir} train.profile=true "
            "checkpoint.resume=none`, then run `mpoverlap-timeline` on that run directory again.")
    ranks = []
    for path in files:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        meta = next((r for r in rows if r["kind"] == "meta"), {"rank": int(path.stem[4:]), "unix_offset_s": 0.0})
        off = float(meta.get("unix_offset_s", 0.0))
        tl = RankTimeline(rank=int(meta["rank"]), coords=dict(meta.get("coords") or {}))
        for r in rows:
            if r["kind"] == "step":
                tl.steps.append({"step": r["step"], "begin": r["begin"] + off, "end": r["end"] + off})
            elif r["kind"] == "action":
                tl.actions.append(dict(r, begin=r["begin"] + off, end=r["end"] + off))
            elif r["kind"] == "comm":
                c = dict(r)
                for key in ("issued_at", "completed_at", "wait_begin", "wait_end", "post_end"):
                    if c.get(key) is not None:
                        c[key] += off
                tl.comms.append(c)
        ranks.append(tl)
    if max_steps is not None:
        keep = sorted({s["step"] for tl in ranks for s in tl.steps})[:max_steps]
        for tl in ranks:
            tl.steps = [s for s in tl.steps if s["step"] in keep]
            tl.comms = [c for c in tl.comms if c["step"] in keep]
            tl.actions = [a for a in tl.actions if a["step"] in keep]
    return ranks


def summary_lines(ranks: Sequence[RankTimeline]) -> List[str]:
    """Per rank and mode: handles, bytes, in-flight (union) and exposed milliseconds."""
    out = []
    for tl in ranks:
        for mode in tl.modes():
            mine = [c for c in tl.comms if c["mode"] == mode]
            in_flight = union_length(tl.in_flight(mode)) * 1e3
            exposed = sum(c["exposed_s"] for c in mine) * 1e3
            out.append(f"rank {tl.rank} {mode}: {len(mine)} handles, {sum(c['bytes'] for c in mine)} B, "
                       f"in flight {in_flight:.2f} ms, exposed {exposed:.2f} ms")
        if tl.actions:
            waits = tl.exposed()
            parts = []
            for kind in ACTION_STYLE:
                mine = [a for k, a in tl.shown_actions() if k == kind]
                if mine:
                    busy = sum(e - b for a in mine for b, e in subtract((a["begin"], a["end"]), waits)) * 1e3
                    parts.append(f"{len(mine)} {kind} ({busy:.2f} ms)")
            out.append(f"rank {tl.rank} pp actions: " + ", ".join(parts))
    return out


def rank_labels(ranks: Sequence[RankTimeline]) -> Dict[int, str]:
    """`rank 2 (dp0 pp1)`: the grid coordinates that differ between the drawn ranks."""
    dims = [d for d in ("tp", "cp", "dp", "pp", "ep") if len({tl.coords.get(d, 0) for tl in ranks}) > 1]
    return {tl.rank: f"rank {tl.rank}" + (f" ({' '.join(f'{d}{tl.coords[d]}' for d in dims)})" if dims else "")
            for tl in ranks}


def draw(ranks: Sequence[RankTimeline], out: Path, title: str) -> None:
    """Render the lanes of every rank to a PNG at `out`."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("mpoverlap-timeline draws with matplotlib, which is not installed: "
                          "pip install matplotlib (or pip install 'mpoverlap[plot]')") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(s["begin"] for tl in ranks for s in tl.steps)
    t1 = max(s["end"] for tl in ranks for s in tl.steps)
    ms = lambda spans: [((a - t0) * 1e3, (b - a) * 1e3) for a, b in spans]  # noqa: E731
    modes = [m for m in MODES if any(m in tl.modes() for tl in ranks)]
    pipelined = any(tl.actions for tl in ranks)
    lanes = ["compute"] + (["pp actions"] if pipelined else []) + modes
    band_gap = 0.7
    height = len(ranks) * (len(lanes) + band_gap)
    fig_h = 1.4 + 0.42 * height  # inches: lanes plus title, axis and legend rows
    fig, ax = plt.subplots(figsize=(15, fig_h))
    yticks, ylabels = [], []
    names = rank_labels(ranks)
    for band, tl in enumerate(ranks):
        top = height - band * (len(lanes) + band_gap)  # bands from the top, rank 0 first
        lane_y = {lane: top - 1 - i for i, lane in enumerate(lanes)}
        if band % 2 == 0:  # a faint backdrop tells the bands apart
            ax.axhspan(top - len(lanes) - band_gap / 2, top + band_gap / 2, color="#f4f4f4", zorder=0)
        ax.broken_barh(ms(tl.compute()), (lane_y["compute"] + 0.2, 0.6), facecolors=COMPUTE_COLOUR, zorder=2)
        if pipelined:
            draw_actions(ax, tl, lane_y["pp actions"], t0, (t1 - t0) * 1e3)
        for mode in modes:
            light, strong = MODE_COLOURS[mode]
            y = lane_y[mode]
            ax.broken_barh(ms(tl.in_flight(mode)), (y + 0.25, 0.5), facecolors=light, edgecolor=light,
                           linewidth=0.5, zorder=2)
            # The hatch takes the edge colour: white lines on the strong fill. No edge line, so
            # sub-pixel waits still show as a sliver of the fill.
            ax.broken_barh(ms(tl.exposed(mode)), (y + 0.1, 0.8), facecolors=strong, edgecolor="white",
                           linewidth=0, hatch="////", zorder=3)
            mine = [c for c in tl.comms if c["mode"] == mode]
            ax.annotate(f"{sum(c['exposed_s'] for c in mine) * 1e3:.1f} / {union_length(tl.in_flight(mode)) * 1e3:.1f} ms",
                        (1.003, y + 0.5), xycoords=("axes fraction", "data"), va="center", fontsize=7)
        for s in tl.steps:  # step boundaries, over this rank's band only
            for x in (s["begin"], s["end"]):
                ax.vlines((x - t0) * 1e3, top - len(lanes), top, colors="black", linewidth=0.8,
                          linestyles="--", zorder=4)
            if band == 0:  # step numbers once, above the top band
                ax.text(((s["begin"] + s["end"]) / 2 - t0) * 1e3, top + 0.1, f"step {s['step']}",
                        ha="center", va="bottom", fontsize=9)
        for lane, y in lane_y.items():
            yticks.append(y + 0.5)
            ylabels.append(f"{names[tl.rank]}  {lane}" if lane == "compute" else lane)
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_ylim(-band_gap / 2, height + 0.8)
    ax.set_xlim(-0.01 * (t1 - t0) * 1e3, 1.01 * (t1 - t0) * 1e3)
    ax.set_xlabel("milliseconds since the first profiled step began")
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_title("right: exposed / in flight", fontsize=7, loc="right")
    handles = [Patch(facecolor=COMPUTE_COLOUR, label="compute (in step, not blocked)")]
    shown = {k for tl in ranks for k, _ in tl.shown_actions()}
    handles += [Patch(facecolor=c, label=label) for k, (c, label) in ACTION_STYLE.items() if k in shown]
    for mode in modes:
        light, strong = MODE_COLOURS[mode]
        handles += [Patch(facecolor=light, label=f"{mode} in flight"),
                    Patch(facecolor=strong, hatch="////", edgecolor="white", label=f"{mode} exposed (blocked in post or wait)")]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
    ax.grid(axis="x", color="#dddddd", linewidth=0.5, zorder=1)
    legend_rows = -(-len(handles) // 5)
    fig.tight_layout(rect=(0, (0.1 + 0.22 * legend_rows) / fig_h, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def draw_actions(ax: Any, tl: RankTimeline, y: float, t0: float, width_ms: float) -> None:
    """The rank's pipeline actions on lane `y`: each one's compute (its span minus the blocked
    spans), coloured by ACTION_STYLE, its microbatch written in where the bar is wide enough."""
    waits = tl.exposed()
    for kind, a in tl.shown_actions():
        pieces = subtract((a["begin"], a["end"]), waits)
        if not pieces:
            continue
        colour = ACTION_STYLE.get(kind, (COMPUTE_COLOUR, kind))[0]
        bars = [((p0 - t0) * 1e3, (p1 - p0) * 1e3) for p0, p1 in pieces]
        ax.broken_barh(bars, (y + 0.15, 0.7), facecolors=colour, edgecolor="white", linewidth=0.4, zorder=2)
        start, length = max(bars, key=lambda bar: bar[1])
        if length > 0.012 * width_ms:
            tag = f"{a['action']}{a['microbatch']}" + (f".{a['vchunk']}" if a["vchunk"] else "")
            ax.text(start + length / 2, y + 0.5, tag, ha="center", va="center", fontsize=6, color="white", zorder=3)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mpoverlap-timeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory of a run with train.profile=true")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: <run_dir>/timeline.png)")
    parser.add_argument("--steps", type=int, default=None, help="draw only the first N profiled steps")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: give a number of steps >= 1")
    try:
        ranks = load(args.run_dir, args.steps)
    except NoTimelineError as exc:
        print(f"mpoverlap-timeline: {exc}", file=sys.stderr)
        return 2
    ranks = [tl for tl in ranks if tl.steps]
    if not ranks:
        print(f"mpoverlap-timeline: {args.run_dir / 'timeline'} holds no completed step; the profiled "
              "run stopped before its window ended. Rerun with train.profile=true.", file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "timeline.png"
    first = min(s["step"] for tl in ranks for s in tl.steps)
    last = max(s["step"] for tl in ranks for s in tl.steps)
    title = f"{args.run_dir.resolve().name}: steps {first}..{last}, {len(ranks)} rank(s)"
    try:
        draw(ranks, out, title)
    except ImportError as exc:
        print(f"mpoverlap-timeline: {exc}", file=sys.stderr)
        return 1
    print("\n".join(summary_lines(ranks)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
