"""The typed configuration schema: the dataclasses Hydra merges every YAML file and command-line
override into (mpoverlap/config.py composes them), so an unknown key or a wrong type fails with
the key's name before anything starts. Values that take `auto` (parallel.dp, the overlap modes)
are typed `Any` and checked by the rule engine in `mpoverlap.overlap.rules`, which names the
key, the value and a fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling (Llama 3.1 / 3.2: rope_type llama3). Frequencies whose wavelength
    is longer than original_max_position_embeddings / low_freq_factor are divided by factor,
    those shorter than original_max_position_embeddings / high_freq_factor are kept, and the
    band between is interpolated (transformers' `_compute_llama3_parameters`)."""
    rope_type: Optional[str] = None  # null = plain RoPE (the other fields are then unused)
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    name: str = "gpt_tiny"
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    # Grouped-query attention: K/V heads (groups). None = num_attention_heads (MHA); 1 = MQA.
    num_query_groups: Optional[int] = None
    ffn_hidden_size: int = 512
    seq_length: int = 128
    vocab_size: int = 256
    make_vocab_size_divisible_by: int = 128
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    activation: str = "swiglu"  # swiglu | gelu
    rope_base: float = 10000.0
    # rope_type null = plain RoPE; rope_type llama3 with factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings = Llama 3.1/3.2's scaled frequencies.
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    # Per-head width D of q, k and v (null = hidden_size / num_attention_heads; Qwen3 0.6B and
    # 30B-A3B use 128 with narrower hidden sizes).
    head_dim: Optional[int] = None
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2 / Qwen2.5)
    qk_norm: bool = False  # RMSNorm over each head's D channels of q and k, before RoPE (Qwen3)
    # mha (multi-head attention; grouped-query with num_query_groups) | mla (DeepSeek-V2/V3's
    # multi-head latent attention, models/mla.py; the five keys below, defaults DeepSeek-V2-Lite's).
    attention: str = "mha"
    q_lora_rank: int = 0  # mla: the query latent's width (0 = no query compression)
    kv_lora_rank: int = 512  # mla: the key/value latent's width
    qk_nope_head_dim: int = 128  # mla: per-head query/key channels without RoPE
    qk_rope_head_dim: int = 64  # mla: per-head query/key channels with RoPE (one key shared by all heads)
    v_head_dim: int = 128  # mla: per-head value width
    tie_embeddings: bool = True
    init_std: float = 0.02
    norm_eps: float = 1e-5
    # Mixture of experts (0 experts = dense MLP everywhere).
    num_experts: int = 0
    moe_top_k: int = 2
    shared_expert: bool = False  # a dense MLP beside the experts, computed under the dispatch
    moe_layer_freq: int = 1  # layer i holds an MoE MLP when i % moe_layer_freq == 0
    moe_ffn_hidden_size: Optional[int] = None  # each expert's hidden size (default ffn_hidden_size)
    moe_aux_loss_coeff: float = 1e-2  # load-balancing loss coefficient
    moe_z_loss_coeff: float = 1e-3  # router z-loss coefficient
    moe_capacity_factor: Optional[float] = None  # None = dropless; else drop beyond capacity
    moe_dispatcher: str = "alltoall"  # alltoall | allgather
    # Experts as stacked weights run by grouped GEMMs (true), or one module per expert run in
    # a Python loop over host row counts (false: the reference path; a host read per layer and
    # microbatch, operators growing with the experts). Checkpoints are the same either way.
    moe_grouped_gemm: bool = True
    # Fine-grained MoE (DeepSeek-MoE / Qwen-MoE class). The shared expert's hidden size (with
    # shared_expert=true; null = the expert width). N shared experts of width F are one
    # shared MLP of width N * F (their outputs add up), so a count is written as its width.
    moe_shared_expert_ffn_hidden_size: Optional[int] = None
    moe_first_dense_layers: int = 0  # layers 0 .. N-1 keep a dense MLP (DeepSeek-MoE: 1)
    moe_router_score: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    moe_router_order: str = "score_topk"  # score_topk (score all, pick k) | topk_score (softmax over the k)
    moe_router_norm_topk: bool = True  # score_topk: renormalise the k weights to sum 1
    # Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the scores for the
    # top-k choice only, moved by rate * sign(mean load - load) after every step. 0 = off.
    moe_router_bias_update_rate: float = 0.0
    # Group-limited routing (DeepSeek-V3: 8 groups, 4 kept): the experts form num_groups
    # contiguous groups, groups are ranked by the sum of their two best scores and the top k
    # experts are chosen within the group_topk best groups (null = all groups). 1 = off.
    moe_router_num_groups: int = 1
    moe_router_group_topk: Optional[int] = None
    # The routed weights' scale, applied after any renormalisation (DeepSeek-V3: 2.5).
    moe_router_scaling_factor: float = 1.0
    # Benchmarks only (Megatron's moe_router_force_load_balancing): route by fixed random logits
    # instead of the router's, so every expert (and every ep rank) gets its share of the slots
    # whatever the router has learned; the router's logits get the gradient straight through.
    # The model does not learn to route: for timing runs, never for a model you keep.
    moe_router_force_load_balancing: bool = False
    # Multi-token prediction (DeepSeek-V3, models/mtp.py): extra depths, each one block that
    # predicts one token further ahead from the previous depth's hidden state and the next
    # token's embedding; their mean loss is added times mtp_loss_scale (0 depths = off).
    mtp_num_layers: int = 0
    mtp_loss_scale: float = 0.1
    transformer_impl: str = "local"  # local | te
    # Activation recomputation: none | selective (the attention core) | full (whole blocks).
    recompute: str = "none"
    recompute_num_layers: Optional[int] = None  # full: blocks recomputed per pipeline chunk (None = all)


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    # Expert tensor parallelism: the experts' FFN split over a tensor-parallel group of
    # etp ranks (1, or tp: the tp group), while attention keeps its tp.
    etp: int = 1
    dp: Any = "auto"  # int, or auto = world / (tp x pp x cp)
    sequence_parallel: bool = False
    cp_comm: str = "p2p"  # p2p (ring attention) | a2a (Ulysses all-to-all)
    # Pipeline schedule: auto (interleaved 1F1B when vpp > 1, else 1F1B) | 1f1b | interleaved |
    # zb1p (ZB-H1 zero bubble: weight gradients deferred into the bubble; any vpp).
    pp_schedule: str = "auto"
    # The kernel of each CP attention block: auto (fused where one takes the device and dtype,
    # explicit math otherwise) | fused (required) | explicit (fp32 math by hand) | cudnn (CUDA).
    cp_attention_backend: str = "auto"
    # Total ranks, for dp=auto outside torchrun (self-launch, mpoverlap-check); under torchrun
    # WORLD_SIZE is used and must agree.
    world_size: Any = None
    # The stage that runs the MTP depths (model.mtp_num_layers): -1 = the stage of the head's
    # chunk (the last stage; stage 0 in zbv's V), or in a loop schedule any stage s < pp-1: the
    # depths are then a model chunk of their own on stage s, fed the final hidden state
    # (docs/models.md).
    mtp_stage: int = -1


