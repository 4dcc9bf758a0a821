"""The Trainer's run (a mixin of `Trainer`, loop.py): the steps from the resumed one to
`train.steps`, and between them the metrics rows, validation, the interval checkpoints and the
stop that a SIGTERM on any rank asks for.

The step itself (`Trainer.train_step`) knows nothing of the stop: the run asks the stop
agreement (training/stop_agreement.py) at each step boundary, so that code stepping a Trainer
directly (tests, benchmarks, the launch and host-read counters) takes no part in it.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import torch.distributed as dist
from omegaconf import OmegaConf

from mpoverlap.comm.ledger import mean_over_ranks
from mpoverlap.models.flops import flops_per_token
from mpoverlap.models.gpt import num_parameters
from mpoverlap.overlap.plan import render_plan
from mpoverlap.training.metrics import (MetricsWriter, Progress, bf16_peak_tflops, moe_summary, peak_memory_bytes,
                                        throughput)
from mpoverlap.training.preemption import PREEMPTED_MARKER
from mpoverlap.training.profiling import RunProfiler


class RunLoop:
    """`run()` over the Trainer's state (cfg, state, run_dir, step, stop, checkpointer, ...)."""

    def run(self) -> Dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        # train.profile: trace + comm timeline of a window of steps (inert when off). Built
        # first so a window past train.steps fails before any step runs.
        profiler = RunProfiler.from_config(cfg, self.run_dir, self.state.rank, self.ledger, self.state.device,
                                           coords=self.state.coords)
        if self.is_rank0:
            print(render_plan(cfg, self.state.world, num_parameters(self.model),
                              f"{self.state.device.type}/{self.state.backend}", hosts=list(self.state.hosts),
                              bucket=self.bucket),
                  flush=True)
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
            (self.run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)  # a previous run's stop
        self.maybe_resume()
        if self.step >= t.steps:
            self.log(f"nothing to do: the checkpoint is at step {self.step} >= train.steps={t.steps}")
            return {"steps": self.step, "losses": []}
        writer = MetricsWriter(self.run_dir, enabled=self.is_rank0, tensorboard=bool(t.tensorboard))
        progress = Progress(total=t.steps, initial=self.step, enabled=self.is_rank0 and t.progress)
        losses = []
        wall0 = time.perf_counter()
        last_logged = self.step
        self.stop.install(self.step)
        try:
            while self.step < t.steps:
                profiler.step_begin(self.step + 1)
                out = self.train_step()
                # Whether every rank stops after this step (a SIGTERM on any rank): a lock and two
                # comparisons unless a signal came (training/stop_agreement.py).
                stop = self.stop.at_boundary(self.step)
                profiler.step_end(self.step)
                if out["skipped"]:
                    writer.write({"step": self.step, "nonfinite": True, "action": "skipped the update",
                                  "grad_norm": out["grad_norm"]})
                    progress.log(f"step {self.step}: non-finite gradient (norm {out['grad_norm']}), update skipped")
                # A stop logs its step too.
                if self.step % t.log_interval == 0 or self.step == t.steps or stop:
                    row = self.log_row(out, self.step - last_logged)
                    last_logged = self.step
                    losses.append(row["loss"])
                    writer.write(row)
                    progress.update(row)
                if stop:
                    return self._stop_for_sigterm(losses)
                if t.eval_interval and self.step % t.eval_interval == 0 and self.step < t.steps:
                    val = self.evaluate()
                    writer.write({"step": self.step, "val_loss": val})
                    progress.log(f"step {self.step}: validation loss {val:.4f}")
                if cfg.checkpoint.interval and (self.step % cfg.checkpoint.interval == 0 or self.step == t.steps):
                    self.save()
            val = self.evaluate()
            writer.write({"step": self.step, "val_loss": val})
            self.checkpointer.wait()
        finally:
            self.checkpointer.wait(raise_error=False)  # never leave a thread writing behind an error
            self.batches.close()  # the batch-ahead thread ends with the run (an error and a SIGTERM stop too)
            profiler.close()
            self.stop.restore()
            progress.close()
            writer.close()
        self.log(f"done: {self.step} steps in {time.perf_counter() - wall0:.1f}s, validation loss {val:.4f}; "
                 f"metrics in {self.run_dir / 'metrics.jsonl'}")
        return {"steps": self.step, "losses": losses, "val_loss": val}

    def _stop_for_sigterm(self, losses: List[float]) -> Dict[str, Any]:
        """Every rank agreed to stop after this step: save it (waiting a save in flight, an
        asynchronous one too: written, marked COMPLETE and renamed before the return)."""
        t0 = time.perf_counter()
        self.save()
        self.checkpointer.wait()
        if self.is_rank0:  # for launchers that cannot tell a preemption stop (slurm.sbatch)
            (self.run_dir / PREEMPTED_MARKER).write_text(f"{self.step}\n")
        self.log(f"SIGTERM: saved a checkpoint at step {self.step} in {time.perf_counter() - t0:.2f}s and stopped; "
                 "rerun the same command to continue")
        return {"steps": self.step, "losses": losses, "preempted": True}

    def log_row(self, out: Dict[str, Any], steps_since_log: int) -> Dict[str, Any]:
        """The metrics row; `comm` holds per-step means over the steps since the last row."""
        moe = [layer.stats_since() for layer in self.moe_layers]
        moe_sums = {k: sum(st[k] for st in moe) for k in moe[0]} if moe else None
        bubble = (self.state.coords.pp, self.pipeline.take_bubble(steps_since_log)) if self.pipeline else None
        gatherer = self.ddp.gatherer
        wire = {k: v / steps_since_log for k, v in gatherer.take_wire_bytes().items()} if gatherer is not None else {}
        mine = (self.ledger.reset(per=steps_since_log), peak_memory_bytes(self.state.device), moe_sums, bubble, wire)
        gathered: List[Optional[tuple]] = [None] * self.state.world
        if self.state.world > 1:
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        t = self.cfg.train
        tokens = t.global_batch_size * self.cfg.model.seq_length
        row = {"step": self.step, "loss": self._mean_over_replicas(out["loss_local"]), "lr": out["lr"],
               "grad_norm": out["grad_norm"], "step_time_s": out["step_time_s"],
               "tokens_per_s": tokens / out["step_time_s"], "comm": mean_over_ranks([c for c, *_ in gathered]),
               # Per rank, in rank order: RSS on CPU, max allocated on CUDA.
               "peak_memory_bytes": [m for _, m, *_ in gathered]}
        if "mtp_loss_local" in out:  # the MTP depths' mean loss, unscaled (row["loss"]: the LM loss)
            row["mtp_loss"] = self._mean_over_replicas(out["mtp_loss_local"])
        if self.pipeline is not None:
            # Per pipeline stage: seconds per step blocked on a receive (mean over the stage's ranks).
            per_stage = [[b for _, _, _, (s, b), _ in gathered if s == stage] for stage in range(self.pp)]
            row["pp_bubble_s"] = [sum(v) / len(v) for v in per_stage]
        row.update(throughput(flops_per_token(self.cfg.model), tokens, out["step_time_s"], self.state.world,
                              bf16_peak_tflops(self.state.device)))
        # ZeRO-3: the gathers' bytes (inside comm's dp bytes) per wire dtype, per step and rank
        for dtype in sorted({k for *_, w in gathered for k in w}):
            row[f"dp_gather_bytes_{dtype}"] = int(round(sum(w.get(dtype, 0) for *_, w in gathered) / len(gathered)))
        if self.moe_layers:
            row["moe"] = moe_summary([s for _, _, s, *_ in gathered if s is not None])
        return row
