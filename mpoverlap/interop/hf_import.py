"""`checkpoint.init_from=<hf dir>`: the full tensors of a Hugging Face Llama/Mixtral directory
under our layout-free names, for the trainer to reshard exactly as it does on resume.

The shapes come from the directory's config.json and must equal `model.*` (the validator
says so before any worker starts; this module checks again, since the directory may change
between the check and the load). Each rank reads only the tensors of its own parameters
(its pipeline stage, its experts), lazily from the safetensors shards.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from mpoverlap.interop.hf_dir import read_hf_config, tensor_getter
from mpoverlap.interop.hf_mapping import (ConversionError, describe_mismatches, fix_overrides, from_hf,
                                          mismatches)


def _model_dict(model: Any) -> Dict[str, Any]:
    return {k: model[k] for k in model}


def read_full_state(directory: str, model: Any, wanted: Optional[set] = None) -> Dict[str, torch.Tensor]:
    """{our parameter name: full tensor} for the names in `wanted` (default: every one).
    Raises CheckpointError (a user error: one paragraph, no traceback) naming the keys."""
    from mpoverlap.training.checkpoint import CheckpointError

    try:
        hf = read_hf_config(directory)
        found = mismatches(hf, model)
        if found:
            raise ConversionError(describe_mismatches(directory, found, model) + "; set "
                                  + " ".join(fix_overrides(found)) + " or point checkpoint.init_from elsewhere")
        state = from_hf(tensor_getter(directory), _model_dict(model), wanted)
    except ConversionError as err:
        raise CheckpointError(str(err)) from None
    except ImportError as err:
        raise CheckpointError(f"checkpoint.init_from needs the safetensors package ({err}); install the "
                              "extra: pip install 'mpoverlap[hf]'") from None
    return state
