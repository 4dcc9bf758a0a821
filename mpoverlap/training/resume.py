"""The Trainer's checkpoint side: what it saves, how it resumes, and initialising from a
Hugging Face directory (a mixin of `Trainer`, loop.py).

A save writes each rank's own shards at their global offsets (mpoverlap/checkpoint/): no rank
gathers a tensor it does not hold, whatever the sharding level. A resume reads, at any layout,
the parts this rank holds; checkpoints written with full tensors (the format before per-rank
shards) load the same way.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict

import torch

from mpoverlap.moe.balance import expert_biases
from mpoverlap.overlap.rules import _show
from mpoverlap.training.checkpoint import CheckpointError

if TYPE_CHECKING:
    from mpoverlap.checkpoint import TrainStateChunks

# mpoverlap.checkpoint (torch.distributed.checkpoint's planners) is imported where a save or a load
# happens, not at start-up: a run that neither saves nor loads never imports it (a start-up cost
# within the noise of a launch's ~12.5 CPU-s, DTensor being imported at start-up anyway).

# Model fields a checkpoint must agree on to be loadable into this model (every key that changes
# a parameter's shape or presence, or how the weights are read: RoPE scaling).
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
              "make_vocab_size_divisible_by", "norm", "activation", "tie_embeddings", "num_experts",
              "moe_top_k", "shared_expert", "moe_layer_freq", "moe_ffn_hidden_size", "moe_first_dense_layers",
              "moe_shared_expert_ffn_hidden_size", "head_dim", "qkv_bias", "qk_norm", "rope_scaling",
              "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def shape_keys(model: Any) -> Dict[str, Any]:
    """{key: plain value} of SHAPE_KEYS (model.rope_scaling as a plain dict)."""
    from omegaconf import OmegaConf

    return {k: OmegaConf.to_container(model[k]) if OmegaConf.is_config(model[k]) else model[k] for k in SHAPE_KEYS}


def _shape_key_defaults() -> Dict[str, Any]:
    """What a checkpoint written before a shape key existed had: the key's default."""
    from omegaconf import OmegaConf

    from mpoverlap.config import ModelConfig

    return shape_keys(OmegaConf.structured(ModelConfig))


def _fix(key: str, saved: Any) -> str:
    """The override(s) that give back the saved value (a dict: one per field)."""
    if isinstance(saved, dict):
        return " ".join(f"model.{key}.{k}={_show(v)}" for k, v in saved.items())
    return f"model.{key}={_show(saved)}"


