"""DeepSeek-V3 from Hugging Face with the experts split over ranks: a transformers-made random
DeepseekV3ForCausalLM (tests/test_interop_deepseek_v3.py's tiny one: 8 routed experts in 4
groups, a shared expert, nonzero e_score_correction_bias) imported with checkpoint.init_from at
dp 2 x ep 2, each rank reading its 4 experts. The checkpoint it saves, loaded by the single
process, gives transformers' logits (1e-4 relative), and its first training step's loss and
gradient norm are the single-process import's (1e-5 relative, the parity tests' bound)."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_interop_deepseek_v3 import OURS, RUN, TOL, _ours, _rel, _save_hf, _tokens, resumed_trainer  # noqa: E402

pytestmark = pytest.mark.slow

LAYOUTS = {"single": (1, ["parallel.dp=1"]), "dp2_ep2": (2, ["parallel.dp=2", "parallel.ep=2"])}


def _import_save_step(rank, world, overrides, root):
    """Import, save the imported weights (step 0), then train one step: (loss, grad norm)."""
    t = resumed_trainer(rank, overrides, Path(root))
    t.save()
    t.checkpointer.wait()
    res = t.train_step()
    return t._mean_over_replicas(res["loss_local"]), res["grad_norm"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from dist_harness import run_distributed

    root = tmp_path_factory.mktemp("deepseek_v3_ep")
    original = _save_hf(dict(q_lora_rank=32, rope_interleave=True), root / "hf")
    out = {}
    for name, (world, layout) in LAYOUTS.items():
        overrides = [*OURS, *layout, *RUN, f"checkpoint.init_from={root / 'hf'}"]
        out[name] = (run_distributed(_import_save_step, world, overrides, str(root / name), timeout_s=600),
                     root / name)
    return original, out


def test_import_at_dp2_ep2_gives_transformers_logits(imported):
    import torch

    original, runs = imported
    model, _ = _ours(runs["dp2_ep2"][1])
    tokens = _tokens()
    with torch.no_grad():
        theirs = original(tokens).logits
        rel = _rel(theirs, model(tokens)[..., :theirs.shape[-1]])
    print(f"dp2_ep2: imported logits rel diff {rel:.2e}")
    assert rel <= TOL


def test_import_at_dp2_ep2_trains_as_the_single_process_import(imported):
    _, runs = imported
    (want_loss, want_norm), = runs["single"][0]
    for loss, norm in runs["dp2_ep2"][0]:
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
        assert abs(norm - want_norm) <= 1e-5 * abs(want_norm), (norm, want_norm)
