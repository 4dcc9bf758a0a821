"""Published throughput to check the simulator against: Narayanan et al. 2021 ("Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21), Table 1.

Each row: parameters (billions), attention heads, hidden size, layers, tensor-parallel t,
pipeline-parallel p, GPUs, global batch (sequences of 2,048 tokens), achieved TFLOP/s per GPU.
All on Selene (DGX A100 80GB, `hardware=a100_80gb`), vocabulary 51,200, mixed precision, full
activation recomputation. The paper counts FLOPs per iteration as
96 B s l h^2 (1 + s / 6h + V / (16 l h)) (its equation 3, recomputation included).

Not in the table, so assumed here (the same for every row): micro batch 1, the non-interleaved
1F1B schedule (the paper used the interleaved one for some rows without saying which), the
2021 code's overlap (none: the whole gradient buffer all-reduced after backward in one call, so
one bucket; TP without SP; blocking p2p), GeLU MLP of width 4h, LayerNorm.
"""
from __future__ import annotations

from typing import List, NamedTuple


class Row(NamedTuple):
    billions: float
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    gpus: int
    batch: int
    tflops: float  # achieved TFLOP/s per GPU


NARAYANAN_2021_TABLE1: List[Row] = [
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200


def overrides(row: Row) -> List[str]:
    return ["hardware=a100_80gb", "overlap=none", "overlap.dp_bucket_mb=1e6", f"model.num_layers={row.layers}", f"model.hidden_size={row.hidden}",
            f"model.num_attention_heads={row.heads}", f"model.ffn_hidden_size={4 * row.hidden}",
            f"model.seq_length={SEQ}", f"model.vocab_size={VOCAB}", "model.make_vocab_size_divisible_by=128",
            "model.norm=layernorm", "model.activation=gelu", "model.tie_embeddings=true", "model.recompute=full",
            "model.name=narayanan", f"parallel.tp={row.t}", f"parallel.pp={row.p}", f"parallel.world_size={row.gpus}",
            "train.precision=bf16", "train.micro_batch_size=1", f"train.global_batch_size={row.batch}"]


def paper_flops(row: Row) -> float:
    """FLOPs per iteration as the paper counts them (its equation 3)."""
    B, s, l, h, V = row.batch, SEQ, row.layers, row.hidden, VOCAB
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def predict(row: Row) -> float:
    """Predicted TFLOP/s per GPU for `row` (the paper's FLOP count over the simulated step)."""
    from mpoverlap.config import compose
    from mpoverlap.simulate.core import simulate
    from mpoverlap.simulate.hardware import from_config

    cfg = compose(overrides(row))
    step = simulate(cfg, from_config(cfg)).step_s
    return paper_flops(row) / (step * row.gpus) / 1e12


def table() -> str:
    lines = ["| params (B) | t | p | GPUs | batch | published TFLOP/s/GPU | predicted | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in NARAYANAN_2021_TABLE1:
        got = predict(row)
        lines.append(f"| {row.billions} | {row.t} | {row.p} | {row.gpus} | {row.batch} | {row.tflops:g} | "
                     f"{got:.1f} | {got / row.tflops - 1:+.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
