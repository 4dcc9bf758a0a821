"""The launch budget of one training step: on a GPU every operator is a kernel launch
of a few microseconds of host time, and every tensor handed to a foreach operator adds host work,
so neither may grow with the model's width; operators grow linearly with depth and microbatches.
Counted on CPU with `mpoverlap.training.launch_count` over `Trainer.train_step` (world 1)."""
import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402


def _overrides(hidden=64, layers=2, micro=2, precision="bf16"):
    """llama_tiny's shape (GQA, RMSNorm, SwiGLU) at `layers` x `hidden`, `micro` microbatches."""
    return ["model=llama_tiny", f"model.num_layers={layers}", f"model.hidden_size={hidden}",
            f"model.ffn_hidden_size={hidden * 11 // 4}", "model.seq_length=16", "train.micro_batch_size=2",
            f"train.global_batch_size={2 * micro}", f"train.precision={precision}", "train.grad_clip=1.0",
            "train.log_interval=100", "data.max_bytes=200000", "train.device=cpu", "train.progress=false"]


def _moe_overrides(experts, micro, grouped=True):
    """moe_tiny at 2 layers (both MoE, top-2), narrow, bf16, `experts` experts, `micro` microbatches."""
    return ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176",
            "model.moe_ffn_hidden_size=32", f"model.num_experts={experts}", f"model.moe_grouped_gemm={str(grouped).lower()}",
            "model.seq_length=16", "train.micro_batch_size=2", f"train.global_batch_size={2 * micro}",
            "train.precision=bf16", "train.grad_clip=1.0", "train.log_interval=100", "data.max_bytes=200000",
            "train.device=cpu", "train.progress=false"]


# name -> overrides; (layers, microbatches) on a grid for the per-layer-per-microbatch figure.
RUNS = {
    # The experts' operators do not grow with their number (the per-expert loop's do)
    **{f"moe-E{e}-m{m}": _moe_overrides(e, m) for e in (8, 64) for m in (1, 2)},
    **{f"moe-loop-E{e}-m{m}": _moe_overrides(e, m, grouped=False) for e in (8, 64) for m in (1, 2)},
    # overlap.ep_chunks=auto is one chunk at ep 1 (nothing to hide); 4 chunks repeat the layer's ops
    **{f"moe-E8-m{m}-chunks{c}": [*_moe_overrides(8, m), f"overlap.ep_chunks={c}"] for m in (1, 2) for c in (1, 4)},
    **{f"bf16-L{L}-m{m}": _overrides(layers=L, micro=m) for L, m in ((2, 1), (4, 1), (6, 1), (2, 2), (2, 3), (4, 2))},
    "bf16-wide": _overrides(hidden=256),
    "fp32-narrow": _overrides(precision="fp32"),
    "fp32-wide": _overrides(hidden=256, precision="fp32"),
}


def _count_steps(rank, world, runs, root):
    from pathlib import Path

    from mpoverlap.config import compose
    from mpoverlap.training.launch_count import count_launches
    from mpoverlap.training.loop import Trainer
    from mpoverlap.training.setup import init_distributed

    out = {}
    for name, overrides in runs.items():
        cfg = compose([*overrides, f"run.dir={root}/{name}"])
        trainer = Trainer(cfg, init_distributed(cfg), Path(root) / name)
        trainer.train_step()  # the first step builds lazy state (AdamW moments): not a hot-path step
        loss, seen = trainer.model.loss, []  # the dtype of the logits the step hands its loss
        trainer.model.loss = lambda logits, targets: (seen.append(str(logits.dtype)), loss(logits, targets))[1]
        with count_launches() as launches:
            trainer.train_step()
        trainer.close()
        out[name] = (launches.ops, launches.foreach_tensors, launches.summary(), sorted(set(seen)))
    return out


@pytest.fixture(scope="module")
def counts():
    with tempfile.TemporaryDirectory() as root:
        return run_distributed(_count_steps, 1, RUNS, root, timeout_s=300)[0]


# The norm reads each gradient region as a [rows, 2^14] view plus a tail: a region whose size
# crosses a multiple of 2^14 gains or loses one view (3 operators), whatever the model's size.
VIEW_SLACK = 3


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_launches_do_not_grow_with_width(counts, precision):
    """hidden 64 -> 256 at the same depth and batch: the same operators, the same foreach tensors
    (a norm over 2^14-element views handed thousands of tensors to one foreach call)."""
    narrow = counts["bf16-L2-m2" if precision == "bf16" else "fp32-narrow"]
    wide = counts[f"{precision}-wide"]
    assert wide[1] == narrow[1], f"foreach tensors grow with width: {narrow[2]} -> {wide[2]}"
    assert abs(wide[0] - narrow[0]) <= VIEW_SLACK, f"operators grow with width: {narrow[2]} -> {wide[2]}"


