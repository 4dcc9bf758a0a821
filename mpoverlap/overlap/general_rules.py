"""Rules every run obeys: degrees, world size, batch arithmetic, model shape, keys' values."""
from __future__ import annotations

from mpoverlap.overlap.layout import DEGREES, Layout, as_positive_int
from mpoverlap.overlap.rules import Problem, divisors, next_multiple, rule

TRISTATE_KEYS = ("dp", "tp", "pp", "cp", "ep", "dp_param_gather", "ep_pairing")


@rule("parallel.degree_positive", "general", tuple(f"parallel.{d}" for d in DEGREES),
      "every parallel degree is a positive integer")
def _degrees(lo: Layout):
    for name in DEGREES:
        if getattr(lo, name) is None:
            value = getattr(lo.cfg.parallel, name)
            yield Problem("parallel.degree_positive", {f"parallel.{name}": value},
                          "a parallel degree must be a positive integer", [f"parallel.{name}=1"])


@rule("parallel.dp_value", "general", ("parallel.dp",), "parallel.dp is auto or a positive integer")
def _dp_value(lo: Layout):
    req = lo.dp_requested
    if isinstance(req, str) and req.lower() == "auto":
        return
    if as_positive_int(req) is None:
        yield Problem("parallel.dp_value", {"parallel.dp": req},
                      "parallel.dp must be `auto` (world / (tp x pp x cp)) or a positive integer",
                      ["parallel.dp=auto"])


@rule("parallel.world_size", "general", ("parallel.tp", "parallel.pp", "parallel.cp", "parallel.dp"),
      "the launched world size equals tp x pp x cp x dp")
def _world(lo: Layout):
    if lo.world_env is None or None in (lo.tp, lo.pp, lo.cp):
        return
    mp = lo.tp * lo.pp * lo.cp
    keys = {"WORLD_SIZE": lo.world_env, "parallel.tp": lo.tp, "parallel.pp": lo.pp,
            "parallel.cp": lo.cp, "parallel.dp": lo.dp_requested}
    if lo.world_env % mp:
        yield Problem("parallel.world_size", keys,
                      f"the world of {lo.world_env} ranks is not divisible by tp x pp x cp = {mp}",
                      ["parallel.tp=1", "parallel.pp=1", "parallel.cp=1", "parallel.dp=auto"])
    elif lo.dp is not None and lo.world != lo.world_env:
        yield Problem("parallel.world_size", keys,
                      f"tp x pp x cp x dp = {lo.world} but {lo.world_env} ranks were launched",
                      ["parallel.dp=auto"])


@rule("train.batch_divisible", "general",
      ("train.global_batch_size", "train.micro_batch_size", "parallel.dp"),
      "the global batch splits into whole microbatches on every data-parallel rank")
def _batch(lo: Layout):
    t = lo.cfg.train
    if lo.dp is None or t.micro_batch_size < 1 or t.global_batch_size < 1:
        return
    per = t.micro_batch_size * lo.dp
    if t.global_batch_size % per:
        yield Problem("train.batch_divisible",
                      {"train.global_batch_size": t.global_batch_size,
                       "train.micro_batch_size": t.micro_batch_size, "parallel.dp": lo.dp},
                      f"the global batch must be a multiple of micro_batch_size x dp = {per}",
                      [f"train.global_batch_size={next_multiple(t.global_batch_size, per)}"])


_POSITIVE = {
    "train.steps": 100, "train.micro_batch_size": 4, "train.global_batch_size": 16,
    "train.log_interval": 1, "train.eval_iters": 4, "model.num_layers": 4, "model.hidden_size": 128,
    "model.num_attention_heads": 4, "model.ffn_hidden_size": 512, "model.seq_length": 128,
    "model.vocab_size": 256, "model.make_vocab_size_divisible_by": 128, "checkpoint.keep": 2,
}
_NON_NEGATIVE = {"train.lr_warmup_steps": 0, "train.eval_interval": 0, "checkpoint.interval": 0,
                 "train.weight_decay": 0.0, "train.grad_clip": 1.0, "overlap.dp_prefetch": 1}


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


@rule("value.range", "general", tuple(_POSITIVE) + tuple(_NON_NEGATIVE) + ("train.lr",),
      "counts and sizes are positive, intervals and coefficients non-negative")
