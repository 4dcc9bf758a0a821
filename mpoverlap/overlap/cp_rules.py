"""Context-parallel rules: the load-balanced split and the all-to-all variant's head split."""
from __future__ import annotations

from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, next_multiple, rule


def a2a_head_groups(num_heads: int, tp: int, cp: int, query_groups=None) -> int:
    """Head groups the all-to-all variant pipelines (2 when the local heads, and the local K/V
    groups of grouped-query attention, split evenly)."""
    local = num_heads // (tp * cp)
    local_kv = (query_groups or num_heads) // (tp * cp)
    return 2 if local % 2 == 0 and local_kv % 2 == 0 else 1


@rule("cp.sequence_divisible", "cp", ("model.seq_length", "parallel.cp"),
      "the sequence splits into 2 x cp equal chunks (load-balanced causal split)")
def _seq(lo: Layout):
    S = lo.cfg.model.seq_length
    if lo.cp is None or S < 1:
        return
    if S % (2 * lo.cp):
        yield Problem("cp.sequence_divisible", {"model.seq_length": S, "parallel.cp": lo.cp},
                      f"rank r holds chunks r and 2cp-1-r of 2 x cp = {2 * lo.cp} equal chunks, so causal "
                      "attention work is equal on every rank",
                      [f"model.seq_length={next_multiple(S, 2 * lo.cp)}"])


@rule("cp.a2a_heads_divisible", "cp", ("parallel.cp_comm", "model.num_attention_heads", "model.num_query_groups",
                                       "parallel.cp", "parallel.tp"),
      "the all-to-all variant splits the heads (and the K/V groups) over cp x tp")
def _a2a_heads(lo: Layout):
    p, m = lo.cfg.parallel, lo.cfg.model
    if p.cp_comm != "a2a" or None in (lo.cp, lo.tp) or m.num_attention_heads < 1:
        return
    G = m.num_query_groups
    if G is not None and G >= 1 and m.num_attention_heads % (lo.cp * lo.tp) == 0 and G % (lo.cp * lo.tp):
        yield Problem("cp.a2a_heads_divisible",
                      {"parallel.cp_comm": "a2a", "model.num_query_groups": G, "parallel.cp": lo.cp,
                       "parallel.tp": lo.tp},
                      f"all-to-all attention gives each rank num_query_groups / (cp x tp) whole K/V groups "
                      f"beside its heads; {G} groups do not divide by {lo.cp * lo.tp} (the ring variant moves "
                      "the groups whole and has no such limit)", ["parallel.cp_comm=p2p"])
    if m.num_attention_heads % (lo.cp * lo.tp):
        yield Problem("cp.a2a_heads_divisible",
                      {"parallel.cp_comm": "a2a", "model.num_attention_heads": m.num_attention_heads,
                       "parallel.cp": lo.cp, "parallel.tp": lo.tp},
                      f"all-to-all attention gives each rank num_attention_heads / (cp x tp) whole heads; "
                      f"{m.num_attention_heads} heads do not divide by {lo.cp * lo.tp} (the ring variant has no "
                      "such limit)", ["parallel.cp_comm=p2p"])


@rule("cp.a2a_overlap_needs_head_groups", "cp", ("overlap.cp", "parallel.cp_comm", "model.num_attention_heads",
                                                 "model.num_query_groups"),
      "overlap.cp=true with a2a needs an even number of local heads (and K/V groups) to pipeline")
def _a2a_overlap(lo: Layout):
    p, m = lo.cfg.parallel, lo.cfg.model
    if lo.mode("cp") != "true" or p.cp_comm != "a2a" or None in (lo.cp, lo.tp) or lo.cp < 2:
        return
    G = m.num_query_groups if m.num_query_groups and m.num_query_groups >= 1 else m.num_attention_heads
    if (m.num_attention_heads % (lo.cp * lo.tp) == 0 and G % (lo.cp * lo.tp) == 0
            and a2a_head_groups(m.num_attention_heads, lo.tp, lo.cp, G) == 1):
        yield Problem("cp.a2a_overlap_needs_head_groups",
                      {"overlap.cp": "true", "parallel.cp_comm": "a2a",
                       "model.num_attention_heads": m.num_attention_heads, "parallel.cp": lo.cp},
                      "the all-to-all variant hides one head group's exchange under another's attention; "
                      f"{m.num_attention_heads // (lo.cp * lo.tp)} local head(s) and {G // (lo.cp * lo.tp)} local "
                      "K/V group(s) make one group, nothing to hide "
                      "(the ring variant overlaps at any head count)", ["parallel.cp_comm=p2p"])


@rule("cp.attention_backend_kernel", "cp", ("parallel.cp_attention_backend", "train.device", "train.precision"),
      "parallel.cp_attention_backend=cudnn needs CUDA and bf16 (the cuDNN kernel takes 16-bit inputs only)")
def _attention_backend(lo: Layout):
    p, t = lo.cfg.parallel, lo.cfg.train
    if p.cp_attention_backend != "cudnn" or lo.cp is None or lo.cp < 2:
        return
    if t.device == "cpu" or str(t.precision) not in ("bf16", "fp8"):  # fp8 runs attention in bf16
        yield Problem("cp.attention_backend_kernel",
                      {"parallel.cp_attention_backend": "cudnn", "train.device": t.device,
                       "train.precision": t.precision},
                      "the cuDNN attention kernel runs on CUDA with bf16 inputs only (or set train.device=cuda "
                      "and train.precision=bf16)", ["parallel.cp_attention_backend=auto"])


@rule("cp.mla_backend", "cp", ("parallel.cp_attention_backend", "model.attention", "parallel.cp"),
      "latent attention (q/k heads wider than v heads) under CP runs on the flash, efficient or explicit block "
      "kernels, not on cudnn")
def _mla_backend(lo: Layout):
    p, m = lo.cfg.parallel, lo.cfg.model
    if m.attention != "mla" or p.cp_attention_backend != "cudnn" or lo.cp is None or lo.cp < 2:
        return
    yield Problem("cp.mla_backend",
                  {"model.attention": "mla", "parallel.cp_attention_backend": "cudnn", "parallel.cp": lo.cp},
                  f"the cuDNN block kernel is not used with a value head width (model.v_head_dim={m.v_head_dim}) "
                  f"other than the query/key one ({m.qk_nope_head_dim + m.qk_rope_head_dim}); auto takes the flash "
                  "kernel (padding v to the q/k width and trimming it back) or the efficient one, which takes "
                  "both widths", ["parallel.cp_attention_backend=auto"])