@dataclass
class OverlapConfig:
    dp: Any = "auto"  # auto | true | false
    tp: Any = "auto"
    pp: Any = "auto"
    cp: Any = "auto"
    ep: Any = "auto"  # auto: on only where the simulator predicts a faster step (simulate/ep_choice.py)
    # DP details: bucket size of the contiguous gradient buffer (MiB, or auto: the size the
    # simulator predicts fastest for this model, layout and hardware.*, simulate/bucket_size.py),
    # and whether the distributed optimizer's parameter all-gather is overlapped with the next forward.
    dp_bucket_mb: Any = "auto"
    dp_param_gather: Any = "auto"
    # ZeRO-3 (train.dp_sharding=optim_grads_params): how many units ahead are gathered while
    # the current one computes, in forward and in backward (under overlap.dp; 0 = none).
    dp_prefetch: int = 1
    # 1: one-step-delayed (double-buffered) data parallelism: step t's gradient reduction runs
    # under step t+1's forward and backward, and step t+1's update applies it (the first step
    # updates nothing). It changes the math (updates are one step stale): opt-in, never a default.
    dp_delay: int = 0
    # EP detail: each microbatch's tokens are dispatched in this many chunks, so one chunk's
    # exchange is in flight while the experts compute another (on and off use the same chunks).
    # auto: where tokens are exchanged (parallel.ep > 1), the count of 1, 2, 4, 8 the simulator
    # predicts the fastest step with (1 where EP overlap is off; simulate/ep_choice.py); 1 at ep 1,
    # where there is nothing to hide and each chunk would only repeat the layer's operators.
    ep_chunks: Any = "auto"
    # auto | true | false: forward/backward pairing at pp 1 (mpoverlap/pairing): the forward of
    # microbatch i+1 runs with the backward of microbatch i, each one's expert all-to-alls in
    # flight under the other's computation. Composes with ep_chunks (the chunks of each layer).
    # Default false: it holds one more microbatch of activations (mpoverlap-check states how much).
    ep_pairing: Any = "false"
    # auto | high | normal: on CUDA/NCCL the process groups of the modes that are on (their
    # handles are waited under compute) are created with NCCL's high-priority streams (auto =
    # high); normal creates every group without options. No effect on gloo (mpoverlap/overlap/priority.py).
    comm_priority: str = "auto"


