"""The throughput part of `make gpu-check` (bench/gpu_check.py): one model shape per process.

For one shape (SHAPES) on one GPU, in ONE process and on the same batches (the same
`global_batch`, micro batches and sequence length, so the same FLOPs per step):

  mpoverlap   Trainer(cfg).train_step(): DataParallel + DataParallelAdamW at dp 1, bf16 autocast
  plain       the same model module (models/gpt.py GPT) in a plain loop: bf16 autocast over fp32
              weights, torch's fused AdamW, clip_grad_norm_ 1.0 (bench/overhead.py PlainLoop)
  hf          (Llama shape only) transformers LlamaForCausalLM built from the same keys
              (interop/hf_mapping.py hf_config; no download), SDPA, the same loop
  compiled    (Llama and MoE shapes) the Trainer with train.compile=true: each block's elementwise
              math through torch.compile (models/fused.py); its compile runs in the warm-up steps
  fp8, fp8_compiled  (Llama and MoE shapes; `make gpu-check-fp8`) the Trainer and the compiled
              Trainer with train.precision=fp8: the blocks' linears and the grouped experts on
              FP8 GEMMs (torch._scaled_mm, torch._scaled_grouped_mm); the kernels named like
              FP8 GEMMs (FP8_KERNEL) listed apart

each: median step time over the timed steps (synchronized), tokens/s, model TFLOP/s and MFU
(`flops_per_token` against the GPU's dense bf16 peak, training/metrics.py), peak memory, and the
kernels with most GPU time over one profiled step, and for the Trainer's eager side where its
host time goes (two more profiled steps: bench/host_profile.py); beside them the simulator's prediction of
the step (`hardware=h100_sxm|h200_sxm`, what `mpoverlap-check --simulate` computes). The JSON
at --out is rewritten after every side, so a crash or the time limit keeps what was measured.

    python -m bench.gpu_throughput --shape llama3_1b --out DIR [--hardware h100_sxm] [--steps 3]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import socket
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

COMMON = ["train.precision=bf16", "parallel.dp=1", "train.progress=false", "checkpoint.interval=0",
          "checkpoint.resume=none", "train.log_interval=1000", "data.max_bytes=2000000", "train.grad_clip=1.0"]
SHAPES = {
    "llama3_1b": ["model=llama3_1b", "model.seq_length=4096", "train.micro_batch_size=2", "train.global_batch_size=8"],
    "moe_350m": ["model=moe_350m", "train.micro_batch_size=8", "train.global_batch_size=32"],
    "gpt_125m": ["model=gpt_125m", "train.micro_batch_size=8", "train.global_batch_size=32"],
}
HF_SHAPES = ("llama3_1b",)
# the `compiled` side: train.compile=true (inductor); for moe_350m the block's regions and the
# loss around the eager router, permutation and grouped experts
COMPILED_SHAPES = ("llama3_1b", "moe_350m")
# the fp8 sides (train.precision=fp8, eager and compiled), beside the bf16 Trainer's two
FP8_SHAPES = ("llama3_1b", "moe_350m")
TRAINER_SIDES = ("mpoverlap", "compiled", "fp8", "fp8_compiled")
# A kernel named like an FP8 GEMM: cuBLASLt's e4m3/e5m2 kernels, CUTLASS/FBGEMM f8f8bf16 ones,
# torch's scaled (grouped) mm; lower-case names
FP8_KERNEL = re.compile(r"fp8|f8f8|e4m3|e5m2|float8|scaled_mm|scaled_grouped|_f8_")


def side_overrides(overrides: List[str], side: str) -> List[str]:
    """The overrides of a side: train.compile=true for the compiled ones, train.precision=fp8 in
    place of bf16 for the fp8 ones."""
    out = list(overrides)
    if side in ("fp8", "fp8_compiled"):
        out = [o for o in out if not o.startswith("train.precision=")] + ["train.precision=fp8"]
    if side in ("compiled", "fp8_compiled"):
        out.append("train.compile=true")
    return out


def fp8_kernels(kernels: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The kernels of `top_kernels` named like FP8 GEMMs (FP8_KERNEL), most GPU time first."""
    return [k for k in kernels if FP8_KERNEL.search(k["kernel"].lower())]


def overrides_of(shape: str, device: str = "cuda") -> List[str]:
    return SHAPES[shape] + COMMON + [f"train.device={device}"]


def sim_prediction(overrides: List[str], hardware: str) -> Dict[str, Any]:
    """The simulator's step for these overrides on `hardware` (a conf/hardware preset): what
    `mpoverlap-check --simulate <overrides> hardware=<preset>` prints, as numbers."""
    from mpoverlap.config import compose
    from mpoverlap.simulate.core import simulate
    from mpoverlap.simulate.hardware import from_config

    cfg = compose(list(overrides) + [f"hardware={hardware}"])
    r = simulate(cfg, from_config(cfg))
    return {"hardware": hardware, "step_s": r.step_s, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu,
            "compute_s": r.compute_s, "memory_s": r.memory_s, "exposed_s": dict(r.exposed_s)}


