"""EP at 1:1 in the pipeline: zbv, zbv + pairing, interleaved + pairing,
interleaved, at pp 2 with m = 8 microbatches, in one run.

The scenario of bench/ep_pairing.py (moe_tiny reshaped into a fine-grained MoE: 32 experts
top-8 of width 320, hidden 512, seq 128, micro batch 2, forced load balancing; its exchanges
take about as long as its experts on the 2 Gbit/s link) at parallel.pp=2 x vpp 2 (4 MoE layers,
one per model chunk) x dp 2 x ep 2: 4 gloo ranks, so on a 2-core machine TWO RANKS SHARE EACH
CORE. Every variant is built once and stepped in rotating blocks (bench.common.rotating_blocks);
a step's time is the slowest of the 4 ranks.

  zbv              parallel.pp_schedule=zbv         overlap.ep_pairing=false
  zbv_pairing      parallel.pp_schedule=zbv         overlap.ep_pairing=true   (the paired V)
  interleaved_pairing  parallel.pp_schedule=interleaved overlap.ep_pairing=true
  interleaved      parallel.pp_schedule=interleaved overlap.ep_pairing=false

All with overlap.ep=true overlap.ep_chunks=1 (as bench.ep_pairing's "pairing" variant: the
exchanges hide under the other microbatch, not under the layer's own chunks), overlap.pp=true.
Per variant: median step and interquartile range, the ledger's ep in flight and exposed per step
and rank, its exposed share, the pipeline bubble (the executors' blocked time), the cores each
rank used (its process CPU over the block's wall time), and the simulator's prediction beside
each (bench.ep_pairing.predict_variants: the paired tables at pp > 1, the model's and the
experts' rates timed in the rounds by a rate probe (bench/rate_probe.py, one block per round on
all 4 ranks at once, as the variants), and the 4 ranks' sharing of this machine's cores).

    bash bench/netns.sh .venv/bin/python -m bench.ep_pairing_pp [--block 3] [--repeats 3] [--json F]

The simulator again on a saved result (its rates), at other microbatch counts, with this
machine's shared cores and with a core per rank (no measuring):

    bash bench/netns.sh .venv/bin/python -m bench.ep_pairing_pp --predict-from F [--microbatches-list 4,8,16]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from bench.common import TrainerSide, add_block_args, close_trainers, free_port, init_bench_worker, rotating_blocks, \
    stats
from bench.ep_pairing import COMMON as EP_COMMON

WORLD = 4
PROBE = "rate_probe"
VARIANTS = {"zbv": ("zbv", False), "zbv_pairing": ("zbv", True), "interleaved_pairing": ("interleaved", True),
            "interleaved": ("interleaved", False)}
DEFAULTS = dict(hidden=512, ffn=320, seq=128, layers=4, micro_batch=2, microbatches=8, experts=32, top_k=8)


def base_overrides(args) -> List[str]:
    return EP_COMMON + ["model.moe_router_force_load_balancing=true", "model.tie_embeddings=false",
                        "parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "overlap.pp=true",
                        "overlap.ep=true", "overlap.ep_chunks=1",
                        f"model.hidden_size={args.hidden}", f"model.moe_ffn_hidden_size={args.ffn}",
                        f"model.seq_length={args.seq}", f"model.num_layers={args.layers}",
                        f"train.micro_batch_size={args.micro_batch}", f"model.num_experts={args.experts}",
                        f"model.moe_top_k={args.top_k}",
                        f"train.global_batch_size={args.micro_batch * args.microbatches * 2}"]


def variant_overrides() -> Dict[str, List[str]]:
    return {name: [f"parallel.pp_schedule={kind}", f"overlap.ep_pairing={'true' if pair else 'false'}"]
            for name, (kind, pair) in VARIANTS.items()}


class _Side(TrainerSide):
    """A Trainer; per step the ledger's figures and the executor's blocked time."""

    def collect(self, keep: bool) -> Dict[str, Any]:
        return {**super().collect(keep), "bubble_s": self.t.pipeline.executor.bubble_s}


def _worker(rank: int, port: int, args, tmp: str) -> None:
    init_bench_worker(rank, port, WORLD)
    import torch.distributed as dist

    from bench.rate_probe import ModelRateSide, summarize as rate_summary
    from mpoverlap.config import compose
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    sides: Dict[str, Any] = {}
    try:
        base, state = base_overrides(args), None
        for name, extra in variant_overrides().items():
            cfg = compose(base + extra + [f"run.dir={tmp}/{name}"])
            state = state or init_distributed(cfg)
            (Path(tmp) / name).mkdir(parents=True, exist_ok=True)
            sides[name] = _Side(Trainer(cfg, state, Path(tmp) / name))
        first_loss = {name: float(side.train_step()["loss_local"]) for name, side in sides.items()}
        for side in sides.values():
            side.collect(False)
            side.settle()
        # the model's and the experts' rates in these rounds (the variants share the model and
        # the dispatch chunk: one probe)
        probe = ModelRateSide(next(iter(sides.values())).t.cfg)
        blocks = rotating_blocks({**sides, PROBE: probe}, args, log_prefix="ep_pairing_pp")
        gathered: List[Any] = [None] * WORLD
        dist.all_gather_object(gathered, {"blocks": blocks, "first_loss": first_loss})
        if rank == 0:
            per_rank = [g["blocks"] for g in gathered]
            res = summarize(per_rank, list(sides))
            row = rate_summary(per_rank, PROBE, probe, args.quiet_cores)
            res.update(base_overrides=base, variant_overrides=variant_overrides(),
                       model_rate_probe={name: row for name in sides},
                       first_loss={k: [g["first_loss"][k] for g in gathered] for k in sides})
            Path(args.json_tmp).write_text(json.dumps(res, indent=2))
    finally:
        close_trainers(side.t for side in sides.values())


def summarize(per_rank: List[List[dict]], order: List[str]) -> Dict[str, Any]:
    """Per variant: step = slowest rank per step (median, quartiles); ep in flight and exposed
    per step and rank (medians); the bubble (executor's blocked time) per step, mean over ranks."""
    out: Dict[str, Any] = {"variants": {}}
    for name in order:
        idx = [i for i, b in enumerate(per_rank[0]) if b["name"] == name]
        steps = [max(per_rank[r][i]["times"][k] for r in range(len(per_rank)))
                 for i in idx for k in range(len(per_rank[0][i]["times"]))]
        extras = [e for r in range(len(per_rank)) for i in idx for e in per_rank[r][i]["extras"]]
        ep = [e["comm"].get("ep", {}) for e in extras]
        flight = stats([c.get("time_s", 0.0) for c in ep])["median_s"]
        exposed = stats([c.get("exposed_s", 0.0) for c in ep])["median_s"]
        out["variants"][name] = {"blocks": len(idx), "step": stats(steps), "ep_in_flight_ms": flight * 1e3,
                                 "ep_exposed_ms": exposed * 1e3, "exposed_share": exposed / flight if flight else 0.0,
                                 "bubble_ms": stats([e["bubble_s"] for e in extras])["median_s"] * 1e3,
                                 "rank_cores": stats([per_rank[r][i]["own_cpu_s"] / per_rank[r][i]["wall_s"]
                                                      for r in range(len(per_rank)) for i in idx])["median_s"],
                                 "foreign_cores": [round(per_rank[0][i]["foreign_cores"], 2) for i in idx]}
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    add_block_args(p, block=3, repeats=3, max_repeats=6, min_quiet=0, time_budget=300.0, warmup=1)
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v, help=f"default {v}")
    p.add_argument("--no-predict", action="store_true", help="skip the simulator's prediction")
    p.add_argument("--predict-from", help="no run: the simulator on this saved result's rates (--json's file)")
    p.add_argument("--microbatches-list", default="4,8,16",
                   help="with --predict-from: the microbatch counts per pipeline (default 4,8,16)")


