"""gpu-report.md and gpu-report.json of `make gpu-check` (bench/gpu_check.py): the machine, the
CUDA tier's outcome, the attention kernels, and per shape the measured steps beside the plain
loops and the simulator's prediction. Standard library only (the report is written also where
the package cannot be imported); `render` takes the results dict the check fills as it goes."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, List, Optional

SIDE_NAMES = {"mpoverlap": "mpoverlap Trainer", "plain": "same module, plain loop", "hf": "transformers Llama loop",
              "compiled": "mpoverlap Trainer, train.compile=true", "fp8": "mpoverlap Trainer, train.precision=fp8",
              "fp8_compiled": "mpoverlap Trainer, train.precision=fp8, train.compile=true"}
# train.precision=fp8's target: llama3_1b at seq 4096, compiled, fp8 tokens/s over bf16's
FP8_TARGET = 1.25


def _run(cmd: List[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit(repo: Path) -> str:
    """$GPU_CHECK_COMMIT when set (the launching side knows what it copied: a copy on a GPU
    machine may sit beside a stale .git from an earlier call); else HEAD (with `+dirty` for
    uncommitted changes to tracked files); else 'unknown'."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    head = _run(["git", "rev-parse", "HEAD"], repo)
    if head:
        dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], repo)
        return head + ("+dirty" if dirty else "")
    return "unknown (no git here; set GPU_CHECK_COMMIT=<sha>)"


def environment(repo: Path) -> Dict[str, Any]:
    """GPU, driver, torch, CUDA and NCCL versions, Python, and the commit measured."""
    import torch

    env: Dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "commit": git_commit(repo)}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                   capability=f"sm{props.major}{props.minor}", gpu_memory_gib=round(props.total_memory / 2**30, 1))
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as err:  # noqa: BLE001 - a build without NCCL says so in the report
            env["nccl"] = f"unavailable ({type(err).__name__})"
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    env["driver"] = smi.splitlines()[0] if smi else "unknown (nvidia-smi not found)"
    return env


