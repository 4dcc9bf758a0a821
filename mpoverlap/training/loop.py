"""The Trainer every worker builds: the model chunks of its stage, data parallelism, the
optimizer, the pipeline; one optimizer step (`train_step`) and the validation loss. Its run (the
steps, their metrics rows, checkpoints and the stop a SIGTERM asks for) is training/run_loop.py;
its checkpoints training/resume.py.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from mpoverlap.comm import CommLedger, wait_all
from mpoverlap.context_parallel import ContextParallelAttention, positions_for_cp, split_for_cp
from mpoverlap.data_parallel import DataParallel, DataParallelAdamW
from mpoverlap.data_parallel.fsdp import gpt_units
from mpoverlap.data_parallel.grad_wire import error_feedback_on, is_wire
from mpoverlap.data_parallel.levels import param_gather_dtype, resolve_level, shards_grads
from mpoverlap.models.mtp import mtp_targets
from mpoverlap.moe import moe_kwargs
from mpoverlap.moe.balance import update_expert_biases
from mpoverlap.moe.dispatch_wire import resolve_dispatch_wire
from mpoverlap.overlap.config import CommOverlapConfig, ep_chunks
from mpoverlap.pairing import train_paired
from mpoverlap.parallel import ParallelState
from mpoverlap.precision import DTYPES, autocast_context, compute_precision, step_cast_cache
from mpoverlap.precision.fp8_select import mark_fp8_gemms, torchao_missing
from mpoverlap.tensor_parallel import allreduce_sequence_parallel_grads, tp_kwargs
from mpoverlap.training.checkpoint import Checkpointer, checkpoint_io_group
from mpoverlap.training.data import build_datasets, rank_batch, rank_microbatches
from mpoverlap.training.faults import FaultInjector
from mpoverlap.training.lr import LRSchedule
from mpoverlap.training.node_failure import lost_peer
from mpoverlap.training.prefetch import BatchPrefetcher
from mpoverlap.training.pipeline_glue import PipelineRunner, build_chunks, pipeline_ties, schedule_layout
from mpoverlap.training.pipeline_ties import PipelineTies
from mpoverlap.training.resume import Resumable
from mpoverlap.training.run_loop import RunLoop
from mpoverlap.training.setup import agreed_bucket, init_distributed, shared_run_dir, shutdown_distributed
from mpoverlap.training.stop_agreement import StopAgreement


class NonFiniteError(FloatingPointError):
    """A NaN/Inf gradient with train.on_nonfinite=stop."""


class Trainer(Resumable, RunLoop):
    def __init__(self, cfg: Any, state: ParallelState, run_dir: Path) -> None:
        if cfg.train.precision == "fp8" and torchao_missing():  # before any group or model is built
            from mpoverlap.config import ConfigError

            raise ConfigError(torchao_missing())
        self.cfg, self.state, self.run_dir = cfg, state, run_dir
        self.is_rank0 = state.rank == 0
        self.overlap = CommOverlapConfig.from_config(cfg, state.world)
        self.ledger = CommLedger()
        t = cfg.train
        self.cp_size, self.cp_rank = state.grid.cp, state.coords.cp
        self.mtp_depths = int(cfg.model.mtp_num_layers)
        self._positions: dict = {}  # sequence length -> this rank's positions (see _split)
        attention = {}
        if self.cp_size > 1:
            attention["core_attention"] = ContextParallelAttention(
                state, cfg.parallel.cp_comm, overlap=self.overlap.cp.enabled, ledger=self.ledger,
                backend=cfg.parallel.cp_attention_backend)
        self.tp = None
        if state.grid.tp > 1:
            self.tp = tp_kwargs(state, sequence_parallel=bool(cfg.parallel.sequence_parallel),
                                overlap=self.overlap.tp.enabled, ledger=self.ledger)
        self.pp = state.grid.pp
        moe = None
        if cfg.model.num_experts > 0:
            moe = moe_kwargs(state, overlap=self.overlap.ep.enabled, num_chunks=ep_chunks(cfg, state.world),
                             ledger=self.ledger,
                             sequence_parallel=state.grid.tp > 1 and bool(cfg.parallel.sequence_parallel),
                             etp=state.grid.etp, capacity_padding=not self.overlap.ep_pairing.enabled,
                             dispatch_wire=resolve_dispatch_wire(t.ep_dispatch_dtype, compute_precision(t.precision)))
        layout = schedule_layout(cfg.parallel, cfg.parallel.vpp, cfg.model, self.pp)
        self.chunks = [c.to(state.device) for c in build_chunks(
            cfg.model, self.pp, cfg.parallel.vpp, state.coords.pp, t.seed, layout=layout, tp=self.tp, moe=moe,
            compile_backend=str(t.compile_backend) if t.compile else None, **attention)]
        self.moe_layers = [layer for c in self.chunks for layer in c.moe_layers()]
        # train.precision=fp8: the blocks' projections and MLP linears run their GEMMs in FP8
        # (precision/fp8_select.py); everything else is the bf16 run.
        self.fp8_gemms = []
        if t.precision == "fp8":
            self.fp8_gemms = [n for c in self.chunks for n in mark_fp8_gemms(c, str(t.fp8_recipe))]
        # One chunk: the model itself. Pipelined: this stage's chunks, whose blocks keep their
        # global names; `params_by_name` maps the layout-free names used in checkpoints.
        self.model = self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)
        prefixed = len(self.chunks) > 1
        self.dp_names = {n: (n.split(".", 1)[1] if prefixed else n) for n, _ in self.model.named_parameters()}
        # a copy (pipeline_duplicate) never hides the original of its name on this rank
        self.params_by_name = {}
        for n, p in sorted(self.model.named_parameters(), key=lambda item: getattr(item[1], "pipeline_duplicate", False)):
            self.params_by_name.setdefault(self.dp_names[n], p)
        # Expert weights replicated over tp under SP (etp = 1) get partial gradients over tp too:
        # their buckets reduce over tp x edp inside backward (RankGrid.expert_grad_kind), so they
        # leave the flat SP reduction, which keeps the small replicated rest (norms, routers).
        expert_kind = "edp"
        if self.moe_layers:
            expert_kind = state.grid.expert_grad_kind(bool(cfg.parallel.sequence_parallel))
        self.sequence_parallel_params = [p for c in self.chunks for p in c.sequence_parallel_params()
                                         if not (expert_kind == "tp_edp" and getattr(p, "expert_parallel", False))]
        # Weights held twice in the pipeline (training/pipeline_ties.py): the tied embedding on
        # the first and the last stage, the MTP chunk's copies of the loop_mtp layouts; their
        # gradients add up (zbv's V holds both ends on stage 0: one parameter, nothing to add).
        self.ties = PipelineTies([(self.dp_names[n], p) for n, p in self.model.named_parameters()],
                                 pipeline_ties(cfg.model, self.pp, layout))
        self.sharding = resolve_level(t.dp_sharding, t.distributed_optimizer)
        self.bucket = agreed_bucket(cfg, state)  # overlap.dp_bucket_mb, auto resolved (the plan prints why)
        self.ddp = DataParallel(
            self.model, state, group_kind="dp_cp", expert_group_kind=expert_kind, overlap=self.overlap.dp.enabled,
            bucket_mb=self.bucket.mb, sharding=self.sharding,
            ledger=self.ledger, reduce_dtype=None if is_wire(t.grad_reduce_dtype) else DTYPES[t.grad_reduce_dtype],
            grad_wire=str(t.grad_reduce_dtype) if is_wire(t.grad_reduce_dtype) else None,
            error_feedback=error_feedback_on(t.grad_error_feedback, t.grad_reduce_dtype),
            units=gpt_units(self.chunks) if shards_grads(self.sharding) else None,
            prefetch=int(cfg.overlap.dp_prefetch), reshard_after_forward=bool(t.reshard_after_forward),
            param_gather_dtype=param_gather_dtype(t.param_gather_dtype, compute_precision(t.precision), self.sharding),
            delay=int(cfg.overlap.dp_delay),
            own_buckets=self.ties.params)
        self.optimizer = DataParallelAdamW(
            self.ddp, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
            weight_decay=t.weight_decay, param_gather_overlap=self.overlap.dp_param_gather.enabled,
            tp_group=state.group("tp"), pp_group=state.group("pp"),
            ep_group=state.group("ep") if self.moe_layers else None)
        self.schedule = LRSchedule.from_config(t)
        self.train_data, self.val_data = build_datasets(cfg.data, cfg.model.seq_length, cfg.model.vocab_size)
        # Context-parallel ranks of one replica share its samples (each holds part of every
        # sequence), so the batch is sliced by the dp coordinate alone.
        self.dp_rank = state.coords.dp
        self.dp_size = state.grid.dp
        # The next step's microbatches (this rank's only) are built while this step runs.
        self.batches = BatchPrefetcher(self._rank_batch, state.device)
        # The router losses are attached inside each MoE layer (they live on every pipeline
        # stage); like the LM loss, each microbatch's share is 1 / microbatches.
        num_micro = t.global_batch_size // (t.micro_batch_size * self.dp_size)
        for layer in self.moe_layers:
            layer.aux_loss_scale = 1.0 / num_micro
        ck_dir = cfg.checkpoint.dir or str(run_dir / "checkpoints")
        # checkpoint.async_save: the background writes talk over a gloo group of their own.
        async_save = bool(cfg.checkpoint.async_save)
        self.checkpointer = Checkpointer(ck_dir, keep=cfg.checkpoint.keep, async_save=async_save, log=self.log,
                                         group=checkpoint_io_group(t.comm_timeout_s) if async_save else None,
                                         config_yaml=OmegaConf.to_yaml(cfg, resolve=True))
        # train.precision: the same autocast on CPU and CUDA (parameters stay fp32).
        self.autocast = autocast_context(t.precision, state.device)
        self.step = 0
        self.faults = FaultInjector(state.rank)
        # SIGTERM on any rank: every rank stops after the same step (agreed through the
        # rendezvous store once a signal came; nothing per step). run() asks it at each step
        # boundary; train_step never does, so a caller stepping the trainer takes no part.
        self.stop = StopAgreement.default(state.world, state.rank, self.ledger, float(t.comm_timeout_s))
        self.pipeline = None
        self.pairing_trace = None  # a list: the paired sub-steps' order (tests/test_pairing.py)
        if self.pp > 1:
            self.pipeline = PipelineRunner(self.chunks, state, cfg, num_micro, self.overlap.pp.enabled, self.ledger,
                                           self.ddp, self._split, self.autocast,
                                           pairing=self.overlap.ep_pairing.enabled)

    # ---- one optimizer step -------------------------------------------------------------
    def _rank_batch(self, step: int):
        t = self.cfg.train
        return rank_batch(self.train_data, step, t.global_batch_size, t.seed, self.dp_rank, self.dp_size,
                          t.micro_batch_size)

    def _split(self, mb_BS1: torch.Tensor):
        """A microbatch of windows [B, S+1] -> (tokens, targets, position_ids) of this rank:
        with context parallelism the load-balanced share of every sequence and its global
        positions; each cp rank then averages over the same number of tokens, so the mean of
        the cp ranks' losses (taken by the dp x cp gradient average) is the global mean."""
        mb_BS1 = mb_BS1.to(self.state.device, non_blocking=True)
        tokens_BS, targets_BS = mb_BS1[:, :-1], mb_BS1[:, 1:]
        if self.mtp_depths:  # [B, S, 1 + D]: the MTP depths' shifted ids, from the whole window
            targets_BS = mtp_targets(mb_BS1, self.mtp_depths)
        S = tokens_BS.shape[1]
        # the same positions tensor for every microbatch of a length (the model makes RoPE's
        # tables once for it: models/gpt.py embed)
        positions = self._positions.get(S)
        if positions is None:
            positions = self._positions[S] = (
                torch.arange(S, device=tokens_BS.device) if self.cp_size == 1
                else positions_for_cp(S, self.cp_rank, self.cp_size, device=tokens_BS.device))
        if self.cp_size == 1:
            return tokens_BS, targets_BS, positions
        return (split_for_cp(tokens_BS, self.cp_rank, self.cp_size, seq_dim=1),
                split_for_cp(targets_BS, self.cp_rank, self.cp_size, seq_dim=1), positions)

    def close(self) -> None:
        """End of the run: wait what is still in flight (a save, parameter gathers, gradient
        reductions, the ledger's background waits, the batch built ahead) and remove the
        gradient hooks, the one link to this trainer that Python's collector cannot see
        (DataParallel.close). Once the trainer
        is unreachable, `shutdown_distributed` then frees its process groups, and joins their
        threads, before interpreter exit. Idempotent."""
        self.checkpointer.wait(raise_error=False)
        self.batches.close()
        self.optimizer.finish_param_sync()
        self.ddp.close()
        self.ledger.close()

    def train_step(self) -> Dict[str, Any]:
        """One optimizer step: {"loss_local", "lr", "grad_norm", "step_time_s", "skipped"}. Whether
        the run stops after it is the run's question (run_loop.py), not the step's."""
        t = self.cfg.train
        self.faults.at_step(self.step + 1)
        lr = self.schedule(self.step)
        micro = self.batches.get(self.step, self.step + 1 if self.step + 1 < t.steps else None)
        t0 = time.perf_counter()
        self.ddp.start_step()
        self.mtp_loss_sum = torch.zeros((), device=self.state.device)  # this stage's, summed by its forwards
        # each weight cast to bf16 once a step, not once a microbatch; its gradient added in place
        with step_cast_cache(t.precision, self.state.device, self.sharding == "optim_grads_params"):
            if self.pipeline is not None:
                loss_sum = self.pipeline.train_microbatches(micro, self.pairing_trace)
                self.mtp_loss_sum = self.pipeline.mtp_loss_sum
            else:
                loss_sum = self._train_microbatches(micro)
        self.ddp.finish_grad_sync()
        if self.ties:
            # Every copy gets the sum of their gradients: full gradients, or under ZeRO-1/2/3 the
            # same shard on both stages (each copy is a bucket of its own, split alike; under
            # ZeRO-1 the rest of .grad is unreduced and never read).
            self.ties.sum_grads(self.ddp, self.state.group, self.ledger)
        if self.sequence_parallel_params:
            # Norm weights saw only this rank's S/tp positions: sum their gradients over TP
            # (under ZeRO-2/3 the shards: TP peers have the same buckets and shard rank).
            wait_all(allreduce_sequence_parallel_grads(
                self.sequence_parallel_params, self.tp["tp_group"], self.ledger, self.overlap.tp.enabled,
                grads=self.ddp.reduced_grads(self.sequence_parallel_params)))
        grad_norm = self.optimizer.clip_grad_norm(t.grad_clip)  # the step's one host read
        # The norm is global (reduced over every group that shards gradients), so every rank
        # takes the same decision; a non-finite loss makes non-finite gradients.
        skipped = not math.isfinite(grad_norm)
        if skipped and t.on_nonfinite == "stop":
            raise NonFiniteError(f"non-finite gradient at step {self.step + 1} (grad norm {grad_norm}, local loss "
                                 f"{loss_sum.item()}); stopped before the update, so no non-finite value reached "
                                 "the weights or a checkpoint. train.on_nonfinite=skip skips such steps instead")
        # overlap.dp_delay=1: the buffer holds the previous step's gradient, none at the first step
        # (its norm is 0 and it makes no update: data_parallel/delayed.py).
        if not skipped and (not self.ddp.delay or self.ddp.applies_delayed_grad):
            self.optimizer.step(lr)
        update_expert_biases(self.moe_layers, self.state, self.ledger, apply=not skipped)
        # The step boundary: CUDA timings already complete are read (their events reused) and
        # a strict ledger (the test suite's) raises for any handle issued and never waited.
        self.ledger.end_step()
        step_time = time.perf_counter() - t0
        self.step += 1
        out = {"loss_local": loss_sum, "lr": lr, "grad_norm": float(grad_norm), "step_time_s": step_time,
               "skipped": skipped}
        if self.mtp_depths:
            out["mtp_loss_local"] = self.mtp_loss_sum
        return out

    def _train_microbatches(self, micro) -> torch.Tensor:
        if self.overlap.ep_pairing.enabled:  # pp 1 (pp > 1: the pipeline's paired table)
            return train_paired(self.model, micro, self._split, self.ddp, autocast=self.autocast,
                                trace=self.pairing_trace, mtp_sum=self.mtp_loss_sum)
        loss_sum = torch.zeros((), device=self.state.device)
        for i, mb in enumerate(micro):
            tokens, targets, positions = self._split(mb)
            self.ddp.set_last_microbatch(i == len(micro) - 1)
            mtp = {"mtp_targets": targets} if self.mtp_depths else {}
            with self.autocast:
                logits = self.ddp(tokens, position_ids=positions, fp32_logits=False, **mtp)
            loss = self.model.loss(logits, targets) / len(micro)
            del logits  # the loss keeps what its backward needs (under TP its softmax, not these logits)
            self.ddp.mark_unused(loss)  # parameters this microbatch did not use: their buckets need not wait
            loss.backward()
            if self.mtp_depths:  # the LM loss reported, the MTP loss apart
                main, extra = self.model.last_loss_parts
                loss_sum += main / len(micro)
                self.mtp_loss_sum += extra / len(micro)
            else:
                loss_sum += loss.detach()
        return loss_sum

    def _mean_over_replicas(self, value: torch.Tensor) -> float:
        """The replicas' mean of a loss that lives on the last pipeline stage."""
        if self.pp > 1:  # other stages hold 0: the sum over the pipeline is the last stage's
            value = value.clone()
            dist.all_reduce(value, group=self.state.group("pp"))
        group = self.state.group("dp_cp")
        if group is not None:
            value = value.clone()
            dist.all_reduce(value, group=group)
            value /= self.state.size("dp_cp")
        return float(value)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.optimizer.finish_param_sync()
        t = self.cfg.train
        total = torch.zeros((), device=self.state.device)
        n = max(1, min(t.eval_iters, len(self.val_data) // t.global_batch_size or 1))
        for i in range(n):
            idx = [(i * t.global_batch_size + j) % len(self.val_data) for j in range(t.global_batch_size)]
            batch = torch.stack([self.val_data[k] for k in idx])
            micro = rank_microbatches(batch, self.dp_rank, self.dp_size, t.micro_batch_size)
            if self.pipeline is not None:
                total += self.pipeline.eval_microbatches(micro) / n
                continue
            for mb in micro:
                tokens, targets, positions = self._split(mb)
                targets = targets[..., 0] if self.mtp_depths else targets  # the LM loss alone
                with self.autocast:
                    logits = self.model(tokens, position_ids=positions, fp32_logits=False)
                total += self.model.loss(logits, targets) / (len(micro) * n)
        self.ddp.reshard()
        return self._mean_over_replicas(total)

    def log(self, message: str) -> None:
        if self.is_rank0:
            print(message, flush=True)


def run_worker(cfg: Any) -> Dict[str, Any]:
    state = None
    try:
        state = init_distributed(cfg)
        return _train(cfg, state)
    except RuntimeError as err:
        lost = lost_peer(err, state.hosts, state.rank) if state is not None else None
        if lost is None:
            raise
        raise lost from err
    finally:
        shutdown_distributed()  # the trainer and its groups are unreachable by now: freed here


def _train(cfg: Any, state: ParallelState) -> Dict[str, Any]:
    trainer = Trainer(cfg, state, shared_run_dir(cfg))
    result = trainer.run()
    # Not on an error: waiting the collectives of a failed run could block until the timeout.
    trainer.close()
    return result
