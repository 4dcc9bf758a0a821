"""train.compile rules.

What is compiled is each block's elementwise math only (models/fused.py: norms and their casts,
the residual add, RoPE, the MLP's activation), as pure functions of tensors. The GEMMs with
their communication, async handles, the ledger and the zero-bubble W deferral, core attention
(SDPA, ring or all-to-all attention), the experts and their all-to-alls, the pipeline's p2p,
recomputation and the DP/ZeRO hooks all stay eager around those calls, and a norm weight's
gradient leaves the compiled backward into its AccumulateGrad hook as an eager one does. So no
parallel layout or overlap mode conflicts with it (tests/test_compile.py checks dp 2 and tp 2
+ SP against the single-process reference); what can stop it is the environment, refused here.
"""
from __future__ import annotations

import os
import shutil

from mpoverlap.overlap.cuda_env import device_choice
from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, rule


def cxx_compiler() -> str:
    """The C++ compiler inductor would run on CPU, or '': the one its own search names
    (torch._inductor.config.cpp.cxx: $CXX, else g++), found on PATH."""
    from torch._inductor import config as inductor_config

    names = inductor_config.cpp.cxx
    if not isinstance(names, (list, tuple)):
        names = (names,)
    return _first(*(name for name in names if name))


def c_compiler() -> str:
    """The C compiler Triton builds its kernel launcher with on CUDA ($CC, else cc, gcc, clang), or ''."""
    return _first(os.environ.get("CC", ""), "cc", "gcc", "clang")


def _first(*names: str) -> str:
    for name in names:
        if name and shutil.which(name):
            return name
    return ""


@rule("compile.environment", "general", ("train.compile", "train.compile_backend", "train.device"),
      "train.compile=true needs torch.compile (dynamo) in this Python, and inductor a C++ compiler on CPU, "
      "a C compiler on CUDA (Triton's launcher)")
def _environment(lo: Layout):
    t = lo.cfg.train
    if not bool(t.compile):
        return
    import torch._dynamo

    keys = {"train.compile": True, "train.compile_backend": t.compile_backend}
    if not torch._dynamo.is_dynamo_supported():
        import sys

        yield Problem("compile.environment", keys,
                      f"torch.compile does not support this Python ({sys.version.split()[0]}) with torch "
                      f"{torch.__version__}: the blocks would run uncompiled",
                      ["train.compile=false"])
    elif t.compile_backend == "inductor":
        # The launcher's own choice (train.device=auto runs on CPU also when there are more ranks on
        # this machine than GPUs), so the compiler asked for is the one the run will need.
        cpu = device_choice(str(t.device), lo.world)[0] == "cpu"
        if not (cxx_compiler() if cpu else c_compiler()):
            what = ("builds its CPU kernels with a C++ compiler and none was found ($CXX, else g++)" if cpu
                    else "runs Triton on CUDA, which builds its kernel launcher with a C compiler, and none was "
                         "found ($CC, cc, gcc, clang)")
            yield Problem("compile.environment", {**keys, "train.device": t.device},
                          f"inductor {what}; install one, or run uncompiled (or traced without fusing: "
                          "train.compile_backend=aot_eager)",
                          ["train.compile=false"])