@dataclass
class TrainConfig:
    steps: int = 100
    micro_batch_size: int = 4
    global_batch_size: int = 16
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_steps: int = 10
    lr_decay_steps: Optional[int] = None  # default: train.steps
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    # A log step gathers metrics from every rank and all-reduces the loss: host syncs that stall
    # a GPU, so only every 10th step pays them by default. (SIGTERM is agreed at every step,
    # read with the gradient norm: training/preemption.py.)
    log_interval: int = 10
    eval_interval: int = 0  # 0 = only at the end
    eval_iters: int = 4
    device: str = "auto"  # auto | cpu | cuda
    # Older spelling of train.dp_sharding=optim (ZeRO-1); not together with a higher level.
    distributed_optimizer: bool = False
    # none | optim (ZeRO-1) | optim_grads (ZeRO-2) | optim_grads_params (ZeRO-3 / FSDP): what
    # the data-parallel group (dp x cp; edp for expert weights) shards.
    dp_sharding: str = "none"
    # ZeRO-3: free a unit's gathered parameters after its forward (gathered again for its
    # backward: 2 gathers per microbatch, least memory) or keep them until its backward.
    reshard_after_forward: bool = True
    # fp32 | bf16 | fp8: bf16 runs the forward under autocast (CPU and CUDA alike) with fp32 master
    # weights, fp32 gradient accumulation and fp32 optimizer state. fp8 is bf16 plus FP8 GEMMs
    # (torchao's float8 casts and scales, the `fp8` extra) in the transformer blocks' linears and
    # experts; embedding, output head, router, norms and softmax stay bf16. The default is fp32
    # on every device, CUDA included: GPU runs ask for train.precision=bf16 explicitly.
    precision: str = "fp32"
    # tensorwise | rowwise (train.precision=fp8): torchao's float8 recipes. tensorwise: one scale
    # per tensor, e4m3 forward, e5m2 gradients; rowwise: one power-of-two scale per row, e4m3
    # everywhere.
    fp8_recipe: str = "tensorwise"
    # fp32 | bf16 | fp8 | int8: the dtype data-parallel gradient buckets are reduced in (bf16
    # halves the dp bytes; fp8 (e4m3) and int8 quantize blockwise, one fp32 scale per 512
    # elements, and sum in fp32: ~1/4 of them; gradients are still accumulated and applied in fp32).
    grad_reduce_dtype: str = "fp32"
    # auto | true | false: each rank adds what its quantized gradient send lost to the next send
    # (fp32 residuals, 4 bytes a parameter, checkpointed); auto = on for fp8/int8.
    grad_error_feedback: Any = "auto"
    # auto | fp32 | bf16 | int8 | fp8: what ZeRO-3's unit gathers (transient compute copies of the
    # weights) carry; auto = the compute dtype (bf16 under train.precision=bf16 and fp8). int8:
    # blockwise, one fp32 scale per block. fp8 (train.precision=fp8, tensorwise recipe): the FP8
    # GEMMs' weights in e4m3, one scale per weight, used by the GEMMs uncast
    # (data_parallel/fp8_gather.py). Other sharding levels gather the weights themselves: fp32.
    param_gather_dtype: str = "auto"
    # auto | bf16 | fp8: what the MoE dispatch's forward all-to-all (or all-gather) carries;
    # auto = the activation dtype. fp8: each token's hidden vector in blocks of 128, e4m3 values
    # and one fp32 scale a block in one exchange, dequantized on arrival (moe/dispatch_wire.py);
    # the combine and every backward exchange stay in the activation dtype.
    ep_dispatch_dtype: str = "auto"
    # torch.compile each transformer block's elementwise math (norms and their casts, residual
    # adds, RoPE, SwiGLU/GeLU: models/fused.py), GEMMs, attention and communication left eager;
    # one compile per region and shape. compile_backend: inductor (fused kernels; on CPU it
    # builds them with the system C++ compiler) | aot_eager (traced, not fused: a check) | eager.
    compile: bool = False
    compile_backend: str = "inductor"
    comm_timeout_s: float = 300.0
    on_nonfinite: str = "stop"  # stop | skip: what a NaN/Inf gradient does (before the update)
    progress: bool = True
    # torch profiler traces (Chrome format) and a per-rank communication timeline for the
    # steps [profile_start_step, profile_start_step + profile_steps).
    profile: bool = False
    profile_start_step: int = 2
    profile_steps: int = 3
    # Scalars to <run.dir>/tensorboard/ (rank 0); needs the optional `tensorboard` package.
    tensorboard: bool = False


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # default: <run.dir>/checkpoints
    interval: int = 0  # steps between saves; 0 = never (a final save still happens if > 0)
    resume: str = "auto"  # auto | none
    keep: int = 2
    # Stage a copy at the step boundary and write it in the background while training goes on
    # (at most one save in flight; the next save, SIGTERM and the end of the run wait for it).
    async_save: bool = False
    # A Hugging Face Llama/Qwen2/Qwen3/Mixtral/Qwen3-MoE directory to start from (when checkpoint.dir holds no
    # checkpoint to resume, which takes precedence).
    init_from: Optional[str] = None