def estimated_peak_gib(cfg: Any) -> float:
    """The memory estimate's heaviest stage at world 1 (what `mpoverlap-check` prints: parameters,
    gradients, optimizer state, activations, the step's weight casts, the loss's backward), GiB."""
    from mpoverlap.overlap.estimate import estimate

    return sum(estimate(cfg, 1).memory_bytes.values()) / 2**30


def hardware_preset(device_name: str) -> str:
    """The conf/hardware preset of the GPU at hand (H200 -> h200_sxm, else h100_sxm)."""
    return "h200_sxm" if "H200" in device_name.upper() else "h100_sxm"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], Any], device: torch.device, warmup: int, steps: int) -> List[float]:
    """Wall seconds of `steps` calls after `warmup` untimed ones, each synchronized."""
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def top_kernels(step: Callable[[], Any], device: torch.device, n: Optional[int] = 40) -> List[Dict[str, Any]]:
    """The n kernels (None: all) with most GPU time over one call of `step` (torch.profiler), in ms."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        _sync(device)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:120], "ms": us / 1e3, "calls": e.count})
    return sorted(rows, key=lambda r: -r["ms"])[:n]


def gpu_time_by_kind(kernels: List[Dict[str, Any]]) -> Dict[str, float]:
    """GPU ms of one step's kernels by kind (the report's "GPU time" table): attention (SDPA,
    flash, fmha), GEMMs (cuBLAS/nvjet, CUTLASS, grouped), the rest (elementwise, copies, casts,
    reductions, the optimizer: what fusion or fewer passes remove), and their total."""
    out = {"total": 0.0, "gemm": 0.0, "attention": 0.0, "other": 0.0}
    for k in kernels:
        name = k["kernel"].lower()
        kind = ("attention" if any(s in name for s in ("sdpa", "flash", "fmha", "attention"))
                else "gemm" if any(s in name for s in ("gemm", "nvjet", "xmma", "cublas", "cutlass"))
                else "other")
        out[kind] += k["ms"]
        out["total"] += k["ms"]
    return out


def launches_per_step(step: Callable[[], Any], device: torch.device) -> Dict[str, int]:
    """Operators one call of `step` dispatches (mpoverlap/training/launch_count.py; on a GPU each
    is a kernel launch of host time): with the step time, the host time per operator a
    host-bound step pays. One extra, counted call (the counter's own overhead slows it)."""
    from mpoverlap.training.launch_count import count_launches

    with count_launches() as launches:
        step()
        _sync(device)
    return {"launches": launches.ops, "foreach_tensors": launches.foreach_tensors}


def figures(times: List[float], tokens_per_step: int, flops_per_token: float, peak_tflops: Optional[float],
            device: torch.device) -> Dict[str, Any]:
    from mpoverlap.training.metrics import throughput

    step_s = statistics.median(times)
    row = {"step_s": step_s, "steps_s": times, "tokens_per_s": tokens_per_step / step_s,
           **throughput(flops_per_token, tokens_per_step, step_s, 1, peak_tflops)}
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class HFLoop:
    """transformers' LlamaForCausalLM of the same keys (hf_config), the plain loop's step."""

    def __init__(self, cfg: Any, dataset, device: torch.device) -> None:
        from omegaconf import OmegaConf
        from transformers import LlamaConfig, LlamaForCausalLM

        from mpoverlap.interop.hf_mapping import hf_config
        from mpoverlap.precision import autocast_context
        from mpoverlap.training.lr import LRSchedule

        from bench.common import adamw_groups

        keys = hf_config(OmegaConf.to_container(cfg.model, resolve=True))
        keys = {k: v for k, v in keys.items() if k not in ("architectures", "model_type", "torch_dtype")}
        t = cfg.train
        torch.manual_seed(t.seed)
        self.model = LlamaForCausalLM(LlamaConfig(**keys, attn_implementation="sdpa")).to(device)
        self.cfg, self.dataset, self.device = cfg, dataset, device
        self.autocast = autocast_context(t.precision, device)
        self.optimizer = torch.optim.AdamW(adamw_groups(self.model, t.weight_decay), lr=t.lr,
                                           betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                           fused=device.type == "cuda")
        self.schedule = LRSchedule.from_config(t)
        self.step = 0

    def train_step(self) -> Dict[str, Any]:
        import torch.nn.functional as F

        from bench.common import step_with_lr
        from mpoverlap.training.data import global_batch

        t = self.cfg.train
        micro = global_batch(self.dataset, self.step, t.global_batch_size, t.seed).split(t.micro_batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = None
        for mb in micro:
            mb = mb.to(self.device, non_blocking=True)
            with self.autocast:
                logits = self.model(input_ids=mb[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), mb[:, 1:].flatten()) / len(micro)
            loss.backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip, foreach=True)
        step_with_lr(self.optimizer, self.schedule(self.step))
        self.step += 1
        return {"loss_local": loss_sum}


def init_world_of_one() -> None:
    """RANK 0 of 1 (gloo for CPU tensors, NCCL for CUDA ones) for the Trainer."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)


def measure(shape: str, out: Path, device_name: str = "cuda", warmup: int = 2, steps: int = 3,
            sides=("mpoverlap", "plain", "hf", "compiled"), hardware: Optional[str] = None,
            extra: Optional[List[str]] = None) -> Dict[str, Any]:
    """Every side of one shape; the result is (re)written to `out` after each side. A side that
    fails records its error and the next one runs."""
    from mpoverlap.config import compose
    from mpoverlap.models.flops import flops_per_token
    from mpoverlap.training.data import build_datasets
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.metrics import bf16_peak_tflops
    from mpoverlap.training.setup import init_distributed

    from bench.host_profile import host_profile
    from bench.overhead import PlainLoop

    device = torch.device(device_name)
    overrides = overrides_of(shape, device.type) + list(extra or [])
    run_dir = out.parent / f"run-{shape}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = compose(overrides + [f"run.dir={run_dir}"])
    t, m = cfg.train, cfg.model
    tokens = t.global_batch_size * m.seq_length
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    hardware = hardware or hardware_preset(gpu)
    peak = bf16_peak_tflops(device)
    result: Dict[str, Any] = {"shape": shape, "overrides": overrides, "device": gpu, "tokens_per_step": tokens,
                              "flops_per_token": flops_per_token(m), "peak_bf16_tflops": peak, "sides": {}}

    def save() -> None:
        out.write_text(json.dumps(result, indent=1))

    try:
        result["simulated"] = sim_prediction(overrides, hardware)
    except Exception as err:  # noqa: BLE001 - a report records every part's failure and goes on
        result["simulated"] = {"error": f"{type(err).__name__}: {err}"}
    save()
    train_data = None
    for side in sides:
        if ((side == "hf" and shape not in HF_SHAPES) or (side == "compiled" and shape not in COMPILED_SHAPES)
                or (side in ("fp8", "fp8_compiled") and shape not in FP8_SHAPES)):
            continue
        runner = None
        try:
            _free(device)
            if side in TRAINER_SIDES:
                init_world_of_one()
                side_cfg = compose(side_overrides(overrides, side) + [f"run.dir={run_dir}"]) if side != "mpoverlap" else cfg
                runner = Trainer(side_cfg, init_distributed(side_cfg), run_dir)
                train_data = runner.train_data
            else:
                if train_data is None:
                    train_data, _ = build_datasets(cfg.data, m.seq_length, m.vocab_size)
                runner = PlainLoop(cfg, train_data, device) if side == "plain" else HFLoop(cfg, train_data, device)
            times = time_steps(runner.train_step, device, warmup, steps)
            row = figures(times, tokens, flops_per_token(m), peak, device)
            if side in TRAINER_SIDES:  # the estimate models the Trainer's step, not the loops
                row["estimated_peak_gib"] = estimated_peak_gib(side_cfg)
            kernels = top_kernels(runner.train_step, device, n=None)
            row["top_kernels"], row["gpu_ms"] = kernels[:40], gpu_time_by_kind(kernels)
            if side in ("fp8", "fp8_compiled"):
                row["fp8_kernels"] = fp8_kernels(kernels)[:20]
            if side not in ("compiled", "fp8_compiled"):  # a dispatch mode around compiled regions could recompile them
                row.update(launches_per_step(runner.train_step, device))
            if side in TRAINER_SIDES:  # overlap.comm_priority: the kinds created high-priority
                row["high_priority_groups"] = list(runner.state.high_priority)
            if side == "mpoverlap":  # two more profiled steps: the Trainer's eager step only (time budget)
                row["host"] = host_profile(runner.train_step, device, lambda: _sync(device))
            result["sides"][side] = row
        except Exception as err:  # noqa: BLE001
            result["sides"][side] = {"error": f"{type(err).__name__}: {err}",
                                     "traceback": traceback.format_exc(limit=6)}
        finally:
            if runner is not None and hasattr(runner, "close"):
                runner.close()
            runner = None
            save()
    return result


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), required=True)
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--hardware", default=None, help="conf/hardware preset for the prediction (default: by GPU name)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sides", default="mpoverlap,plain,hf,compiled")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from mpoverlap.training.setup import shutdown_distributed

    try:
        measure(a.shape, out, "cuda", a.warmup, a.steps, tuple(a.sides.split(",")), a.hardware)
    finally:
        shutdown_distributed()  # the groups freed before interpreter exit (training/setup.py)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
