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
from typing import Any, Dict, List, Optional

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


class SliceReader:
    """Reads tensors, or one rank's slice of them, from the directory's safetensors shards
    (`safe_open(...).get_slice`: only the slice's bytes are copied out of the file).
    `bytes_read` counts the bytes of every tensor handed out."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open

        self._open = safe_open
        self.dir = d = Path(directory)
        if (d / INDEX).is_file():
            self.weight_map = json.loads((d / INDEX).read_text())["weight_map"]
        elif (d / SINGLE).is_file():
            with safe_open(str(d / SINGLE), framework="pt") as f:
                self.weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise ConversionError(f"{d} holds neither {SINGLE} nor {INDEX}; only safetensors weights are read "
                                  "(convert .bin weights with transformers' save_pretrained(safe_serialization=True))")
        self._handles: Dict[str, Any] = {}
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def _slice(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._handles:
            if not (self.dir / fname).is_file():
                raise ConversionError(f"{self.dir / fname} (listed in {INDEX}) does not exist")
            self._handles[fname] = self._open(str(self.dir / fname), framework="pt")
        return self._handles[fname].get_slice(name)

    def shape(self, part) -> List[int]:
        """The shape of `part` (a `hf_tensors.Part`: a tensor or one expert of a fused one)."""
        shape = list(self._slice(part.name).get_shape())
        return shape[1:] if part.index is not None else shape

    def read(self, part, dim: Optional[int] = None, rank: int = 0, size: int = 1) -> torch.Tensor:
        """`part` whole, or its `rank`-th of `size` equal slices along `dim` (0 or 1)."""
        sl = self._slice(part.name)
        lead = (slice(part.index, part.index + 1),) if part.index is not None else ()
        index = [slice(None)] * (len(self.shape(part)))
        if dim is not None:
            n = self.shape(part)[dim]
            if n % size:
                raise ConversionError(f"{part.name}: dimension {dim} of size {n} does not split over {size} ranks")
            index[dim] = slice(rank * (n // size), (rank + 1) * (n // size))
        t = sl[lead + tuple(index)]
        if part.index is not None:
            t = t[0]
        self.bytes_read += t.numel() * t.element_size()
        return t