def test_launches_grow_linearly_with_depth_and_microbatches(counts):
    """2, 4, 6 layers: the same increment per layer; 1, 2, 3 microbatches: the same increment per
    microbatch. Prints operators per layer per microbatch (the mixed difference of the grid)."""
    ops = {(L, m): counts[f"bf16-L{L}-m{m}"][0] for L, m in ((2, 1), (4, 1), (6, 1), (2, 2), (2, 3), (4, 2))}
    per_2_layers = (ops[4, 1] - ops[2, 1], ops[6, 1] - ops[4, 1])
    per_micro = (ops[2, 2] - ops[2, 1], ops[2, 3] - ops[2, 2])
    assert per_2_layers[0] == per_2_layers[1] > 0, f"not linear in depth: {ops}"
    assert per_micro[0] == per_micro[1] > 0, f"not linear in microbatches: {ops}"
    per_layer_micro = (ops[4, 2] - ops[2, 2] - ops[4, 1] + ops[2, 1]) / 2
    print(f"\noperators per layer per microbatch: {per_layer_micro:g}; per layer per step (optimizer, norm): "
          f"{per_2_layers[0] / 2 - per_layer_micro:g}; per microbatch outside the layers: "
          f"{per_micro[0] - 2 * per_layer_micro:g}; {counts['bf16-L2-m2'][2]}")
    assert per_layer_micro > 0
    # bf16: each layer's 4 weight matrices (qkv, out, gate/up, down) are cast to bf16 once a step
    # (precision.step_cast_cache), not once a microbatch: 4 operators per layer per step
    assert per_2_layers[0] / 2 - per_layer_micro == 4, ops


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_loss_gets_the_logits_as_the_head_made_them(counts, precision):
    """The step hands the loss the head's logits as its GEMM made them (bf16 under bf16 autocast)
    and the loss upcasts them: under train.compile in one kernel with the log-softmax (an
    upcast before the loss is a whole fp32 [tokens, vocabulary] copy a microbatch)."""
    want = "torch.bfloat16" if precision == "bf16" else "torch.float32"
    assert counts[f"{precision}-wide"][3] == [want]


