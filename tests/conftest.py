"""Suite-wide settings: the strict communication ledger (see mpoverlap/comm/ledger.py) is on for
every test and for every worker a test starts (spawned and launched processes inherit the
environment), so any collective issued and never waited fails the test that issued it.

The CUDA tier: every test that needs a GPU carries `@pytest.mark.cuda` and is skipped, with
the reason, where torch sees none (`pytest -m cuda` selects the tier; `make gpu-check` runs it
on a GPU machine, docs/gpu-check.md)."""
import os

import pytest

from mpoverlap.comm.ledger import STRICT_ENV

os.environ.setdefault(STRICT_ENV, "1")

NO_GPU_REASON = "needs a CUDA GPU: torch.cuda.is_available() is False here (run `make gpu-check` on a GPU machine)"


def pytest_collection_modifyitems(config, items):
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in cuda_items:
        item.add_marker(skip)
