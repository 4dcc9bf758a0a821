"""Rules for the ecosystem keys: checkpoint.init_from (a Hugging Face directory) and data.blend.

Only files' existence and config.json are read here (no tensors, no optional package), so
mpoverlap-check stays fast and reports these before any worker starts.
"""
from __future__ import annotations

import os

from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, rule


@rule("checkpoint.init_from", "general", ("checkpoint.init_from", "model.*"),
      "checkpoint.init_from is a Llama/Qwen2/Qwen3/Mixtral/Qwen3-MoE/DeepSeek-V3 directory whose config.json "
      "matches model.*")
def _init_from(lo: Layout):
    directory = lo.cfg.checkpoint.init_from
    if not directory:
        return
    keys = {"checkpoint.init_from": directory}
    if not os.path.isfile(os.path.join(directory, "config.json")):
        what = "does not exist" if not os.path.isdir(directory) else "holds no config.json"
        yield Problem("checkpoint.init_from", keys,
                      f"the directory {what}: it must be a Hugging Face model directory (config.json + "
                      "safetensors), e.g. one written by mpoverlap-export", ["checkpoint.init_from=null"])
        return
    from mpoverlap.interop.hf_dir import read_hf_config
    from mpoverlap.interop.hf_mapping import ConversionError, describe_mismatches, fix_overrides, mismatches

    try:
        found = mismatches(read_hf_config(directory), lo.cfg.model)
    except (ConversionError, KeyError, TypeError, ValueError) as err:
        reason = str(err) if isinstance(err, ConversionError) else f"config.json lacks or mangles {err}"
        yield Problem("checkpoint.init_from", keys, reason, ["checkpoint.init_from=null"])
        return
    if found:
        keys.update({f"model.{k}": ours for k, _, ours in found})
        yield Problem("checkpoint.init_from", keys, describe_mismatches(directory, found, lo.cfg.model),
                      fix_overrides(found))


@rule("data.blend", "general", ("data.blend", "data.name"),
      "data.blend is [w1, prefix1, w2, prefix2, ...] with positive weights, for data=indexed|megatron")
def _blend(lo: Layout):
    d = lo.cfg.data
    blend = d.blend
    if not blend:
        return
    keys = {"data.blend": list(blend)}
    if d.name not in ("indexed", "megatron"):
        yield Problem("data.blend", dict(keys, **{"data.name": d.name}),
                      "a blend mixes token files; data=stdlib has none (set data=megatron or data=indexed "
                      "for the format of the files)", ["data.blend=null"])
        return
    items = list(blend)
    pairs = list(zip(items[0::2], items[1::2]))
    bad = len(items) % 2 != 0 or not pairs
    for w, prefix in pairs:
        try:
            bad = bad or not float(w) > 0 or isinstance(w, bool) or not isinstance(prefix, str) or not prefix
        except (TypeError, ValueError):
            bad = True
    if bad:
        example = "data.blend=[0.7,/data/web,0.3,/data/code]"
        yield Problem("data.blend", keys, "must alternate positive weights and file prefixes: "
                      f"[w1, prefix1, w2, prefix2, ...] (e.g. {example})", ["data.blend=null"])