def junit_summary(path: Path) -> Dict[str, Any]:
    """Counts and failing test ids of a pytest --junitxml file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failing = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                failing.append({"test": f"{case.get('classname')}::{case.get('name')}",
                                "message": (node.get("message") or "")[:300]})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"counts": counts, "failing": failing}


def _f(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def _throughput_rows(shape: str, r: Dict[str, Any]) -> List[str]:
    sim = r.get("simulated") or {}
    sim_s = sim.get("step_s")
    rows = []
    for side, row in (r.get("sides") or {}).items():
        name = SIDE_NAMES.get(side, side)
        if "error" in row:
            rows.append(f"| {shape} | {name} | error: {row['error'][:120]} | | | | | | | | |")
            continue
        ratio = row["step_s"] / sim_s if sim_s else None
        ops = row.get("launches")
        per_op = 1e6 * row["step_s"] / ops if ops else None
        rows.append(f"| {shape} | {name} | {_f(row.get('step_s'), '.3f')} | {_f(row.get('tokens_per_s'), ',.0f')} | "
                    f"{_f(row.get('model_tflops_per_s'), '.1f')} | {_f(row.get('mfu'), '.1%')} | "
                    f"{_f(row.get('peak_memory_gib'), '.1f')} | {_f(sim_s, '.3f')} ({sim.get('hardware', '-')}) | "
                    f"{_f(ratio, '.2f')} | {_f(ops, ',d')} | {_f(per_op, '.1f')} |")
    return rows


# Figures read off the throughput table, per shape: (what, the figure from a shape's result, its
# format). A figure whose sides did not both run is left out (the table says why).
def _step(r: Dict[str, Any], side: str) -> Optional[float]:
    row = (r.get("sides") or {}).get(side) or {}
    return row.get("step_s") if "error" not in row else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def _simulator_error(r: Dict[str, Any]) -> Optional[float]:
    measured, simulated = _step(r, "mpoverlap"), (r.get("simulated") or {}).get("step_s")
    return abs(simulated - measured) / measured if measured and simulated else None


COMPARISONS = [
    ("Trainer step / its module's plain loop", lambda r: _ratio(_step(r, "mpoverlap"), _step(r, "plain")), ".3f"),
    ("transformers loop / Trainer step", lambda r: _ratio(_step(r, "hf"), _step(r, "mpoverlap")), ".3f"),
    ("Trainer step eager / with train.compile=true", lambda r: _ratio(_step(r, "mpoverlap"), _step(r, "compiled")),
     ".3f"),
    ("simulator's error on the Trainer step (abs(simulated - measured) / measured)", _simulator_error, ".1%"),
    ("fp8 tokens/s / bf16 tokens/s, eager Trainer", lambda r: _ratio(_step(r, "mpoverlap"), _step(r, "fp8")), ".3f"),
    ("fp8 tokens/s / bf16 tokens/s, train.compile=true",
     lambda r: _ratio(_step(r, "compiled"), _step(r, "fp8_compiled")), ".3f"),
]


def fp8_lines(shapes: Dict[str, Any]) -> List[str]:
    """The FP8 sides' GEMM kernels (named like FP8 GEMMs: bench/gpu_throughput.py FP8_KERNEL) and
    llama3_1b's compiled fp8 / bf16 tokens/s against FP8_TARGET."""
    rows = [(shape, side, row) for shape, r in shapes.items() for side, row in (r.get("sides") or {}).items()
            if side in ("fp8", "fp8_compiled")]
    if not rows:
        return []
    out = ["", "### FP8 GEMMs (train.precision=fp8): the kernels named like FP8 over one step (GEMMs, and casts "
           "whose names carry fp8)", "",
           "| shape | side | FP8 kernels (ms, calls) |", "|---|---|---|"]
    for shape, side, row in rows:
        if "error" in row:
            named = f"error: {row['error'][:120]}"
        else:
            named = "; ".join(f"`{k['kernel'][:90]}` ({k['ms']:.2f}, {k['calls']})" for k in row.get("fp8_kernels", [])[:6])
            named = named or "none: no kernel named like an FP8 GEMM ran"
        out.append(f"| {shape} | {SIDE_NAMES.get(side, side)} | {named} |")
    llama = shapes.get("llama3_1b") or {}
    ratio = _ratio(_step(llama, "compiled"), _step(llama, "fp8_compiled"))
    if ratio is not None:
        out += ["", f"Acceptance: llama3_1b at seq 4096, train.compile=true: fp8 {ratio:.2f}x bf16's tokens/s, target "
                f">= {FP8_TARGET:.2f}x: {'met' if ratio >= FP8_TARGET else 'missed'}"]
    return out


