"""Suite-wide settings: the strict communication ledger (see mpoverlap/comm/ledger.py) is on for
every test and for every worker a test starts (spawned and launched processes inherit the
environment), so any collective issued and never waited fails the test that issued it.

The CUDA tier: every test that needs a GPU carries `@pytest.mark.cuda` and is skipped, with
the reason, where torch sees none (`pytest -m cuda` selects the tier; `make gpu-check` runs it
on a GPU machine, docs/gpu-check.md).

Order: `make test` runs two pytest-xdist workers, each taking whole files in collection order
(--dist loadfile); the longest files go first (SLOW_FIRST, by the wall time each took in a
serial `make test` on 2 cores) so that no long file starts last and runs alone."""
import os

import pytest

from mpoverlap.comm.ledger import STRICT_ENV

os.environ.setdefault(STRICT_ENV, "1")

NO_GPU_REASON = "needs a CUDA GPU: torch.cuda.is_available() is False here (run `make gpu-check` on a GPU machine)"


SLOW_FIRST = ["test_train_cli.py", "test_pairing.py", "test_finemoe_parity.py", "test_reliability.py",
              "test_estimate.py", "test_gqa_train.py", "test_multihost.py", "test_zero_bubble_parity.py",
              "test_zero.py", "test_interop.py", "test_simulate.py", "test_grad_wire_train.py", "test_properties.py", "test_recompute.py",
              "test_timeline.py", "test_invariants.py", "test_hf_families.py", "test_bench_smoke.py"]


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(SLOW_FIRST)))  # stable: file order kept
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in cuda_items:
        item.add_marker(skip)
