"""Read an mpoverlap checkpoint of any layout in ONE process, without a process group.

Checkpoints hold each tensor under its layout-free parameter name, written in chunks placed at
their offsets in the full tensor (mpoverlap/checkpoint/: every rank writes its own shards;
older checkpoints hold one chunk per tensor). Loading a full-size template makes DCP assemble
the chunks, so nothing is re-assembled here.

API choice: `FileSystemReader(dir).read_metadata()` lists every entry with its shape and
dtype, and `torch.distributed.checkpoint.load(template, no_dist=True)` fills a template built
from it. Both are public, documented APIs (kept stable across torch releases), whereas
`_load_state_dict_from_keys` and `_EmptyStateDictLoadPlanner` are private; `dcp_to_torch_save`
is public but would load the optimizer moments too (3x the model) and round-trip a file. Only
`model.*`, `expert_bias.*` (the routers' bias buffers, under their layout-free names) and
`meta.*` are read.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Dict, Tuple

import torch

from mpoverlap.interop.hf_mapping import ConversionError

# Keys the checkpoint's meta does not hold but an exact export needs, read from the run's
# config.yaml (they change the numerics: RoPE base, norm epsilon; or the HF config).
CONFIG_ONLY_KEYS = ("rope_base", "norm_eps", "seq_length", "init_std", "moe_capacity_factor",
                    "moe_aux_loss_coeff", "name",
                    # fine-grained MoE keys: the export refuses what Mixtral cannot reproduce
                    "moe_first_dense_layers", "moe_shared_expert_ffn_hidden_size", "moe_router_score",
                    "moe_router_order", "moe_router_norm_topk", "moe_router_bias_update_rate",
                    "moe_router_force_load_balancing", "moe_router_num_groups", "moe_router_scaling_factor",
                    "mtp_num_layers")


def resolve_step_dir(path: str | Path) -> Path:
    """A step directory, a checkpoint.dir (its newest complete step) or a run.dir."""
    from mpoverlap.training.checkpoint import Checkpointer

    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    for candidate in (p, p / "checkpoints"):
        latest = Checkpointer(candidate).latest()
        if latest is not None:
            return latest
    raise ConversionError(f"{p} is not a checkpoint: no step_<n>/ with a COMPLETE marker and .metadata in "
                          f"it or in {p / 'checkpoints'}; pass a step directory, a checkpoint.dir or a run.dir")


def read_checkpoint(step_dir: Path) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """(full model tensors by our names, meta dict) of one complete checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = FileSystemReader(str(step_dir)).read_metadata()
    except Exception as err:
        raise ConversionError(f"{step_dir}/.metadata could not be read ({type(err).__name__}: {err})") from None
    template: Dict[str, Any] = {"model": {}, "meta": {}, "expert_bias": {}}
    for key, item in md.state_dict_metadata.items():
        # the routers' aux-loss-free biases are buffers, saved beside the parameters
        group = key.split(".", 1)[0]
        if group in ("model", "expert_bias") and isinstance(item, TensorStorageMetadata):
            template[group][key[len(group) + 1:]] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        elif key.startswith("meta."):
            # meta is a nested dict of plain values; DCP flattened it with dots.
            node = template["meta"]
            *parents, leaf = key[len("meta."):].split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = None
    if not template["model"] or "model" not in template["meta"]:
        raise ConversionError(f"{step_dir} holds no model.* tensors or no meta.model keys: not a checkpoint "
                              "written by mpoverlap-train")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, checkpoint_id=str(step_dir), no_dist=True)
    return {**template["model"], **template["expert_bias"]}, template["meta"]


def find_run_config(step_dir: Path):
    """The config the checkpoint was written with: its own config.yaml (every checkpoint
    carries one), else, for checkpoints written before they did, the run's: checkpoint.dir
    defaults to <run.dir>/checkpoints, so two levels up; None when not found."""
    for parent in (step_dir, step_dir.parent.parent, step_dir.parent):
        if (parent / "config.yaml").is_file():
            return parent / "config.yaml"
    return None


def model_keys(step_dir: Path, meta: Dict[str, Any], config_path: str | Path | None = None) -> Dict[str, Any]:
    """The model.* keys for the export: shape keys from the checkpoint's meta (authoritative),
    the rest from the run's config.yaml, which must agree with the meta on every shape key."""
    from omegaconf import OmegaConf

    path = Path(config_path) if config_path else find_run_config(step_dir)
    if path is None or not path.is_file():
        raise ConversionError(f"no config.yaml in {step_dir} (a checkpoint written before checkpoints carried "
                              f"their config) nor in its run directory {step_dir.parent.parent}; the checkpoint's "
                              "meta lacks model."
                              f"{', model.'.join(CONFIG_ONLY_KEYS[:2])}, which change the numerics: pass "
                              "--config <run.dir>/config.yaml")
    cfg = OmegaConf.load(path)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    keys = dict(meta["model"])
    differ = {k: (keys[k], model.get(k)) for k in keys if model.get(k) != keys[k]}
    if differ:
        raise ConversionError(
            f"{path} describes a different model than checkpoint {step_dir} ("
            + "; ".join(f"model.{k}: checkpoint {a}, config {b}" for k, (a, b) in differ.items())
            + "): it belongs to another run; pass --config with the config.yaml of the run that saved it")
    for k in CONFIG_ONLY_KEYS:
        keys[k] = model.get(k)
    for k, v in model.items():  # shape keys newer than the checkpoint: the run's config has them
        keys.setdefault(k, v)
    return keys
