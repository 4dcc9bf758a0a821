"""train.tensorboard=true: the metrics rows as TensorBoard scalars in <run.dir>/tensorboard/.

Written by global rank 0 only (the rows are already reduced over ranks). Tags:
  train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/step_time_s, val/loss
  comm/<mode>/in_flight_s    time the mode's handles were in flight per step (the row's time_s)
  comm/<mode>/exposed_s      time compute sat blocked on them per step
  comm/<mode>/exposed_share  exposed_s / in_flight_s (0 when nothing was in flight)
torch.utils.tensorboard needs the `tensorboard` package, an optional extra: mpoverlap-train
refuses train.tensorboard=true without it before any worker starts (`tensorboard_missing`).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Dict, Optional

EXTRA_HINT = ("train.tensorboard=true needs the optional `tensorboard` package: pip install "
              "'mpoverlap[tensorboard]' (or pip install tensorboard), or set train.tensorboard=false")
_TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s")


def tensorboard_missing() -> Optional[str]:
    """None when the package is importable, else the message (cheap: no import)."""
    return None if importlib.util.find_spec("tensorboard") is not None else EXTRA_HINT


def scalars(row: Dict[str, Any]) -> Dict[str, float]:
    """{tag: value} of one metrics row."""
    out: Dict[str, float] = {}
    if "val_loss" in row:
        out["val/loss"] = float(row["val_loss"])
    if "loss" not in row:
        return out
    for key in _TRAIN_KEYS:
        if key in row:
            out[f"train/{key}"] = float(row[key])
    for mode, c in sorted((row.get("comm") or {}).items()):
        in_flight, exposed = float(c["time_s"]), float(c["exposed_s"])
        out[f"comm/{mode}/in_flight_s"] = in_flight
        out[f"comm/{mode}/exposed_s"] = exposed
        out[f"comm/{mode}/exposed_share"] = exposed / in_flight if in_flight > 0 else 0.0
    return out


class TensorBoardWriter:
    def __init__(self, run_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from mpoverlap.config import ConfigError

            raise ConfigError(EXTRA_HINT) from None
        self.dir = Path(run_dir) / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.dir))

    def write(self, row: Dict[str, Any]) -> None:
        step = int(row.get("step", 0))
        for tag, value in scalars(row).items():
            self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