def comparisons(throughput: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each figure of COMPARISONS that a shape's result holds, with its value and how it is shown."""
    out = []
    for shape, r in throughput.items():
        for what, figure, fmt in COMPARISONS:
            value = figure(r) if "sides" in r else None
            if value is not None:
                out.append({"shape": shape, "figure": what, "value": value, "shown": _f(value, fmt)})
    return out


def render(results: Dict[str, Any]) -> str:
    """The markdown report of a results dict (keys: env, started, elapsed_s, budget_s, tests,
    attention_kernels, throughput, skipped); parts not there yet are said to be missing."""
    env = results.get("env", {})
    out = ["# GPU check report", "",
           f"- GPU: {env.get('gpu', '-')} ({env.get('capability', '-')}, {env.get('gpu_memory_gib', '-')} GiB), "
           f"driver {env.get('driver', '-')}",
           f"- torch {env.get('torch', '-')}, CUDA {env.get('cuda', '-')}, NCCL {env.get('nccl', '-')}, "
           f"Python {env.get('python', '-')}",
           f"- commit: {env.get('commit', '-')}",
           f"- started {results.get('started', '-')}, took {_f(results.get('elapsed_s'), '.0f')} s of a "
           f"{_f(results.get('budget_s'), '.0f')} s budget", ""]
    out += ["## CUDA tier (`pytest -m cuda`)", ""]
    tests = results.get("tests")
    if not tests:
        out.append("not run")
    elif "counts" in tests:
        c = tests["counts"]
        out.append(f"{c['passed']} passed, {c['failures']} failed, {c['errors']} errors, {c['skipped']} skipped "
                   f"in {_f(tests.get('elapsed_s'), '.0f')} s (exit code {tests.get('returncode')})")
        out += [f"- FAILED {f['test']}: {f['message']}" for f in tests.get("failing", [])]
    else:
        out.append(f"{tests.get('status', 'no result')}: {tests.get('reason', '')}")
    gaps = results.get("cuda_vs_cpu") or []
    if gaps:
        out += ["", "### CUDA against CPU, relative loss gap per step", "",
                "bf16's bound is a multiple of its floor: the CPU reference's own bf16 curve against its fp32 "
                "curve (tests/test_cuda_tier.py `bf16_bound`).", "",
                "| case | floor | bound | max | per step |", "|---|---|---|---|---|"]
        out += [f"| {g['case']} | {_f(g.get('floor'), '.2e')} | {g['bound']:.2e} | {g['max_rel']:.2e} | "
                f"{', '.join(f'{x:.1e}' for x in g['per_step'])} |" for g in gaps]
    syncs = results.get("host_syncs") or []
    if syncs:
        out += ["", "### Host syncs per step: CUDA (sync debug mode) against the CPU counter", "",
                "| model | CUDA syncs | CPU reads | CPU sites |", "|---|---|---|---|"]
        out += [f"| {r['model']} | {r['cuda_syncs']} | {r['cpu_reads']} | "
                f"{', '.join(f'{k} x{n}' for k, n in r['cpu_sites'].items())} |" for r in syncs]
    out += ["", "## Attention kernels at sequence 8,192, bf16", ""]
    kernels = results.get("attention_kernels") or []
    if kernels:
        out += ["| preset | heads / groups / head dim | model SDPA kernel | CP block (auto) | its kernel |",
                "|---|---|---|---|---|"]
        for k in kernels:
            out.append(f"| {k['preset']} | {k['heads']} / {k['groups']} / {k['head_dim']} | "
                       f"{(k.get('sdpa_kernels') or ['-'])[0][:80]} | {k.get('cp_block_backend', '-')} | "
                       f"{(k.get('cp_block_kernels') or ['-'])[0][:80]} |")
    else:
        out.append("none recorded (the tier's attention test did not run)")
    out += ["", "## Throughput (one GPU, bf16 autocast over fp32 weights)", "",
            "| shape | side | step s | tokens/s | model TFLOP/s | MFU | peak GiB | simulated step s | measured / simulated "
            "| operators a step | step us per operator |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    shapes = results.get("throughput") or {}
    for shape, r in shapes.items():
        if "sides" in r:
            out += _throughput_rows(shape, r)
        else:
            out.append(f"| {shape} | {r.get('status', 'no result')}: {r.get('reason', '')} | | | | | | | | | |")
    out += priority_lines(shapes)
    out += fp8_lines(shapes)
    figures = comparisons(shapes)
    if figures:
        out += ["", "### The Trainer against the plain loops and the simulator", "", "| shape | figure | measured |",
                "|---|---|---|"]
        out += [f"| {c['shape']} | {c['figure']} | {c['shown']} |" for c in figures]
    if any(row.get("launches") for r in shapes.values() for row in (r.get("sides") or {}).values()):
        out += ["", "Operators a step: aten operators one more step dispatched (each a kernel launch or a "
                "view), counted by mpoverlap/training/launch_count.py; step us per operator is the step time "
                "over that count: near the host's own cost per dispatched operator (about 20-25 us, "
                "docs/gpu-check.md) the step is host-bound."]
    est = [(shape, side, row) for shape, r in shapes.items() for side, row in (r.get("sides") or {}).items()
           if row.get("estimated_peak_gib") and row.get("peak_memory_gib")]
    if est:
        out += ["", "### Peak memory against the estimate (mpoverlap/overlap/estimate, heaviest stage)", "",
                "| shape | side | peak GiB (max allocated) | estimated GiB | measured / estimated |", "|---|---|---|---|---|"]
        out += [f"| {shape} | {SIDE_NAMES.get(side, side)} | {row['peak_memory_gib']:.1f} | "
                f"{row['estimated_peak_gib']:.1f} | {row['peak_memory_gib'] / row['estimated_peak_gib']:.2f} |"
                for shape, side, row in est]
    busy = [(shape, side, row) for shape, r in shapes.items() for side, row in (r.get("sides") or {}).items()
            if row.get("gpu_ms")]
    if busy:
        out += ["", "### GPU time of one step by kind (profiled kernels; GPU idle = step - kernels)", "",
                "| shape | side | step ms | kernels ms | GEMM ms | attention ms | other ms (elementwise, copies, "
                "reductions, optimizer) | GPU idle ms |", "|---|---|---|---|---|---|---|---|"]
        for shape, side, row in busy:
            g, step_ms = row["gpu_ms"], 1e3 * row["step_s"]
            out.append(f"| {shape} | {SIDE_NAMES.get(side, side)} | {step_ms:.1f} | {g['total']:.1f} | {g['gemm']:.1f} "
                       f"| {g['attention']:.1f} | {g['other']:.1f} | {max(0.0, step_ms - g['total']):.1f} |")
    for shape, r in shapes.items():
        for side, row in (r.get("sides") or {}).items():
            if row.get("top_kernels"):  # the JSON keeps 40
                out += ["", f"### {shape}, {SIDE_NAMES.get(side, side)}: top kernels over one step", "",
                        "| kernel | ms | calls |", "|---|---|---|"]
                out += [f"| `{k['kernel']}` | {k['ms']:.2f} | {k['calls']} |" for k in row["top_kernels"][:10]]
    for shape, r in shapes.items():
        for side, row in (r.get("sides") or {}).items():
            out += _host_rows(shape, side, row.get("host"))
    skipped = results.get("skipped") or []
    if skipped:
        out += ["", "## Skipped", ""] + [f"- {s}" for s in skipped]
    return "\n".join(out) + "\n"


def _host_rows(shape: str, side: str, host: Optional[Dict[str, Any]]) -> List[str]:
    """Where one step's host time went (bench/host_profile.py): the CUDA runtime calls, then the
    Python functions with most self time (the JSON keeps 15 of each, and the aten operators)."""
    if not host:
        return []
    out = ["", f"### {shape}, {SIDE_NAMES.get(side, side)}: host time of one step", ""]
    runtime = host.get("runtime") or []
    if runtime:
        out += ["| CUDA runtime call | calls | host ms |", "|---|---|---|"]
        out += [f"| `{c['name']}` | {c['calls']} | {c['self_ms']:.2f} |" for c in runtime[:10]]
        out.append("")
    out += ["| Python function (cProfile) | calls | self ms | cumulative ms |", "|---|---|---|---|"]
    out += [f"| `{f['function']}` | {f['calls']} | {f['self_ms']:.2f} | {f['cum_ms']:.2f} |"
            for f in (host.get("python_top") or [])[:10]]
    return out


def write(out_dir: Path, results: Dict[str, Any]) -> None:
    """gpu-report.json and gpu-report.md, each replaced whole (written aside, then renamed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpu-report.json", json.dumps(results, indent=1, default=str)),
                       ("gpu-report.md", render(results))):
        tmp = out_dir / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out_dir / name)


def priority_lines(shapes: Dict[str, Any]) -> List[str]:
    """Which process groups each Trainer side created with NCCL's high-priority streams
    (overlap.comm_priority, `ParallelState.high_priority`); a one-GPU run has no group."""
    rows = [(shape, side, row["high_priority_groups"]) for shape, r in shapes.items()
            for side, row in (r.get("sides") or {}).items() if "high_priority_groups" in row]
    if not rows:
        return []
    return (["", "High-priority NCCL streams (overlap.comm_priority): "
             + "; ".join(f"{shape} {side}: {', '.join(kinds) or 'none (no process group at world 1)'}"
                         for shape, side, kinds in rows)])