def run(args) -> Dict[str, Any]:
    import torch.multiprocessing as mp

    from bench.common import _worker_then_free

    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="mpo-bench-ep-pairing-pp-") as tmp:
        args.json_tmp = str(Path(tmp) / "result.json")
        t0 = time.perf_counter()
        mp.start_processes(_worker_then_free, args=(_worker, free_port(), args, tmp), nprocs=WORLD,
                           start_method="spawn", join=True)
        res = json.loads(Path(args.json_tmp).read_text())
    res.update(benchmark="ep_pairing_pp", link=args.link, wall_s=time.perf_counter() - t0,
               setup={k: getattr(args, k) for k in ("block", "warmup", "block_warmup", *DEFAULTS)})
    if not args.no_predict:
        from bench.ep_pairing import predict_variants

        in_netns = bool(os.environ.get("MPO_BENCH_LINK"))
        res["predicted"] = predict_variants(res, os.environ.get("RATE", "2gbit"), probe=in_netns)
    return res


def render(results: Dict[str, Any]) -> str:
    res = results.get("ep_pairing_pp")
    if not res:
        return ""
    rows, pred = res["variants"], res.get("predicted") or {}
    lines = ["| variant | median step (ms) | IQR (ms) | ep in flight (ms/step/rank) | exposed (ms) | exposed share | "
             "pp bubble (ms/rank) | cores per rank | predicted step (ms) | error | predicted share | "
             "predicted cores per rank |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in VARIANTS:
        r, p = rows.get(name), pred.get(name)
        if r is None:
            continue
        st = r["step"]
        cells = [f"{st['median_s'] * 1e3:.0f}", f"{st['q1_s'] * 1e3:.0f}-{st['q3_s'] * 1e3:.0f}",
                 f"{r['ep_in_flight_ms']:.0f}", f"{r['ep_exposed_ms']:.0f}", f"{r['exposed_share']:.2f}",
                 f"{r['bubble_ms']:.0f}", f"{r['rank_cores']:.2f}" if "rank_cores" in r else "-"]
        cells += ([f"{p['step_s'] * 1e3:.0f}", f"{p['step_s'] / st['median_s'] - 1:+.0%}", f"{p['share']:.2f}",
                   f"{p['rank_cores']:.2f}" if "rank_cores" in p else "-"] if p else ["-"] * 4)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name in ("zbv_pairing", "interleaved_pairing"):
        if name in pred:
            lines.append(f"\nSimulator, {name}: {pred[name]['pairing']}.")
    if all(n in rows for n in ("zbv", "zbv_pairing", "interleaved_pairing")):
        best = min(rows["zbv"]["step"]["median_s"], rows["interleaved_pairing"]["step"]["median_s"])
        lines.append(f"\nzbv + pairing / the better of zbv and interleaved + pairing: "
                     f"{rows['zbv_pairing']['step']['median_s'] / best:.3f} (goal <= 0.95).")
    if all(n in pred and "step_s_core_per_rank" in pred[n] for n in ("zbv", "zbv_pairing", "interleaved_pairing")):
        lines.append("Predicted: " + goal_line(pred, "step_s") + "; with a core per rank: "
                     + goal_line(pred, "step_s_core_per_rank") + ".")
    return "\n".join(lines) + "\n"


def goal_line(pred: Dict[str, Any], key: str) -> str:
    """The four predicted steps (ms) and the goal's ratio, from `pred[variant][key]`."""
    steps = ", ".join(f"{n} {pred[n][key] * 1e3:.0f}" for n in VARIANTS if n in pred)
    ratio = pred["zbv_pairing"][key] / min(pred["zbv"][key], pred["interleaved_pairing"][key])
    return f"{steps} ms, ratio {ratio:.3f}"


def predict_from(path: str, microbatches: List[int]) -> None:
    """The simulator on a saved result's rates (`--predict-from`), at each microbatch count."""
    from bench.ep_pairing import predict_variants

    res = json.loads(Path(path).read_text())
    mb = next(int(o.split("=")[1]) for o in res["base_overrides"] if o.startswith("train.micro_batch_size="))
    for m in microbatches:
        res["base_overrides"] = [o for o in res["base_overrides"] if not o.startswith("train.global_batch_size=")]
        res["base_overrides"].append(f"train.global_batch_size={mb * m * 2}")  # dp 2
        pred = predict_variants(res, os.environ.get("RATE", "2gbit"), probe=bool(os.environ.get("MPO_BENCH_LINK")))
        print(f"m = {m}: shared cores: {goal_line(pred, 'step_s')}; a core per rank: "
              f"{goal_line(pred, 'step_s_core_per_rank')}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--link", default=os.environ.get("MPO_BENCH_LINK", "loopback, not rate-limited"),
                   help="text describing the link, recorded in the result")
    args = p.parse_args()
    if args.predict_from:
        predict_from(args.predict_from, [int(x) for x in args.microbatches_list.split(",")])
        return
    res = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"Link: {res['link']}; {WORLD} ranks on {os.cpu_count()} cores; wall {res['wall_s']:.0f} s")
    print(render({"ep_pairing_pp": res}))


if __name__ == "__main__":
    main()