def _ranges(lo: Layout):
    for key, default in _POSITIVE.items():
        if _get(lo.cfg, key) < 1:
            yield Problem("value.range", {key: _get(lo.cfg, key)}, "must be at least 1", [f"{key}={default}"])
    for key, default in _NON_NEGATIVE.items():
        if _get(lo.cfg, key) < 0:
            yield Problem("value.range", {key: _get(lo.cfg, key)}, "must not be negative", [f"{key}={default}"])
    if not lo.cfg.train.lr > 0:
        yield Problem("value.range", {"train.lr": lo.cfg.train.lr}, "the learning rate must be positive",
                      ["train.lr=3e-3"])
    decay = lo.cfg.train.lr_decay_steps
    if decay is not None and decay < 1:
        yield Problem("value.range", {"train.lr_decay_steps": decay},
                      "must be at least 1 (or null: train.steps)", ["train.lr_decay_steps=null"])
    vf = lo.cfg.data.val_fraction
    if not 0 < vf < 1:
        yield Problem("value.range", {"data.val_fraction": vf}, "must lie strictly between 0 and 1",
                      ["data.val_fraction=0.02"])


_CHOICES = {
    "model.norm": ("rmsnorm", "layernorm"),
    "model.activation": ("swiglu", "gelu"),
    "model.transformer_impl": ("local", "te"),
    "train.device": ("auto", "cpu", "cuda"),
    "data.name": ("stdlib", "indexed", "megatron"),
    "checkpoint.resume": ("auto", "none"),
    "parallel.cp_comm": ("p2p", "a2a"),
    "parallel.pp_schedule": ("auto", "1f1b", "interleaved", "zb1p", "zbv"),  # = pipeline.SCHEDULE_CHOICES
    "parallel.cp_attention_backend": ("auto", "fused", "explicit", "cudnn"),
    "train.on_nonfinite": ("stop", "skip"),
    "train.precision": ("fp32", "bf16", "fp8"),
    "train.fp8_recipe": ("tensorwise", "rowwise"),  # = precision.fp8.RECIPES
    "train.compile_backend": ("inductor", "aot_eager", "eager"),  # = models/fused.py BACKENDS
    "train.grad_reduce_dtype": ("fp32", "bf16", "fp8", "int8"),
    "train.param_gather_dtype": ("auto", "fp32", "bf16", "int8", "fp8"),  # = data_parallel.levels.GATHER_DTYPES
    "train.ep_dispatch_dtype": ("auto", "bf16", "fp8"),  # = moe.dispatch_wire.DISPATCH_DTYPES
    "train.dp_sharding": ("none", "optim", "optim_grads", "optim_grads_params"),
    "overlap.comm_priority": ("auto", "high", "normal"),  # = overlap.priority.PRIORITY_CHOICES
}


@rule("value.choice", "general", tuple(_CHOICES) + tuple(f"overlap.{k}" for k in TRISTATE_KEYS),
      "keys with a fixed set of values hold one of them")
def _choices(lo: Layout):
    for key, allowed in _CHOICES.items():
        value = _get(lo.cfg, key)
        if value not in allowed:
            yield Problem("value.choice", {key: value}, f"must be one of {'|'.join(allowed)}",
                          [f"{key}={allowed[0]}"])
    for name in TRISTATE_KEYS:
        value = lo.mode(name)
        if value not in ("auto", "true", "false"):
            yield Problem("value.choice", {f"overlap.{name}": value}, "must be one of auto|true|false",
                          [f"overlap.{name}=auto"])


