"""A Hugging Face model directory on disk: config.json + safetensors (sharded, with the index).

Layout written (the one `save_pretrained` writes, so every transformers version reads it):
  config.json
  model.safetensors                                   when everything fits one shard, else
  model-00001-of-0000N.safetensors ... + model.safetensors.index.json
      {"metadata": {"total_size": bytes}, "weight_map": {tensor name: file}}
Output is deterministic (tensors in sorted name order, json with sorted keys), so exporting
the same weights twice gives identical bytes.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from mpoverlap.interop.hf_mapping import ConversionError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """"5GB" / "500MB" / "10KiB" / "1024" -> bytes (HF's max_shard_size spelling)."""
    m = _SIZE.match(str(text))
    if not m or (m.group(2) or "B").upper() not in _UNITS:
        raise ConversionError(f"--max-shard-size={text!r} is not a size; use e.g. --max-shard-size=5GB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_hf_dir(out: str | Path, config: Dict[str, Any], tensors: Dict[str, torch.Tensor],
                 max_shard_bytes: int) -> List[Path]:
    """Write config.json and the safetensors shard(s); returns the files written."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + [out / INDEX]:
        if stale.exists():  # an older export here: its shards would mix with these
            stale.unlink()
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = _nbytes(tensors[name])
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    written = []
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    written.append(out / "config.json")
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata={"format": "pt"})
        return written + [out / SINGLE]
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
        written.append(out / fname)
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return written + [out / INDEX]


def read_hf_config(directory: str | Path) -> Dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path} does not exist: checkpoint.init_from must be a Hugging Face model "
                              "directory (config.json + safetensors)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path} is not valid JSON ({err})") from None


def tensor_getter(directory: str | Path) -> Callable[[str], Optional[torch.Tensor]]:
    """get(name) -> the tensor (read lazily from its shard) or None when the directory lacks it."""
    from safetensors import safe_open

    d = Path(directory)
    if (d / INDEX).is_file():
        weight_map = json.loads((d / INDEX).read_text())["weight_map"]
    elif (d / SINGLE).is_file():
        with safe_open(str(d / SINGLE), framework="pt") as f:
            weight_map = {k: SINGLE for k in f.keys()}
    else:
        raise ConversionError(f"{d} holds neither {SINGLE} nor {INDEX}; only safetensors weights are read "
                              "(convert .bin weights with transformers' save_pretrained(safe_serialization=True))")
    handles: Dict[str, Any] = {}

    def get(name: str) -> Optional[torch.Tensor]:
        fname = weight_map.get(name)
        if fname is None:
            return None
        if fname not in handles:
            if not (d / fname).is_file():
                raise ConversionError(f"{d / fname} (listed in {INDEX}) does not exist")
            handles[fname] = safe_open(str(d / fname), framework="pt")
        return handles[fname].get_tensor(name)

    return get