def _cast_watch(weights, shapes):
    """(a dispatch mode, casts, widened): inside the mode, `casts` gets the name of every weight
    ({its memory: its name}) cast to another dtype, `widened` the shape of every bf16 tensor of one
    of `shapes` cast to fp32 (a weight-shaped gradient made an fp32 copy of)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    casts, widened = [], []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.name() == "aten::_to_copy":
                if args[0].data_ptr() in weights:
                    casts.append(weights[args[0].data_ptr()])
                elif args[0].dtype == torch.bfloat16 and (kwargs or {}).get("dtype") == torch.float32 \
                        and tuple(args[0].shape) in shapes:
                    widened.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    return Casts(), casts, widened


@pytest.mark.parametrize("hooked", [False, True])
def test_bf16_weights_cast_once_a_step_gradients_added_in_place(hooked):
    """step_cast_cache around 3 microbatches, every weight with a gradient buffer already there
    (the data-parallel case): every linear's weight is cast to bf16 once (not 3 times), its bf16
    gradient is added into that buffer with no fp32 copy of it (autograd's path casts each one:
    3 per weight), the post-accumulate hooks fire once per microbatch as before, and the
    gradients are bit for bit autograd's (llama_tiny: untied, each weight used once a backward).
    `hooked`: a tensor hook on every weight (ZeRO-2's pre-accumulate hook must see the gradient):
    the cast gradient goes through autograd as before, the same values."""
    import torch

    from mpoverlap.config import compose
    from mpoverlap.models.gpt import GPT
    from mpoverlap.precision import autocast_context, step_cast_cache

    cfg = compose(["model=llama_tiny", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176",
                   "model.seq_length=16"]).model
    tokens = torch.randint(0, 100, (3, 2, 16), generator=torch.Generator().manual_seed(0))
    grads, casts, widened, hook_calls = {}, {}, {}, {}
    for cached in (False, True):
        model = GPT(cfg, seed=1)
        names = dict(model.named_parameters())
        buffers = {n: torch.zeros_like(p) for n, p in names.items()}
        for n, p in names.items():
            p.grad = buffers[n]
            p.register_post_accumulate_grad_hook(lambda p, log=hook_calls.setdefault(cached, []): log.append(p))
            if hooked:
                p.register_hook(lambda g: g)
        matrix_shapes = {tuple(p.shape) for p in names.values() if p.dim() == 2}
        watch, seen, up = _cast_watch({p.data_ptr(): n for n, p in names.items()}, matrix_shapes)
        outer = step_cast_cache("bf16", torch.device("cpu"), params_sharded=False) if cached else autocast_context("fp32", None)
        with watch, outer:
            for mb in tokens:
                with autocast_context("bf16", torch.device("cpu")):
                    logits = model(mb)
                model.loss(logits.float(), mb).backward()
        assert all(p.grad is buffers[n] for n, p in names.items())
        grads[cached] = {n: p.grad for n, p in names.items()}
        casts[cached], widened[cached] = seen, up
    linears = {n for n, p in GPT(cfg, seed=1).named_parameters() if p.dim() == 2 and "embedding" not in n}
    assert sorted(casts[True]) == sorted(set(casts[True])) and set(casts[True]) >= linears, casts[True]
    assert len(casts[False]) == 3 * len(casts[True])
    assert len(widened[False]) >= 3 * len(linears)
    assert len(widened[True]) == (len(widened[False]) if hooked else 0), widened[True]
    assert len(hook_calls[True]) == len(hook_calls[False])
    for n, g in grads[False].items():
        assert torch.equal(g, grads[True][n]), n


@pytest.mark.parametrize("deferred", [False, True])
def test_bf16_expert_stacks_cast_once_a_step(deferred):
    """The grouped experts' stacked weights, as the linears': inside step_cast_cache each stack is
    cast to bf16 once for the step's 3 microbatches (before: in forward and again in backward,
    for each chunk the MoE layer splits its tokens into: 2 x 2 chunks x 3 casts of every stack
    here; the Trainer's default at ep 1 is one chunk, at ep > 1 overlap.ep_chunks), their bf16 gradients are added into the fp32
    buffers by one promoting add (no fp32 copy of a stack's gradient either way), and the
    gradients are bit for bit the uncached path's (moe_tiny with a shared expert, 2 MoE layers,
    untied: a tied embedding's two gradients are added in another order, see step_cast_cache).
    `deferred`: a zero-bubble deferral attached and every backward's weight gradients queued and
    run after it (W): then the linears too are custom Functions casting their own weights
    (wgrad/functions.py), each once a step as well (precision.step_cast)."""
    import torch

    from mpoverlap.config import compose
    from mpoverlap.models.gpt import GPT
    from mpoverlap.precision import autocast_context, step_cast_cache
    from mpoverlap.wgrad import WeightGradDeferral, WeightGradQueue, attach_deferral

    cfg = compose(["model=moe_tiny", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176",
                   "model.moe_ffn_hidden_size=32", "model.num_experts=8", "model.shared_expert=true",
                   "model.tie_embeddings=false", "model.seq_length=16"]).model
    tokens = torch.randint(0, 100, (3, 2, 16), generator=torch.Generator().manual_seed(0))
    grads, casts, widened = {}, {}, {}
    for cached in (False, True):
        model = GPT(cfg, seed=1)
        deferral = WeightGradDeferral()
        if deferred:
            assert attach_deferral(model, deferral) > 0
        names = dict(model.named_parameters())
        for p in names.values():
            p.grad = torch.zeros_like(p)
        # the GEMMs' weights: the expert stacks and the linears (not the fp32 router's, nor the embedding)
        weights = {p.data_ptr(): n for n, p in names.items()
                   if p.dim() >= 2 and "router" not in n and "embedding" not in n}
        stacks = {n for n, p in names.items() if p.dim() == 3}
        watch, seen, up = _cast_watch(weights, {tuple(p.shape) for p in names.values() if p.dim() == 3})
        outer = step_cast_cache("bf16", torch.device("cpu"), params_sharded=False) if cached else autocast_context("fp32", None)
        with watch, outer:
            for mb in tokens:
                with autocast_context("bf16", torch.device("cpu")):
                    logits = model(mb)
                queue = WeightGradQueue()
                with deferral.deferring(queue) if deferred else autocast_context("fp32", None):
                    model.loss(logits.float(), mb).backward()
                assert (len(queue) > 0) == deferred
                if deferred:
                    queue.run()
        grads[cached] = {n: p.grad for n, p in names.items()}
        casts[cached], widened[cached] = seen, up
    assert len(stacks) == 4, stacks  # w_in and w_out of 2 MoE layers
    assert sorted(casts[True]) == sorted(weights.values()), casts[True]  # each weight once a step
    chunks = model.layers["0"].mlp.num_chunks  # the single-process layer's default: 2 chunks
    assert sorted(n for n in casts[False] if n in stacks) == sorted(3 * 2 * chunks * list(stacks)), casts[False]
    assert widened == {False: [], True: []}, widened
    for n, g in grads[False].items():
        assert torch.equal(g, grads[True][n]), n


def test_moe_launches_do_not_grow_with_the_experts(counts):
    """8 -> 64 experts (top-2, 2 MoE layers): the operators of one microbatch (both
    layers' forward and backward: ops(m=2) - ops(m=1)) are the same, and so are the step's
    (the stacked expert weights are the same parameters; the norm's views may differ by
    VIEW_SLACK per region, 2 stacked regions here). The per-expert loop (moe_grouped_gemm=false)
    shows what the budget catches: its microbatch grows."""
    per_micro = {k: counts[f"{k}-m2"][0] - counts[f"{k}-m1"][0]
                 for k in ("moe-E8", "moe-E64", "moe-loop-E8", "moe-loop-E64")}
    print(f"\nMoE operators per microbatch (2 layers): {per_micro}")
    assert per_micro["moe-E64"] == per_micro["moe-E8"], (per_micro, counts["moe-E8-m2"][2], counts["moe-E64-m2"][2])
    assert abs(counts["moe-E64-m2"][0] - counts["moe-E8-m2"][0]) <= 2 * VIEW_SLACK, \
        (counts["moe-E8-m2"][2], counts["moe-E64-m2"][2])
    assert counts["moe-E64-m2"][1] == counts["moe-E8-m2"][1]  # foreach tensors: the same parameters
    assert per_micro["moe-loop-E64"] > per_micro["moe-loop-E8"] + 2 * (64 - 8), per_micro


def test_moe_default_chunks_at_ep1_do_not_repeat_the_layer(counts):
    """At ep 1 the token exchanges are the identity, so overlap.ep_chunks=auto runs each MoE
    layer as one chunk: the default's operators are exactly those of ep_chunks=1, and 4 chunks
    (the default before, and still at ep > 1) would dispatch more per microbatch: every chunk's
    permutation, grouped GEMMs and combine again (on a GPU, launches with nothing to overlap)."""
    per_micro = {k: counts[f"moe-E8-m2{k}"][0] - counts[f"moe-E8-m1{k}"][0] for k in ("", "-chunks1", "-chunks4")}
    print(f"\nMoE operators per microbatch (2 layers) at ep 1, default / 1 chunk / 4 chunks: {per_micro}")
    assert counts["moe-E8-m2"][0] == counts["moe-E8-m2-chunks1"][0], per_micro
    assert per_micro["-chunks4"] > 1.5 * per_micro[""], per_micro


@pytest.mark.parametrize("hooked", [False, True])
def test_bf16_expert_weight_gradients_added_in_place(hooked):
    """The grouped experts (moe/grouped.py) under bf16 autocast, their stacked weights with a
    gradient buffer already there (the data-parallel case): each bf16 weight gradient is added into
    that buffer with no fp32 copy of the stack (autograd's path casts the whole [experts, out, in]
    product first), the post-accumulate hooks fire once per backward as before, and the gradients
    are bit for bit the cast-then-add path's (`hooked`: a tensor hook on each weight, ZeRO-2's
    case, keeps autograd's path: the reference)."""
    import torch

    from mpoverlap.moe.grouped import grouped_mlp

    g = torch.Generator().manual_seed(0)
    experts, hidden, ffn = 4, 32, 48
    counts = torch.tensor([5, 0, 7, 4])
    x = torch.randn(int(counts.sum()), hidden, generator=g)
    grads = {}
    for hook in (True, hooked):
        w_in = torch.nn.Parameter(torch.randn(experts, 2 * ffn, hidden, generator=g.manual_seed(1)) / 8)
        w_out = torch.nn.Parameter(torch.randn(experts, hidden, ffn, generator=g.manual_seed(2)) / 8)
        calls = []
        for p in (w_in, w_out):
            p.grad = torch.full_like(p, 0.5)
            p.register_post_accumulate_grad_hook(calls.append)
            if hook:
                p.register_hook(lambda grad: grad)
        watch, _, widened = _cast_watch({}, {tuple(w_in.shape), tuple(w_out.shape)})
        with watch:
            for _ in range(2):  # two microbatches: the second adds onto the first
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = grouped_mlp(x, w_in, w_out, counts, activation="swiglu", padded=False)
                y.float().pow(2).sum().backward()
        assert len(calls) == 4
        assert len(widened) == (4 if hook else 0), widened
        grads[hook] = (w_in.grad.clone(), w_out.grad.clone())
    for got, want in zip(grads[hooked], grads[True]):
        assert torch.equal(got, want)