@dataclass
class DataConfig:
    name: str = "stdlib"  # stdlib | indexed | megatron
    path: Optional[str] = None  # indexed / megatron: prefix of <path>.bin / <path>.idx
    # [w1, prefix1, w2, prefix2, ...]: mix several datasets (of format data.name) by weight,
    # instead of data.path.
    blend: Optional[List[Any]] = None
    max_bytes: int = 8_000_000  # stdlib: bytes of standard-library source to read
    val_fraction: float = 0.02


@dataclass
class CollectiveEfficiency:
    """The fraction of a link's bandwidth each collective reaches (hardware.collective_efficiency.<op>):
    1.0 where a backend runs every collective at the link's rate. `measured` times each one (gloo
    on CPU runs a reduce-scatter at about half the rate of its all-reduce)."""
    all_reduce: float = 1.0
    all_gather: float = 1.0
    reduce_scatter: float = 1.0
    all_to_all: float = 1.0
    send_recv: float = 1.0


@dataclass
class HardwareConfig:
    """What `mpoverlap-check --simulate` and `--search` predict for (conf/hardware/*.yaml; each
    preset gives its sources). Rates per GPU; bandwidths in bytes/s each way, latencies in s."""
    name: str = "h100_sxm"
    gpus_per_node: int = 8
    peak_flops: float = 989e12  # dense bf16 tensor-core FLOP/s
    # dense FP8 tensor-core FLOP/s: the rate of the GEMMs train.precision=fp8 covers; 0 = the
    # GPU has no FP8 GEMMs (the simulator refuses train.precision=fp8 there)
    fp8_peak_flops: float = 0.0
    gemm_efficiency: float = 0.55  # fraction of peak the model's GEMMs (and flash attention) reach
    hbm_gb: float = 80.0
    # HBM bytes/s: the memory-bound time (mpoverlap/simulate/memory.py); 0 = not modelled
    hbm_bw: float = 0.0
    intra_bw: float = 450e9  # within a node
    intra_latency: float = 5e-6  # per collective step
    inter_bw: float = 50e9  # across nodes
    inter_latency: float = 10e-6
    collective_efficiency: CollectiveEfficiency = field(default_factory=CollectiveEfficiency)
    # measured: time this machine's matmul and read the link rate of the namespace it runs in
    # (`tc qdisc show dev lo`), instead of the numbers above.
    measure: bool = False


@dataclass
class RunConfig:
    dir: str = "runs/${model.name}-${now:%Y%m%d-%H%M%S}"


@dataclass
class MPOverlapConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
