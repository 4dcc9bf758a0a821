"""Tensor- and sequence-parallel rules, and the CUDA settings TP/CP overlap depends on."""
from __future__ import annotations

import math

from mpoverlap.models.init import padded_vocab_size
from mpoverlap.overlap.estimate.params import shared_expert_ffn
from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, divisors, next_multiple, rule


def _suggest_tp(lo: Layout, common: int) -> int:
    """The largest tp <= the requested one that divides the model and, when the world is
    known, still tiles it with pp x cp."""
    fits = [d for d in divisors(common) if d <= lo.tp]
    if lo.world_env is not None and None not in (lo.pp, lo.cp):
        fits = [d for d in fits if lo.world_env % (d * lo.pp * lo.cp) == 0] or [1]
    return max(fits)


@rule("tp.divides_model", "tp", ("parallel.tp", "model.num_attention_heads", "model.hidden_size",
                                 "model.ffn_hidden_size"),
      "tp divides the heads, the hidden size, the ffn hidden size and the shared expert's width")
def _divides(lo: Layout):
    m = lo.cfg.model
    if lo.tp is None or lo.tp == 1:
        return
    widths = [("model.num_attention_heads", m.num_attention_heads), ("model.hidden_size", m.hidden_size),
              ("model.ffn_hidden_size", m.ffn_hidden_size)]
    shared = shared_expert_ffn(m)
    if shared:  # the shared expert is split over tp like a dense MLP
        widths.append(("model.moe_shared_expert_ffn_hidden_size" if m.moe_shared_expert_ffn_hidden_size
                       else "model.moe_ffn_hidden_size" if m.moe_ffn_hidden_size else "model.ffn_hidden_size", shared))
    for key, value in widths:
        if value >= 1 and value % lo.tp:
            common = math.gcd(math.gcd(math.gcd(m.num_attention_heads, m.hidden_size), m.ffn_hidden_size), shared)
            yield Problem("tp.divides_model", {"parallel.tp": lo.tp, key: value},
                          f"each tensor-parallel rank holds {key.split('.')[1]} / tp; {value} does not divide by {lo.tp}",
                          [f"parallel.tp={_suggest_tp(lo, common)}"])


@rule("tp.divides_query_groups", "tp", ("parallel.tp", "model.num_query_groups", "model.num_attention_heads"),
      "tp divides the K/V groups of grouped-query attention (K/V heads are split, never replicated)")
def _divides_groups(lo: Layout):
    m = lo.cfg.model
    G, N = m.num_query_groups, m.num_attention_heads
    if lo.tp is None or lo.tp == 1 or G is None or G < 1 or N < 1 or N % G:
        return  # null = MHA (tp.divides_model covers the heads); a bad G: model.query_groups_divide_heads
    if G % lo.tp:
        common = math.gcd(math.gcd(math.gcd(N, m.hidden_size), max(m.ffn_hidden_size, 1)), G)
        yield Problem("tp.divides_query_groups", {"parallel.tp": lo.tp, "model.num_query_groups": G},
                      f"each tensor-parallel rank holds num_query_groups / tp K/V groups beside the query "
                      f"heads that read them; {G} groups do not divide by tp={lo.tp} (K/V heads are not "
                      f"replicated over TP ranks, as in Megatron-core; more groups, e.g. "
                      f"model.num_query_groups={lo.tp} when tp divides the heads, also fixes it)",
                      [f"parallel.tp={_suggest_tp(lo, common)}"])


@rule("tp.divides_vocab", "tp", ("parallel.tp", "model.vocab_size", "model.make_vocab_size_divisible_by"),
      "tp divides the padded vocabulary")
def _vocab(lo: Layout):
    m = lo.cfg.model
    if lo.tp is None or lo.tp == 1 or m.vocab_size < 1 or m.make_vocab_size_divisible_by < 1:
        return
    vpad = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    if vpad % lo.tp:
        yield Problem("tp.divides_vocab", {"parallel.tp": lo.tp, "model.vocab_size": m.vocab_size,
                                           "model.make_vocab_size_divisible_by": m.make_vocab_size_divisible_by},
                      f"the padded vocabulary ({vpad}) is split into tp row blocks; pad it to a multiple of "
                      f"tp (the padding depends only on make_vocab_size_divisible_by, never on the layout)",
                      [f"model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by * lo.tp}"])


