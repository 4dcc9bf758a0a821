"""Warmup + cosine learning-rate schedule: a function of the step and its own keys only,
so a resumed run that asks for more steps keeps the same schedule."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int

    @classmethod
    def from_config(cls, train_cfg) -> "LRSchedule":
        decay = train_cfg.lr_decay_steps if train_cfg.lr_decay_steps is not None else train_cfg.steps
        return cls(lr=float(train_cfg.lr), min_lr=float(min(train_cfg.min_lr, train_cfg.lr)),
                   warmup_steps=int(train_cfg.lr_warmup_steps), decay_steps=int(decay))

    def __call__(self, step: int) -> float:
        """LR for 0-based optimizer step `step`: linear warmup to `lr`, cosine down to `min_lr`
        at `decay_steps`, flat afterwards."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
