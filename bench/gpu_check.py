"""`make gpu-check`: the CUDA path of mpoverlap checked on one GPU in one call (docs/gpu-check.md).

Without a visible GPU it prints one line and exits 0. With one, within --budget-s (default
DEFAULT_BUDGET_S: every part's own limit and the setup, so a default run has room for each):

  1. the CUDA tier, `pytest -m cuda` (a subprocess, junit XML kept);
  2. throughput per shape (bench/gpu_throughput.py, a subprocess each, DEFAULT_SIDES):
     llama3_1b at seq 4096 and moe_350m; the Trainer (eager, compiled, and in
     train.precision=fp8) beside the same module in a plain loop, with the simulator's
     prediction of the step; gpt_125m and the transformers loop only when asked (--shapes,
     the shape's own --sides in gpu_throughput.py);
  3. gpu-report.md and gpu-report.json under the output folder (--out, else $OUT, else
     runs/gpu-check), rewritten after every part: a part that fails or runs out of time is
     recorded and the next one runs; what does not fit in the budget is skipped with the reason.

The default check measures fp8 where it pays most within one 10-minute call: llama3_1b's
compiled fp8 side against the compiled bf16 one (the 1.25x target) and its eager fp8 side,
moe_350m's eager fp8 side, the FP8 GEMM kernels named in the report. `--fp8`
(`make gpu-check-fp8`, a call of its own) is the whole fp8 matrix: the CUDA tier's FP8 tests
(`-k fp8`), then llama3_1b and moe_350m with the four Trainer sides each (FP8_SIDES: bf16 and
fp8, eager and compiled).

A bare GPU machine lacks hydra-core / omegaconf / antlr4: where they cannot be imported, the
wheels in .gpu/whl (`make gpu-wheels`, docs/gpu-check.md) and the package itself are installed
with pip into folders under /tmp (no network) and the parts run with PYTHONPATH on them.

    python -m bench.gpu_check [--fp8] [--out DIR] [--budget-s S] [--tests-s S] [--shapes a,b]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
NO_GPU = "gpu-check: no CUDA GPU is visible here (torch.cuda.is_available() is False); nothing to check"
INSTALL_ROOT = Path("/tmp/mpoverlap-gpu-check")
# The default shapes, in order of value (bench/gpu_throughput.py SHAPES; gpt_125m by --shapes)
SHAPES = ("llama3_1b", "moe_350m")
# Each default shape's sides, most valuable first (a shape that runs out of time keeps the sides
# measured by then): Llama's compiled bf16 and fp8 sides (train.precision=fp8's 1.25x target),
# the eager Trainer beside its plain loop (the framework's overhead), the eager fp8 side;
# moe_350m's eager Trainer (its host profile: where MoE's host time goes), plain loop, compiled
# and eager fp8 sides. The transformers loop (`hf`) has been measured before (docs/gpu-reports/):
# only when asked, as gpt_125m.
DEFAULT_SIDES = {"llama3_1b": "compiled,fp8_compiled,mpoverlap,plain,fp8", "moe_350m": "mpoverlap,plain,compiled,fp8"}
# Each shape's own limit, seconds. Llama: five sides, the two compiled ones ~40 s of steps and
# profile as the others plus their compiles in the warm-up (30-60 s each expected). moe_350m: the
# eager and plain sides (~35 s on an H200, docs/gpu-reports/), the compiled and the fp8 side.
# Each Trainer's eager side profiles two more steps (bench/host_profile.py: ~5-10 s expected).
SHAPE_S = {"llama3_1b": 240, "moe_350m": 175, "gpt_125m": 55}
MIN_SHAPE_S = 25  # a shape with less time left is skipped
# The CUDA tier's limit: it took 48 s on an H200 (docs/gpu-reports/), 2.5x that.
TESTS_S = 120.0
# The rest of a run: the carried wheels' install on a bare machine (~10-20 s), the environment
# probe and the report after each part, and the 5 s each shape leaves before the deadline.
SETUP_S = 30.0
# The default budget has room for every default part's whole limit, so a default run skips
# nothing by design (565 s: the whole check fits in a 10-minute call).
DEFAULT_BUDGET_S = TESTS_S + sum(SHAPE_S[s] for s in SHAPES) + SETUP_S
# --fp8: each shape's four Trainer sides (bf16 and fp8, eager and compiled: two compiles of
# 30-60 s each, the host profile of the eager bf16 side), the tier's FP8 tests
FP8_SHAPE_S = {"llama3_1b": 220, "moe_350m": 190}
FP8_SIDES = "mpoverlap,compiled,fp8,fp8_compiled"
FP8_TESTS_S = 60.0
FP8_BUDGET_S = FP8_TESTS_S + sum(FP8_SHAPE_S.values()) + SETUP_S


class SetupError(RuntimeError):
    """The package cannot be made importable on this machine (message says what to carry)."""


def gpu_visible() -> Optional[bool]:
    """True / False, or None where torch itself is not importable."""
    try:
        import torch
    except ImportError:
        return None
    return bool(torch.cuda.is_available())


def _package_importable(env: Dict[str, str], cwd: Path) -> bool:
    """Whether the parts' interpreter, run from `cwd` (outside the checkout), imports the
    package with its models and its config dependencies."""
    code = "import hydra, omegaconf, antlr4, mpoverlap.models, mpoverlap.conf"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True).returncode == 0


def prepare_env(cwd: Path, repo: Path = REPO, root: Path = INSTALL_ROOT) -> Dict[str, str]:
    """The environment the parts run in (from `cwd`). Where hydra, omegaconf and mpoverlap are
    importable (a developer's .venv) it is this one; else the carried wheels and the package go
    into `root`/site and `root`/mp with pip (no index, no network) and PYTHONPATH names them."""
    env = dict(os.environ)
    if _package_importable(env, cwd):
        return env
    wheels = sorted((repo / ".gpu" / "whl").glob("*.whl"))
    if not wheels:
        raise SetupError("hydra-core / omegaconf / antlr4 are not importable and .gpu/whl holds no wheels: run "
                         "`make gpu-wheels` where the package registry is reachable and carry .gpu/whl here")
    site, mp = root / "site", root / "mp"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--upgrade", "--no-index", "--no-deps",
           "--disable-pip-version-check"]
    for cmd in (pip + ["--target", str(site)] + [str(w) for w in wheels],
                pip + ["--no-build-isolation", "--target", str(mp), str(repo)]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SetupError(f"{' '.join(cmd[:8])} ... failed: {done.stderr.strip()[-800:]}")
    env["PYTHONPATH"] = os.pathsep.join([str(mp), str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if not _package_importable(env, cwd):
        raise SetupError(f"installed the wheels into {site} and the package into {mp}, and still "
                         "`import hydra, omegaconf, antlr4, mpoverlap.models` fails there")
    return env


def cuda_test_files(repo: Path = REPO) -> List[str]:
    """The test files that hold CUDA-marked tests (collecting only them keeps an unrelated
    import error elsewhere from stopping the tier)."""
    return sorted(str(p) for p in (repo / "tests").glob("test_*.py") if "pytest.mark.cuda" in p.read_text())


def run_tests(out: Path, env: Dict[str, str], timeout_s: float, select: Optional[str] = None) -> Dict[str, Any]:
    """`pytest -m cuda` on the CUDA test files (`select`: a -k expression, e.g. fp8)."""
    from bench.gpu_report import junit_summary

    xml = out / "cuda-tier.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rfEs", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", f"--junitxml={xml}", *(["-k", select] if select else []),
           *cuda_test_files()]
    t0 = time.monotonic()
    with open(out / "cuda-tier.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    row: Dict[str, Any] = {"returncode": rc, "elapsed_s": time.monotonic() - t0, "log": "cuda-tier.log"}
    if rc is None:
        row.update(status="timeout", reason=f"pytest -m cuda ran past its {timeout_s:.0f} s (see cuda-tier.log)")
    if xml.exists():
        row.update(junit_summary(xml))
    elif rc is not None:
        row.update(status="no junit XML", reason=f"pytest exited {rc} (see cuda-tier.log)")
    return row


def run_shape(shape: str, out: Path, env: Dict[str, str], timeout_s: float,
              sides: Optional[str] = None) -> Dict[str, Any]:
    """One shape's throughput (bench/gpu_throughput.py) in a subprocess; `sides`: its --sides."""
    path = out / f"throughput-{shape}.json"
    more = ["--sides", sides] if sides else []
    code = (f"import sys; sys.path.append({str(REPO)!r}); from bench.gpu_throughput import main; "
            f"raise SystemExit(main(['--shape', {shape!r}, '--out', {str(path)!r}, *{more!r}]))")
    with open(out / f"throughput-{shape}.log", "w") as log:
        try:
            rc = subprocess.run([sys.executable, "-c", code], cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    row = json.loads(path.read_text()) if path.exists() else {}
    if rc is None:
        row.update(status="timeout", reason=f"ran past its {timeout_s:.0f} s: the sides measured by then are kept")
    elif rc:
        lines = (out / f"throughput-{shape}.log").read_text().strip().splitlines()
        row.update(status="failed", reason=f"exit {rc}: {lines[-1][:200] if lines else ''} (throughput-{shape}.log)")
    return row


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output folder (default: $OUT, else runs/gpu-check)")
    p.add_argument("--fp8", action="store_true",
                   help="the FP8 check: the tier's fp8 tests, llama3_1b and moe_350m in fp8 beside bf16")
    p.add_argument("--budget-s", type=float, default=None,
                   help="the whole check's wall-time budget (default: every part's limit and the setup)")
    p.add_argument("--tests-s", type=float, default=None, help="the CUDA tier's share of it at most")
    p.add_argument("--shapes", default=None)
    return p


def options(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The parsed arguments, the defaults of the check asked for (--fp8 or not) filled in."""
    a = parser().parse_args(argv)
    if a.budget_s is None:
        a.budget_s = FP8_BUDGET_S if a.fp8 else DEFAULT_BUDGET_S
    if a.tests_s is None:
        a.tests_s = FP8_TESTS_S if a.fp8 else TESTS_S
    if a.shapes is None:
        a.shapes = ",".join(FP8_SHAPE_S if a.fp8 else SHAPES)
    return a


def main(argv: Optional[List[str]] = None) -> int:
    a = options(argv)
    visible = gpu_visible()
    if not visible:
        print(NO_GPU if visible is False else "gpu-check: torch is not importable here, so no CUDA GPU is visible; "
              "nothing to check")
        return 0
    from bench import gpu_report

    start = time.monotonic()
    deadline = start + a.budget_s
    out = Path(a.out or os.environ.get("OUT") or REPO / "runs" / "gpu-check").resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                               "budget_s": a.budget_s, "check": "fp8" if a.fp8 else "default", "env": gpu_report.environment(REPO), "skipped": []}

    def save() -> None:
        results["elapsed_s"] = time.monotonic() - start
        gpu_report.write(out, results)
        print(f"gpu-check: {results['elapsed_s']:.0f}s, report so far in {out / 'gpu-report.md'}", flush=True)

    save()
    try:
        env = prepare_env(out)
    except SetupError as err:
        results["skipped"].append(f"everything: {err}")
        save()
        print(f"gpu-check: {err}", file=sys.stderr)
        return 1
    env["MPOVERLAP_GPU_CHECK_OUT"] = str(out)
    records = ("attention_kernels", "cuda_vs_cpu", "host_syncs")  # rows the tier's tests write (_record)
    for name in records:
        (out / f"{name}.jsonl").unlink(missing_ok=True)
    shapes = [s for s in a.shapes.split(",") if s]
    reserve = MIN_SHAPE_S * min(len(shapes), 2)  # the tier leaves time for at least Llama's throughput
    results["tests"] = run_tests(out, env, max(30.0, min(a.tests_s, deadline - time.monotonic() - reserve)),
                                 "fp8" if a.fp8 else None)
    results.update({name: read_jsonl(out / f"{name}.jsonl") for name in records})
    save()
    results["throughput"] = {}
    for shape in shapes:
        left = deadline - time.monotonic() - 5
        if left < MIN_SHAPE_S:
            results["skipped"].append(f"throughput {shape}: {left:.0f} s of the budget left, under {MIN_SHAPE_S} s")
            save()
            continue
        limit = (FP8_SHAPE_S if a.fp8 else SHAPE_S).get(shape, 60)
        sides = FP8_SIDES if a.fp8 else DEFAULT_SIDES.get(shape)
        results["throughput"][shape] = run_shape(shape, out, env, min(limit, left), sides)
        save()
    return 0 if passed(results) else 1


def passed(results: Dict[str, Any]) -> bool:
    """The tier ran and passed, and every throughput shape ran each of its sides."""
    tests, shapes = results.get("tests") or {}, results.get("throughput") or {}
    return (tests.get("returncode") == 0 and not results.get("skipped")
            and all("status" not in r and r.get("sides") and all("error" not in row for row in r["sides"].values())
                    for r in shapes.values()))


if __name__ == "__main__":
    raise SystemExit(main())