def even_head_count(hidden: int, heads: int) -> int | None:
    """The head count nearest `heads` that divides `hidden` into an even head dimension (RoPE
    rotates channel pairs), or None when `hidden` is odd and no head count can."""
    good = [d for d in divisors(hidden) if (hidden // d) % 2 == 0]
    return min(good, key=lambda d: (abs(d - heads), d)) if good else None


def _head_shape_fix(m) -> list:
    """Overrides that give an even head dimension: the nearest valid head count, or (odd
    hidden size) the hidden size rounded up to a multiple of 2 x heads."""
    heads = even_head_count(m.hidden_size, m.num_attention_heads)
    if heads is not None:
        return [f"model.num_attention_heads={heads}"]
    return [f"model.hidden_size={next_multiple(m.hidden_size, 2 * m.num_attention_heads)}"]


@rule("model.heads_divide_hidden", "general", ("model.hidden_size", "model.num_attention_heads"),
      "attention heads divide the hidden size")
def _heads(lo: Layout):
    m = lo.cfg.model
    if m.head_dim is not None or m.attention == "mla":
        return  # the head width is its own key (model.head_dim, MLA's): heads need not divide H
    if m.hidden_size >= 1 and m.num_attention_heads >= 1 and m.hidden_size % m.num_attention_heads:
        # The fix must also give an even head dimension, or it would trip model.head_dim_even.
        yield Problem("model.heads_divide_hidden",
                      {"model.hidden_size": m.hidden_size, "model.num_attention_heads": m.num_attention_heads},
                      "each head gets hidden_size / num_attention_heads channels", _head_shape_fix(m))


@rule("model.head_dim_even", "general", ("model.hidden_size", "model.num_attention_heads"),
      "the head dimension hidden_size / num_attention_heads is even (RoPE rotates channel pairs)")
def _head_dim_even(lo: Layout):
    m = lo.cfg.model
    if m.head_dim is not None or m.attention == "mla":
        return  # model.head_dim (or, MLA, model.attention) reports it
    if m.hidden_size < 1 or m.num_attention_heads < 1 or m.hidden_size % m.num_attention_heads:
        return  # model.heads_divide_hidden reports it
    head_dim = m.hidden_size // m.num_attention_heads
    if head_dim % 2:
        yield Problem("model.head_dim_even",
                      {"model.hidden_size": m.hidden_size, "model.num_attention_heads": m.num_attention_heads},
                      f"the head dimension {m.hidden_size} / {m.num_attention_heads} = {head_dim} is odd; "
                      "rotary embeddings rotate pairs of channels (x[i], x[i + D/2]) and need it even",
                      _head_shape_fix(m))


@rule("model.query_groups_divide_heads", "general", ("model.num_query_groups", "model.num_attention_heads"),
      "grouped-query attention: num_query_groups is null (= heads) or a positive divisor of the heads")
def _query_groups(lo: Layout):
    m = lo.cfg.model
    G, N = m.num_query_groups, m.num_attention_heads
    if G is None or N < 1:
        return
    if G < 1 or N % G:
        fit = max(d for d in divisors(N) if d <= max(G, 1))
        yield Problem("model.query_groups_divide_heads",
                      {"model.num_query_groups": G, "model.num_attention_heads": N},
                      "every K/V group serves num_attention_heads / num_query_groups query heads (1 = MQA, "
                      f"= heads is MHA); {G} does not divide {N} heads into equal groups",
                      [f"model.num_query_groups={fit}"])


@rule("data.indexed_path", "general", ("data.name", "data.path"), "indexed data names its files")
def _indexed(lo: Layout):
    d = lo.cfg.data
    if d.name in ("indexed", "megatron") and not d.path and not d.blend:
        yield Problem("data.indexed_path", {"data.name": d.name, "data.path": d.path},
                      f"data={d.name} reads <data.path>.bin/.idx (made by mpoverlap-preprocess, or by "
                      "Megatron-LM's preprocess_data.py for data=megatron); set data.path=<prefix> or "
                      "data.blend=[w1,prefix1,...], or train on the built-in corpus",
                      ["data.name=stdlib"])


@rule("train.device_available", "general", ("train.device",),
      "train.device=cuda needs a visible GPU for every rank on this machine")
def _device(lo: Layout):
    if lo.cfg.train.device != "cuda":
        return
    from mpoverlap.overlap.cuda_env import ranks_per_node, visible_gpus

    gpus = visible_gpus()
    if gpus == 0:
        yield Problem("train.device_available", {"train.device": "cuda"},
                      "no CUDA device is visible to this process", ["train.device=auto"])
        return
    ranks = ranks_per_node(lo.world)
    if ranks is not None and ranks > gpus:
        yield Problem("train.device_available", {"train.device": "cuda", "ranks on this machine": ranks,
                                                 "visible GPUs": gpus},
                      f"each rank needs a GPU of its own (local rank i uses cuda:i) and {ranks} ranks would "
                      f"start here with {gpus} GPU(s) visible (check CUDA_VISIBLE_DEVICES); run at most "
                      f"{gpus} ranks per node (fewer dp/tp/pp/cp, or torchrun across nodes with "
                      f"--nproc-per-node={gpus}), or run on CPU", ["train.device=cpu"])


@rule("train.profile_window", "general", ("train.profile", "train.profile_start_step", "train.profile_steps",
                                          "train.steps"),
      "a profiled window of steps lies inside the run (steps are numbered from 1)")
def _profile_window(lo: Layout):
    t = lo.cfg.train
    if not t.profile:
        return
    start, count, total = t.profile_start_step, t.profile_steps, t.steps
    keys = {"train.profile_start_step": start, "train.profile_steps": count, "train.steps": total}
    if start < 1 or count < 1:
        yield Problem("train.profile_window", keys, "the window starts at step 1 or later and holds at "
                      "least one step", ["train.profile_start_step=1", "train.profile_steps=1"])
    elif start + count - 1 > total >= 1:
        fix = ([f"train.profile_steps={total - start + 1}"] if start <= total
               else ["train.profile_start_step=1", f"train.profile_steps={min(count, total)}"])
        yield Problem("train.profile_window", keys,
                      f"steps {start}..{start + count - 1} are profiled but the run ends at step {total}: "
                      "the trace would never be written", fix)
