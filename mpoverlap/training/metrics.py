"""metrics.jsonl (written by global rank 0 only) and the rank-0 progress display."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional


def peak_memory_bytes(device) -> int:
    """Peak memory of this process: max allocated on CUDA, peak resident set size on CPU."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) of NVIDIA data-centre GPUs, from the
# vendors' data sheets. Matched against torch.cuda.get_device_name() in order, so the more
# specific names (H100 PCIe, H100 NVL) come before the plain one (SXM).
BF16_PEAK_TFLOPS = (
    ("GB200", 2500.0), ("B200", 2250.0), ("B100", 1750.0), ("GH200", 989.0), ("H200", 989.0),
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H800", 989.0), ("H20", 148.0),
    ("A100", 312.0), ("A800", 312.0), ("A30", 165.0), ("A10", 125.0), ("L40S", 362.0), ("L40", 181.0),
    ("L4", 121.0),
)


def bf16_peak_tflops(device) -> Optional[float]:
    """The device's dense bf16 peak in TFLOP/s, or None where unknown (CPU, other GPUs)."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_TFLOPS if key in name), None)


def throughput(flops_per_token: float, tokens: int, step_time_s: float, world: int,
               peak_tflops: Optional[float]) -> Dict[str, float]:
    """`model_tflops_per_s` per rank (model FLOPs, Narayanan et al.'s formula, over the step
    time and the ranks) and `mfu` against the peak, only where the peak is known: an
    unknown peak leaves `mfu` out rather than reporting 0."""
    achieved = flops_per_token * tokens / step_time_s / world / 1e12
    row = {"model_tflops_per_s": achieved}
    if peak_tflops:
        row["mfu"] = achieved / peak_tflops
    return row


class MetricsWriter:
    """Appends one JSON object per logged step to `<run.dir>/metrics.jsonl`."""

    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool = False) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = None
        self._tb = None  # train.tensorboard: the same rows as scalars (tensorboard.py)
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            if tensorboard:
                from mpoverlap.training.tensorboard import TensorBoardWriter

                self._tb = TensorBoardWriter(run_dir)

    def write(self, row: Dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._tb is not None:
            self._tb.write(row)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def format_comm(comm: Dict[str, Dict[str, float]]) -> str:
    """`dp 12.3/40.1ms` = exposed / in-flight milliseconds per mode."""
    parts = [f"{mode} {row['exposed_s'] * 1e3:.1f}/{row['time_s'] * 1e3:.1f}ms" for mode, row in sorted(comm.items())]
    return " ".join(parts) if parts else "none"


class Progress:
    """A tqdm bar on a terminal; plain log lines otherwise (CI, files)."""

    def __init__(self, total: int, initial: int, enabled: bool, use_bar: Optional[bool] = None) -> None:
        self.enabled = enabled
        self.bar = None
        if not enabled:
            return
        if use_bar is None:
            use_bar = sys.stderr.isatty()
        if use_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, row: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        mfu = f" MFU {row['mfu']:.1%}" if "mfu" in row else ""
        bubble = (" pp bubble " + "/".join(f"{b * 1e3:.1f}" for b in row["pp_bubble_s"]) + "ms"
                  if "pp_bubble_s" in row else "")
        text = (f"loss {row['loss']:.4f} lr {row['lr']:.2e} gnorm {row['grad_norm']:.3f} "
                f"{row['tokens_per_s']:,.0f} tok/s{mfu} exposed comm: {format_comm(row['comm'])}{bubble}")
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(row["step"] - self.bar.n)
        else:
            print(f"step {row['step']:>6} | {text}", flush=True)

    def log(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def moe_summary(per_rank: List[Dict[str, float]]) -> Dict[str, float]:
    """Router figures since the last row, over every rank's MoE layers and forwards: the mean
    raw load-balancing loss (1.0 = perfectly balanced), the mean raw z-loss, and the share of
    routed (token, expert) slots dropped by the capacity factor (0 when dropless)."""
    total = {k: sum(r[k] for r in per_rank) for k in per_rank[0]}
    calls = max(total["calls"], 1.0)
    out = {"aux_loss": total["aux_loss"] / calls, "z_loss": total["z_loss"] / calls,
           "dropped_fraction": total["dropped_slots"] / max(total["routed_slots"], 1.0)}
    if total.get("bias_updates", 0.0) > 0:
        # Aux-loss-free balancing: max over mean of each layer's global per-expert load at
        # each bias update (1.0 = balanced), averaged over layers and steps.
        out["expert_load_max_over_mean"] = total["load_ratio"] / total["bias_updates"]
    return out