class Resumable:
    """Checkpoint methods of Trainer; they use its cfg, state, ddp, optimizer, chunks,
    dp_names, params_by_name, ties, schedule, checkpointer, step and log."""

    def _meta(self) -> Dict[str, Any]:
        m = self.cfg.model
        return {"step": self.step, "model": shape_keys(m),
                # The data position: the sample order is a function of the seed alone.
                "consumed_samples": self.step * int(self.cfg.train.global_batch_size),
                "lr_schedule": {"lr": self.schedule.lr, "min_lr": self.schedule.min_lr,
                                "warmup_steps": self.schedule.warmup_steps,
                                "decay_steps": self.schedule.decay_steps},
                "seed": int(self.cfg.train.seed), "global_batch_size": int(self.cfg.train.global_batch_size)}

    def _meta_template(self, path) -> Dict[str, Any]:
        """_meta() without the shape keys the checkpoint does not hold (written before they
        existed), so loading it reads what is there and the comparison sees their defaults."""
        from torch.distributed.checkpoint import FileSystemReader

        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        meta = self._meta()
        meta["model"] = {k: v for k, v in meta["model"].items()
                         if any(s == f"meta.model.{k}" or s.startswith(f"meta.model.{k}.") for s in saved)}
        return meta

    def _state_chunks(self) -> TrainStateChunks:
        from mpoverlap.checkpoint import TrainStateChunks

        return TrainStateChunks(self.ddp, self.optimizer, self.dp_names, self.state.coords.tp, self.state.grid.tp)

    def _small_state(self) -> Dict[str, Any]:
        # Every rank starts from the same seed, so rank 0's generator state stands for all;
        # the aux-loss-free expert biases (model.moe_router_bias_update_rate > 0) are the same
        # on every rank, keyed by the router's layout-free name. DCP writes each once.
        return {"meta": self._meta(), "rng": {"torch_cpu": torch.get_rng_state()},
                "expert_bias": expert_biases(self.chunks)}

    def save_state(self) -> Dict[str, Any]:
        """This rank's checkpoint state: views of its own parameter and moment shards placed in
        the full tensors, plus the small replicated entries. No collective, no copy."""
        return {**self._state_chunks().for_save(), **self._small_state()}

    def save(self) -> None:
        self.optimizer.finish_param_sync()
        from mpoverlap.checkpoint import ShardedSavePlanner

        t0 = time.perf_counter()
        path = self.checkpointer.save(self.step, self.save_state(), planner=ShardedSavePlanner())
        if not self.checkpointer.async_save:  # an async save logs when staged and when written
            self.log(f"saved checkpoint {path} ({time.perf_counter() - t0:.2f}s)")

    @torch.no_grad()
    def _load(self, path, step: int) -> None:
        from mpoverlap.checkpoint import ShardedLoadPlanner

        from torch.distributed.checkpoint import FileSystemReader

        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        chunks = self._state_chunks()
        small = self._small_state()
        # A checkpoint may lack the MTP depths' router biases (checkpoints kept the main layers'
        # only): those keep their initial zeros, as every resume from such a checkpoint had them.
        absent = [k for k in small["expert_bias"] if k.startswith("mtp.") and f"expert_bias.{k}" not in saved]
        if absent:
            self.log(f"checkpoint {path} holds no {', '.join(absent)}: they start from zero")
            small["expert_bias"] = {k: b for k, b in small["expert_bias"].items() if k not in absent}
        state = {**chunks.for_load(step, saved), **small, "meta": self._meta_template(path)}
        self.checkpointer.load(path, state, planner=ShardedLoadPlanner())
        chunks.after_load()  # error-feedback residuals saved at another layout: their sums
        # The parameters and moments were filled in place; ZeRO-3 gathers from the new shards.
        self.ddp.reshard()
        torch.set_rng_state(state["rng"]["torch_cpu"])
        self.step = int(state["meta"]["step"])

    @torch.no_grad()
    def _init_from_hf(self, directory: str) -> None:
        """checkpoint.init_from: a Hugging Face directory's full tensors, resharded like a resume."""
        from mpoverlap.interop.hf_import import read_state
        from mpoverlap.moe.experts import per_expert_tensors

        t0 = time.perf_counter()
        # This rank's shards only: its stage's and experts' parameters, its TP slice of each.
        # Stacked expert weights as their experts' tensors, under the per-expert names; the
        # routers' aux-loss-free biases (buffers, DeepSeek-V3's e_score_correction_bias) too.
        biases = expert_biases(self.chunks)
        shards, self.init_bytes_read = read_state(directory, self.cfg.model,
                                                  {**per_expert_tensors(self.params_by_name), **biases},
                                                  self.state.coords.tp, self.state.grid.tp)
        with self.ddp.full_params(write_back=True):
            params = {**per_expert_tensors(self.params_by_name), **biases}  # views of the storage held now
            for name, value in shards.items():
                if value.shape != params[name].shape:
                    raise CheckpointError(f"checkpoint.init_from={directory}: {name} has shape "
                                          f"{tuple(value.shape)} here, {tuple(params[name].shape)} expected")
                params[name].copy_(value)
            self.ties.fill_copies()  # a copy beside its original on this rank (the MTP chunk's)
        self.log(f"initialised from {directory} ({time.perf_counter() - t0:.2f}s)")

    def maybe_resume(self) -> None:
        init_from = self.cfg.checkpoint.init_from
        path = self.checkpointer.latest() if self.cfg.checkpoint.resume == "auto" else None
        if path is None:
            if init_from:
                self._init_from_hf(init_from)
            return
        if init_from:
            self.log(f"checkpoint.init_from={init_from} not used: resuming from {path} takes precedence")
        # The small entries first: the model check, and AdamW's step (behind the trainer's
        # after skipped non-finite steps), which sizes the moments to read.
        head = self.checkpointer.load(path, {"meta": self._meta_template(path), "optimizer": {"step": 0}})
        meta = head["meta"]
        meta["model"] = {**_shape_key_defaults(), **meta["model"]}  # keys newer than the checkpoint
        ours = self._meta()
        if dict(meta["model"]) != ours["model"]:
            diff = {k: (meta["model"][k], ours["model"][k]) for k in ours["model"] if meta["model"][k] != ours["model"][k]}
            raise CheckpointError(
                f"checkpoint {path} holds a different model ({', '.join(f'model.{k}: saved {_show(a)}, now {_show(b)}' for k, (a, b) in diff.items())}); "
                "resume with the saved model shape (fix: " + " ".join(_fix(k, a) for k, (a, _) in diff.items())
                + "), point checkpoint.dir elsewhere, or set checkpoint.resume=none")
        if dict(meta["lr_schedule"]) != ours["lr_schedule"] or meta["seed"] != ours["seed"] \
                or meta["global_batch_size"] != ours["global_batch_size"]:
            self.log(f"warning: resuming {path} with a different LR schedule, seed or global batch than it was "
                     f"saved with (saved {dict(meta['lr_schedule'])}, seed {meta['seed']}, global batch "
                     f"{meta['global_batch_size']}): the run will not continue the saved trajectory exactly; "
                     "set train.lr_decay_steps explicitly to keep a schedule across reruns")
        t0 = time.perf_counter()
        self._load(path, int(head["optimizer"]["step"]))
        self.log(f"resumed from {path} at step {self.step} ({time.perf_counter() - t0:.2f}s)")

