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
        text = (f"loss {row['loss']:.4f} lr {row['lr']:.2e} gnorm {row['grad_norm']:.3f} "
                f"{row['tokens_per_s']:,.0f} tok/s exposed comm: {format_comm(row['comm'])}")
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
    return {"aux_loss": total["aux_loss"] / calls, "z_loss": total["z_loss"] / calls,
            "dropped_fraction": total["dropped_slots"] / max(total["routed_slots"], 1.0)}