@rule("sp.needs_tp", "tp", ("parallel.sequence_parallel", "parallel.tp"), "sequence parallelism needs tp >= 2")
def _sp_needs_tp(lo: Layout):
    if lo.cfg.parallel.sequence_parallel and lo.tp == 1:
        yield Problem("sp.needs_tp", {"parallel.sequence_parallel": True, "parallel.tp": 1},
                      "sequence parallelism splits activations over the tensor-parallel group; with tp=1 "
                      "there is nobody to split with", ["parallel.sequence_parallel=false"])


@rule("sp.sequence_divisible", "tp", ("parallel.sequence_parallel", "model.seq_length", "parallel.tp", "parallel.cp"),
      "with SP, each cp rank's sequence divides by tp")
def _sp_seq(lo: Layout):
    m, p = lo.cfg.model, lo.cfg.parallel
    if not p.sequence_parallel or None in (lo.tp, lo.cp) or lo.tp == 1 or m.seq_length < 1:
        return
    if m.seq_length % lo.cp or (m.seq_length // lo.cp) % lo.tp:
        step = math.lcm(2 * lo.cp, lo.cp * lo.tp)
        yield Problem("sp.sequence_divisible", {"model.seq_length": m.seq_length, "parallel.tp": lo.tp,
                                                "parallel.cp": lo.cp, "parallel.sequence_parallel": True},
                      "sequence parallelism gives each tp rank seq_length / (cp x tp) positions",
                      [f"model.seq_length={next_multiple(m.seq_length, step)}"])


@rule("tp.transformer_engine", "tp", ("model.transformer_impl",), "model.transformer_impl=te needs TE on CUDA")
def _te(lo: Layout):
    if lo.cfg.model.transformer_impl != "te":
        return
    import importlib.util

    import torch

    if importlib.util.find_spec("transformer_engine") is None:
        reason = ("Transformer Engine is not installed: it is an optional CUDA extra, "
                  "pip install 'mpoverlap[te]' on a machine with CUDA")
    elif not torch.cuda.is_available():
        reason = "Transformer Engine layers run on CUDA only and no GPU is visible"
    else:
        reason = ("Transformer Engine layers are not built by this version of mpoverlap yet (the CUDA "
                  "path is its own piece of work); running the local layers instead would silently "
                  "change what you asked for")
    yield Problem("tp.transformer_engine", {"model.transformer_impl": "te"}, reason,
                  ["model.transformer_impl=local"])


@rule("cuda.max_connections", "tp", ("overlap.tp", "overlap.cp", "train.device"),
      "on CUDA, a required TP/CP overlap needs CUDA_DEVICE_MAX_CONNECTIONS=1 (or unset: mpoverlap sets it)")
def _max_connections(lo: Layout):
    from mpoverlap.overlap.config import CommOverlapConfig
    from mpoverlap.overlap.cuda_env import ENV_MAX_CONNECTIONS, max_connections_conflict

    if not lo.degrees_ok:
        return
    value = max_connections_conflict(lo.cfg, lo.world)
    if value is None:
        return  # unset (mpoverlap sets 1 when TP/CP overlap is on), 1, or not a CUDA run
    ov = CommOverlapConfig.from_config(lo.cfg, lo.world_env)
    for mode, state in (("tp", ov.tp), ("cp", ov.cp)):
        if state.requested == "true" and state.enabled:
            yield Problem("cuda.max_connections", {ENV_MAX_CONNECTIONS: value, f"overlap.{mode}": "true"},
                          f"{ENV_MAX_CONNECTIONS}={value} is set in the environment, and with more than one "
                          "hardware queue the GPU may run a GEMM issued after a collective ahead of it, so the "
                          f"required overlap would be lost; unset it or export {ENV_MAX_CONNECTIONS}=1 before "
                          f"launching, or turn the overlap off (overlap.{mode}=auto turns it off with this "
                          "reason)", [f"overlap.{mode}=false"])
