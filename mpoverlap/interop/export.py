"""`mpoverlap-export <checkpoint> --out <dir>`: a Hugging Face model directory from a checkpoint
of any layout, in one process without a process group.

<checkpoint>: a step directory, a checkpoint.dir (its newest complete step) or a run.dir.
Exit codes: 0 written; 2 the model or the checkpoint cannot be exported exactly (nothing is
written), with the keys that make it so.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from mpoverlap.interop.checkpoint_reader import model_keys, read_checkpoint, resolve_step_dir
from mpoverlap.interop.hf_dir import parse_size, write_hf_dir
from mpoverlap.interop.hf_mapping import ConversionError, architecture, hf_config
from mpoverlap.interop.hf_tensors import to_hf

EXIT_INVALID = 2


def export(checkpoint: str, out: str, max_shard_size: str = "5GB", config: Optional[str] = None) -> dict:
    """Returns {"step", "architecture", "files"}; ConversionError when it cannot be exact."""
    step_dir = resolve_step_dir(checkpoint)
    shard_bytes = parse_size(max_shard_size)
    tensors, meta = read_checkpoint(step_dir)
    keys = model_keys(step_dir, meta, config)
    arch = architecture(keys)  # refuse before any file is written
    files = write_hf_dir(out, hf_config(keys), to_hf(tensors, keys), shard_bytes)
    return {"step": int(meta.get("step", -1)), "architecture": arch, "files": files, "checkpoint": step_dir}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mpoverlap-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="step directory, checkpoint.dir or run.dir")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="split model.safetensors into shards of at most this size (default 5GB)")
    parser.add_argument("--config", default=None,
                        help="a config.yaml that overrides the checkpoint's own (default: the one inside "
                             "the checkpoint; for checkpoints written before they carried one, the run's)")
    args = parser.parse_args(argv)
    try:
        done = export(args.checkpoint, args.out, args.max_shard_size, args.config)
    except ConversionError as err:
        print(f"mpoverlap-export: error: {err}", file=sys.stderr)
        return EXIT_INVALID
    print(f"mpoverlap-export: {done['checkpoint']} (step {done['step']}) -> {args.out} as "
          f"{done['architecture']} ({len(done['files'])} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
