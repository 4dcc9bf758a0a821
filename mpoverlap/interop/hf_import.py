"""`checkpoint.init_from=<hf dir>`: a Hugging Face Llama/Qwen2/Qwen3/Mixtral/Qwen3-MoE/DeepSeek-V3 directory's
tensors under our layout-free names, each rank's own shards.

The shapes come from the directory's config.json and must equal `model.*` (the validator
says so before any worker starts; this module checks again, since the directory may change
between the check and the load). Each rank reads only its own parameters (its pipeline stage, its experts), and of each
tensor-parallel one only its slice (safetensors' get_slice), lazily from the shards.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from mpoverlap.interop.hf_dir import SliceReader, read_hf_config
from mpoverlap.interop.hf_mapping import ConversionError, describe_mismatches, fix_overrides, mismatches
from mpoverlap.interop.hf_tensors import from_hf


def _model_dict(model: Any) -> Dict[str, Any]:
    return {k: model[k] for k in model}


def read_state(directory: str, model: Any, params: Optional[Dict[str, Any]] = None, tp_rank: int = 0,
               tp_size: int = 1) -> Tuple[Dict[str, torch.Tensor], int]:
    """({our parameter name: tensor}, bytes read). With `params` ({name: this rank's
    parameter}): those names only, each this rank's tensor-parallel shard, read as slices
    (see hf_tensors.from_hf); without: every tensor, full.
    Raises CheckpointError (a user error: one paragraph, no traceback) naming the keys."""
    from mpoverlap.training.checkpoint import CheckpointError

    try:
        hf = read_hf_config(directory)
        found = mismatches(hf, model)
        if found:
            raise ConversionError(describe_mismatches(directory, found, model) + "; set "
                                  + " ".join(fix_overrides(found)) + " or point checkpoint.init_from elsewhere")
        reader = SliceReader(directory)
        state = from_hf(reader, _model_dict(model), params, tp_rank, tp_size, hf)
    except ConversionError as err:
        raise CheckpointError(str(err)) from None
    except ImportError as err:
        raise CheckpointError(f"checkpoint.init_from needs the safetensors package ({err}); install the "
                              "extra: pip install 'mpoverlap[hf]'") from None
    return state, reader.bytes_read
