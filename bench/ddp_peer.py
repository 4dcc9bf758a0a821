"""The torch DDP peer sides of bench.dp_overlap: DDP on the same model class, microbatches and
optimizer settings, bare (the no-communication floor) or with one of DDP's communication hooks
(bf16_compress_hook, powerSGD_hook), and `bucket_ordered`, which gives gloo NCCL's order for a
hook's chained collectives."""
from __future__ import annotations

import time
from typing import Any, Dict, List

from bench.common import adamw_groups, step_with_lr

# name -> (wrapped in DDP, communication hook)
TORCH_SIDES = {"torch_ddp": (True, None), "torch_ddp_bf16_hook": (True, "bf16"),
               "torch_ddp_powersgd": (True, "powersgd"), "local_no_comm": (False, None)}


class DDPLoop:
    """torch DDP on the same model class, microbatches and optimizer settings (wrap=False:
    the bare model, nothing reduced)."""

    def __init__(self, cfg: Any, dataset, dp_rank: int, dp_size: int, bucket_mb: float, wrap: bool = True,
                 hook: Any = None) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from mpoverlap.models.gpt import GPT
        from mpoverlap.training.lr import LRSchedule

        t = cfg.train
        self.cfg, self.dataset, self.dp_rank, self.dp_size = cfg, dataset, dp_rank, dp_size
        self.model = GPT(cfg.model, seed=t.seed)
        # wrap=False: the bare model, no gradient reduction at all (the compute-only floor).
        self.wrap = wrap
        # A hooked DDP gets a process group of its own: PowerSGD chains its all-reduces in future
        # callbacks, and on the world group they could interleave with another side's collectives.
        group = None
        if wrap and hook is not None:
            import torch.distributed as dist

            group = dist.new_group(list(range(dist.get_world_size())))
        self.ddp = (DistributedDataParallel(self.model, bucket_cap_mb=bucket_mb, process_group=group) if wrap
                    else self.model)
        if hook == "bf16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            # DDP's own hook, called through a function of another name: register_comm_hook refuses
            # the name bf16_compress_hook without CUDA/NCCL, but the hook's bf16 all-reduce runs on
            # gloo as it is.
            def bf16_hook_on_gloo(state, bucket):
                return default_hooks.bf16_compress_hook(state, bucket)
            self.ddp.register_comm_hook(None, bf16_hook_on_gloo)
        elif hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=4,
                                                start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
            self.ddp.register_comm_hook(state, bucket_ordered(powerSGD_hook.powerSGD_hook))
        self.optimizer = torch.optim.AdamW(adamw_groups(self.model, t.weight_decay), lr=t.lr,
                                           betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                           foreach=True)
        self.schedule = LRSchedule.from_config(t)
        self.step = 0
        self.fwd_s: List[float] = []  # microbatches without communication: pure compute
        self.bwd_s: List[float] = []

    def train_step(self) -> Dict[str, Any]:
        import torch

        from mpoverlap.training.data import global_batch, rank_microbatches

        t = self.cfg.train
        lr = self.schedule(self.step)
        batch = global_batch(self.dataset, self.step, t.global_batch_size, t.seed)
        micro = rank_microbatches(batch, self.dp_rank, self.dp_size, t.micro_batch_size)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros(())
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            ctx = self.ddp.no_sync() if self.wrap and not last else _null()
            with ctx:
                a = time.perf_counter()
                loss = self.model.loss(self.ddp(mb[:, :-1]), mb[:, 1:]) / len(micro)
                b = time.perf_counter()
                loss.backward()
                c = time.perf_counter()
            if not (last and self.wrap):
                self.fwd_s.append(b - a)
                self.bwd_s.append(c - b)
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip, foreach=True)
        step_with_lr(self.optimizer, lr)
        self.step += 1
        return {"loss_local": loss_sum, "grad_norm": float(grad_norm), "step_time_s": time.perf_counter() - t0}

    def bucket_sizes_mb(self) -> List[float]:
        """DDP's bucket sizes (MiB) after its rebuild in the first iterations (diagnostic)."""
        if not self.wrap:
            return []
        try:
            data = self.ddp._get_ddp_logging_data()
        except Exception:  # noqa: BLE001 - private API, diagnostic only
            return []
        raw = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
        return [round(int(x) / 2**20, 3) for x in str(raw).split(",") if x.strip().isdigit()]


def bucket_ordered(hook):
    """`hook` with each bucket's collectives issued after the previous bucket's have completed.

    powerSGD_hook issues its second and third all-reduces (Ps, Qs) from future callbacks, which
    gloo runs when the previous all-reduce completes on that rank: with several buckets, one
    rank can issue bucket b's Q all-reduce while the other issues bucket b+1's first one, on the
    same group, and gloo pairs collectives of different sizes (a size mismatch or a hang). Under
    NCCL the callbacks run when the work is enqueued, so every collective of bucket b is issued
    before bucket b+1's hook runs; this wrapper gives gloo that order: bucket b+1's hook starts
    in the callback of bucket b's last future (at once when nothing is in flight)."""
    import torch

    tail: List[Any] = [None]

    def ordered(state, bucket):
        out = torch.futures.Future()

        def start(_=None):
            try:
                hook(state, bucket).add_done_callback(lambda f: _forward(f, out))
            except Exception as e:  # noqa: BLE001 - handed to DDP through the future
                out.set_exception(e)

        prev, tail[0] = tail[0], out
        if prev is None or prev.done():
            start()
        else:
            prev.add_done_callback(start)
        return out
    return ordered


def _forward(fut, out) -> None:
    try:
        out.set_result(fut.value())
    except Exception as e:  # noqa: BLE001 - handed to DDP through the future
        out.set_exception(e)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
