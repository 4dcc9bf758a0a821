"""The rule engine: each rule rejects with its key named, and its printed fix clears it."""
import subprocess
import sys

import pytest

from mpoverlap.config import compose
from mpoverlap.overlap import CommOverlapConfig, all_rules, validate

# rule id -> cases of (overrides, world size or None)
FAILING = {
    "parallel.degree_positive": [(["parallel.tp=0"], None), (["parallel.ep=-1"], None)],
    "parallel.dp_value": [(["parallel.dp=two"], None)],
    "parallel.world_size": [(["parallel.dp=2"], 4), (["parallel.tp=3", "parallel.dp=1"], 4)],
    "train.batch_divisible": [(["train.global_batch_size=12", "train.micro_batch_size=4", "parallel.dp=2"], None)],
    "value.range": [(["train.steps=0"], None), (["train.lr=0"], None), (["data.val_fraction=1.5"], None),
                    (["overlap.dp_prefetch=-1"], None),
                    (["checkpoint.interval=-1"], None), (["train.lr_decay_steps=0"], None)],
    "value.choice": [(["model.norm=batchnorm"], None), (["overlap.dp=sometimes"], None),
                     (["train.compile_backend=tvm"], None),
                     (["overlap.ep_pairing=maybe"], None), (["overlap.comm_priority=highest"], None),
                     (["train.dp_sharding=zero3"], None),
                     (["train.device=tpu"], None), (["checkpoint.resume=maybe"], None),
                     (["parallel.cp_comm=ring"], None), (["train.precision=fp16"], None),
                     (["parallel.pp=2", "parallel.pp_schedule=zb2p"], None),
                     (["train.grad_reduce_dtype=fp4"], None)],
    "model.heads_divide_hidden": [(["model.num_attention_heads=3"], None),
                                  (["model.hidden_size=5140", "model.num_attention_heads=40"], None)],
    "model.head_dim_even": [(["model.hidden_size=10", "model.num_attention_heads=2", "model.ffn_hidden_size=32",
                              "model.num_layers=1"], None),
                            (["model.hidden_size=9", "model.num_attention_heads=3"], None)],
    "data.indexed_path": [(["data=indexed"], None), (["data=megatron"], None)],
    "checkpoint.init_from": [(["checkpoint.init_from=/nonexistent/hf"], None)],
    "data.blend": [(["data.blend=[1.0,/data/a]"], None), (["data=megatron", "data.blend=[1.0,/data/a,/data/b]"], None),
                   (["data=megatron", "data.blend=[0,/data/a]"], None)],
    "train.profile_window": [(["train.profile=true", "train.steps=3", "train.profile_start_step=2"], None),
                             (["train.profile=true", "train.steps=3", "train.profile_start_step=5"], None),
                             (["train.profile=true", "train.profile_steps=0"], None)],
    "ep.needs_experts": [(["parallel.dp=2", "parallel.ep=2"], None)],
    "ep.dispatch_dtype": [(["train.ep_dispatch_dtype=fp8"], None), (["train.ep_dispatch_dtype=bf16"], None),
                          (["model=moe_tiny", "train.ep_dispatch_dtype=fp8"], None),
                          (["model=moe_tiny", "model.hidden_size=96", "parallel.dp=2", "parallel.ep=2",
                            "train.ep_dispatch_dtype=fp8"], None)],
    "ep.divides_dp_cp": [(["model=moe_tiny", "parallel.dp=2", "parallel.ep=4"], None),
                         (["model=moe_tiny", "parallel.dp=3", "parallel.ep=2", "train.global_batch_size=12"], None)],
    "moe.experts_divisible_by_ep": [(["model=moe_tiny", "model.num_experts=6", "parallel.dp=4", "parallel.ep=4"],
                                     None)],
    "moe.top_k_range": [(["model=moe_tiny", "model.moe_top_k=9"], None), (["model=moe_tiny", "model.moe_top_k=0"], None)],
    "moe.values": [(["model=moe_tiny", "model.moe_capacity_factor=0"], None),
                   (["model=moe_tiny", "model.moe_dispatcher=ring"], None),
                   (["model=moe_tiny", "overlap.ep_chunks=0"], None), (["model=moe_tiny", "model.moe_layer_freq=0"], None)],
    "ep.overlap_needs_moe": [(["overlap.ep=true"], None)],
    "moe.fine_grained_values": [(["model=moe_fine_tiny", "model.moe_router_score=tanh"], None),
                                (["model=moe_fine_tiny", "model.moe_router_order=random"], None),
                                (["model=moe_fine_tiny", "model.moe_router_bias_update_rate=-1e-3"], None),
                                (["model=moe_fine_tiny", "model.moe_first_dense_layers=-1"], None),
                                (["model=moe_fine_tiny", "model.moe_first_dense_layers=4"], None),
                                (["model=moe_fine_tiny", "model.moe_shared_expert_ffn_hidden_size=0"], None)],
    "moe.router_groups_values": [(["model=moe_fine_tiny", "model.moe_router_num_groups=5"], None),
                                 (["model=moe_fine_tiny", "model.moe_router_num_groups=4",
                                   "model.moe_router_group_topk=5"], None),
                                 (["model=moe_fine_tiny", "model.moe_router_num_groups=8",
                                   "model.moe_router_group_topk=1"], None),
                                 (["model=moe_fine_tiny", "model.moe_router_num_groups=4",
                                   "model.moe_router_order=topk_score"], None),
                                 (["model=moe_fine_tiny", "model.moe_router_scaling_factor=0"], None)],
    "moe.router_groups_follow_ep": [(["model=moe_fine_tiny", "model.num_experts=24", "model.moe_router_num_groups=6",
                                      "parallel.dp=4", "parallel.ep=4"], None)],
    "moe.router_groups_need_experts": [(["model.moe_router_num_groups=2"], None),
                                       (["model.moe_router_scaling_factor=2.5"], None)],
    "mtp.values": [(["model.mtp_num_layers=-1"], None), (["model.mtp_num_layers=128"], None),
                   (["model.mtp_num_layers=1", "model.mtp_loss_scale=-0.1"], None)],
    "mtp.stage": [(["parallel.mtp_stage=0"], None),
                  (["model.mtp_num_layers=1", "model.num_layers=4", "parallel.pp=4", "parallel.mtp_stage=1",
                    "parallel.dp=2", "train.dp_sharding=optim_grads_params"], None),
                  (["model.mtp_num_layers=1", "parallel.pp=2", "parallel.mtp_stage=2"], None),
                  (["model=moe_tiny", "model.mtp_num_layers=1", "parallel.dp=2", "parallel.ep=2", "parallel.pp=2",
                    "parallel.vpp=2", "parallel.pp_schedule=interleaved", "parallel.mtp_stage=0",
                    "train.global_batch_size=16", "train.micro_batch_size=2", "overlap.ep_pairing=true"], None)],
    "moe.fine_grained_needs_experts": [(["model.moe_first_dense_layers=1"], None),
                                       (["model.moe_router_bias_update_rate=1e-3"], None),
                                       (["model.moe_router_score=sigmoid"], None),
                                       (["model.moe_router_force_load_balancing=true"], None)],
    "moe.topk_score_needs_softmax": [(["model=moe_fine_tiny", "model.moe_router_score=sigmoid",
                                       "model.moe_router_order=topk_score"], None)],
    "moe.shared_width_needs_shared_expert": [(["model=moe_tiny", "model.moe_shared_expert_ffn_hidden_size=64"],
                                              None)],
    "etp.value": [(["model=moe_fine_tiny", "parallel.tp=4", "parallel.etp=2"], None),
                  (["model=moe_fine_tiny", "parallel.etp=2"], None), (["model=moe_fine_tiny", "parallel.etp=0"], None)],
    "etp.needs_experts": [(["parallel.tp=2", "parallel.etp=2"], None)],
    "etp.divides_expert_ffn": [(["model=moe_fine_tiny", "parallel.tp=2", "parallel.etp=2",
                                 "model.moe_ffn_hidden_size=33"], None)],
    "recompute.values": [(["model.recompute=some"], None), (["model.recompute=full", "model.recompute_num_layers=0"], None),
                         (["model.recompute_num_layers=2"], None),
                         (["model.recompute=selective", "model.recompute_num_layers=2"], None)],
    "pp.layers_divisible": [(["parallel.pp=3"], None), (["parallel.pp=2", "parallel.vpp=3"], None)],
    "pp.vpp_needs_pp": [(["parallel.vpp=2"], None)],
    "pp.schedule": [(["parallel.pp_schedule=zb1p"], None),
                    (["parallel.pp=2", "parallel.pp_schedule=interleaved"], None),
                    (["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4", "parallel.pp_schedule=1f1b"], None),
                    (["parallel.pp=2", "parallel.pp_schedule=zbv"], None),
                    (["parallel.pp=2", "parallel.vpp=3", "model.num_layers=6", "parallel.pp_schedule=zbv"], None),
                    (["parallel.pp_schedule=zbv"], None)],
    "pp.zbv_microbatches": [(["parallel.pp=4", "parallel.vpp=2", "model.num_layers=8", "train.global_batch_size=8",
                              "train.micro_batch_size=2", "parallel.pp_schedule=zbv"], None)],
    "pp.interleaved_microbatches": [(["parallel.pp=4", "parallel.vpp=1", "train.global_batch_size=8",
                                      "train.micro_batch_size=4", "parallel.vpp=2", "model.num_layers=8"], None),
                                    (["parallel.pp=4", "parallel.vpp=2", "train.global_batch_size=8",
                                      "train.micro_batch_size=4", "model.num_layers=8", "parallel.pp_schedule=zb1p"],
                                     None)],
    "tp.divides_model": [(["parallel.tp=3"], None), (["parallel.tp=8", "model.num_attention_heads=4"], None),
                         (["model=moe_fine_tiny", "parallel.tp=4", "model.moe_shared_expert_ffn_hidden_size=66"], None)],
    "model.rope_scaling": [(["model.rope_scaling.rope_type=yarn"], None),
                           (["model.rope_scaling.rope_type=llama3", "model.rope_scaling.high_freq_factor=0.5"], None),
                           (["model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=0"], None)],
    "model.head_dim": [(["model.head_dim=33"], None), (["model.head_dim=0"], None)],
    "model.attention": [(["model.attention=mqa"], None), (["model=deepseek_v3_tiny", "model.qk_rope_head_dim=7"], None),
                        (["model=deepseek_v3_tiny", "model.kv_lora_rank=0"], None),
                        (["model=deepseek_v3_tiny", "model.num_query_groups=2"], None),
                        (["model=deepseek_v3_tiny", "model.qk_norm=true"], None)],
    "tp.divides_vocab": [(["parallel.tp=2", "model.vocab_size=256", "model.make_vocab_size_divisible_by=1",
                           "model.vocab_size=257"], None)],
    "sp.needs_tp": [(["parallel.sequence_parallel=true"], None)],
    "sp.sequence_divisible": [(["parallel.tp=4", "parallel.sequence_parallel=true", "model.seq_length=18"], None),
                              (["parallel.tp=4", "parallel.cp=2", "parallel.sequence_parallel=true",
                                "model.seq_length=20"], None)],
    "tp.transformer_engine": [(["model.transformer_impl=te"], None)],
    "cuda.max_connections": [],
    "dp.overlap_needs_replicas": [(["overlap.dp=true"], None)],
    "dp.bucket_size": [(["overlap.dp_bucket_mb=0"], None)],
    "dp.param_gather_needs_distributed_optimizer": [(["parallel.dp=2", "overlap.dp_param_gather=true"], None)],
    "dp.param_gather_needs_dp_overlap": [(["parallel.dp=2", "train.distributed_optimizer=true",
                                           "overlap.dp=false", "overlap.dp_param_gather=true"], None)],
    "dp.param_gather_needs_replicas": [(["train.distributed_optimizer=true", "overlap.dp_param_gather=true"], None)],
    "dp.param_gather_dtype": [(["parallel.dp=2", "train.dp_sharding=optim", "train.param_gather_dtype=bf16"], None),
                              (["parallel.dp=2", "train.param_gather_dtype=int8"], None),
                              (["train.dp_sharding=optim_grads_params", "train.param_gather_dtype=bf16"], None)],
    "dp.grad_reduce_dtype": [(["train.grad_reduce_dtype=int8"], None),
                             (["parallel.dp=2", "parallel.tp=2", "train.grad_reduce_dtype=fp8"], None)],
    "dp.grad_error_feedback": [(["parallel.dp=2", "train.grad_error_feedback=true"], None),
                               (["parallel.dp=2", "train.grad_error_feedback=maybe"], None)],
    "dp.sharding_conflict": [(["parallel.dp=2", "train.distributed_optimizer=true",
                               "train.dp_sharding=optim_grads_params"], None)],
    "dp.param_gather_under_zero3": [(["parallel.dp=2", "train.dp_sharding=optim_grads_params",
                                      "overlap.dp_param_gather=true"], None)],
    "cp.sequence_divisible": [(["parallel.cp=4", "model.seq_length=100"], None)],
    "cp.a2a_heads_divisible": [(["parallel.cp=4", "parallel.cp_comm=a2a", "model.num_attention_heads=2",
                                 "model.hidden_size=64"], None),
                               (["model=llama_tiny", "parallel.cp=4", "parallel.cp_comm=a2a"], None)],
    "cp.a2a_overlap_needs_head_groups": [(["parallel.cp=4", "parallel.cp_comm=a2a", "overlap.cp=true"], None),
                                         (["model=llama_tiny", "parallel.cp=2", "parallel.cp_comm=a2a",
                                           "overlap.cp=true"], None)],
    "cp.attention_backend_kernel": [(["parallel.cp=2", "parallel.cp_attention_backend=cudnn"], None),
                                    (["parallel.cp=2", "parallel.cp_attention_backend=cudnn", "train.device=cpu",
                                      "train.precision=bf16"], None)],
    "cp.mla_backend": [(["model=deepseek_v3_tiny", "parallel.cp=2", "parallel.cp_attention_backend=cudnn",
                         "train.device=cuda", "train.precision=bf16"], None)],
    "model.query_groups_divide_heads": [(["model.num_query_groups=3"], None), (["model.num_query_groups=0"], None),
                                        (["model=llama_tiny", "model.num_query_groups=16"], None)],
    "tp.divides_query_groups": [(["model=llama_tiny", "parallel.tp=4"], None),
                                (["model=llama_tiny", "model.num_query_groups=1", "parallel.tp=2"], 4)],
    "ep_pairing.needs_expert_exchange": [(["overlap.ep_pairing=true"], None),
                                         (["model=moe_tiny", "parallel.dp=2", "overlap.ep_pairing=true"], None)],
    "ep_pairing.pp_needs_vpp": [(["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "parallel.pp=2",
                                  "overlap.ep_pairing=true"], None)],
    "ep_pairing.v_microbatches": [(["model=moe_tiny", "parallel.dp=2", "parallel.ep=2",
                                    "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv",
                                    "train.global_batch_size=8", "train.micro_batch_size=2",
                                    "overlap.ep_pairing=true"], None)],
    "ep_pairing.pp_needs_interleaved": [(["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "parallel.pp=2",
                                          "parallel.pp_schedule=1f1b", "overlap.ep_pairing=true"], None)],
    "ep_pairing.needs_two_microbatches": [(["model=moe_tiny", "parallel.dp=2", "parallel.ep=2",
                                           "train.global_batch_size=8", "train.micro_batch_size=4",
                                           "overlap.ep_pairing=true"], None)],
    "ep_pairing.needs_ep_overlap": [(["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "overlap.ep=false",
                                     "overlap.ep_pairing=true"], None)],
    "dp.delay_value": [(["overlap.dp_delay=2"], None)],
    "dp.delay_sharding": [(["overlap.dp_delay=1", "parallel.dp=2", "train.dp_sharding=optim_grads"], None),
                          (["overlap.dp_delay=1", "parallel.dp=2", "train.dp_sharding=optim_grads_params"], None)],
    "dp.delay_grad_wire": [(["overlap.dp_delay=1", "parallel.dp=2", "train.grad_reduce_dtype=fp8"], None)],
    "dp.delay_pipeline": [(["overlap.dp_delay=1", "parallel.dp=2", "parallel.pp=2"], None)],
    "dp.delay_moe": [(["overlap.dp_delay=1", "model=moe_tiny", "parallel.dp=2"], None)],
    "fp8.gemm_dims": [(["train.precision=fp8", "model.hidden_size=72", "model.num_attention_heads=4"], None),
                      (["train.precision=fp8", "parallel.tp=2", "model.ffn_hidden_size=48"], 2),
                      (["train.precision=fp8", "model.seq_length=20", "train.micro_batch_size=1",
                        "train.global_batch_size=4"], None)],
    "fp8.param_gather": [(["train.precision=fp8", "train.fp8_recipe=rowwise", "train.param_gather_dtype=fp8",
                           "parallel.dp=2", "train.dp_sharding=optim_grads_params"], None),
                         (["train.precision=bf16", "train.param_gather_dtype=fp8", "parallel.dp=2",
                           "train.dp_sharding=optim_grads_params"], None)],
    "fp8.moe": [(["train.precision=fp8", "model=moe_tiny", "model.moe_grouped_gemm=false"], None),
                (["train.precision=fp8", "model=moe_tiny", "model.moe_ffn_hidden_size=40"], None)],
    "mode.required_applies": [(["overlap.tp=true"], None), (["overlap.pp=true"], None),
                              (["overlap.cp=true"], None), (["overlap.ep=true"], None)],
}
try:
    import torch

    if not torch.cuda.is_available():
        FAILING["train.device_available"] = [(["train.device=cuda"], None)]
except ImportError:  # pragma: no cover
    pass

CASES = [(rid, ov, world) for rid, cases in FAILING.items() for ov, world in cases]


# Rules that only fire on a CUDA machine; tested below with the GPU faked.
CUDA_ONLY = {"train.device_available", "cuda.max_connections", "fp8.device"}


# Rules that fire on what the machine lacks; tested below with the lack faked.
ENVIRONMENT_ONLY = {"compile.environment", "environment.torch_version", "fp8.torchao"}


def test_every_rule_has_a_failing_case():
    ids = {r.id for r in all_rules()}
    covered = {rid for rid, cases in FAILING.items() if cases} | CUDA_ONLY | ENVIRONMENT_ONLY
    assert not ids - covered, f"rules without a fix-applies test: {ids - covered}"


def test_cuda_max_connections_rule(monkeypatch):
    """On a (faked) GPU: unset is fine (mpoverlap sets 1 itself), a user's other value turns an
    `auto` TP overlap off with the reason and refuses a required one, naming the variable."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    overrides = ["parallel.tp=2", "parallel.sequence_parallel=true"]

    def problems(ov, world=2):
        return [p for p in validate(compose(ov), world_size=world) if p.rule == "cuda.max_connections"]

    assert not problems(overrides) and not problems(overrides + ["overlap.tp=true"])
    assert CommOverlapConfig.from_config(compose(overrides), 2).tp.enabled
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    for world in (2, None):  # torchrun and the self-launcher alike
        assert not problems(overrides, world)  # auto: the mode turns off, the run goes on
        tp = CommOverlapConfig.from_config(compose(overrides), world).tp
        assert not tp.enabled and "CUDA_DEVICE_MAX_CONNECTIONS=8" in tp.reason
        required = overrides + ["overlap.tp=true"]
        found = problems(required, world)
        assert found and "CUDA_DEVICE_MAX_CONNECTIONS=8" in found[0].render()
        assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in found[0].render()
        assert not problems(required + found[0].fix, world)
    # Pure DP and CPU runs do not care about the variable.
    assert not problems(["parallel.dp=2", "overlap.dp=true"])
    assert not problems(overrides + ["overlap.tp=true", "train.device=cpu"])
    assert CommOverlapConfig.from_config(compose(overrides + ["train.device=cpu"]), 2).tp.enabled
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert not problems(overrides + ["overlap.tp=true"])


def test_fp8_device_rule(monkeypatch):
    """train.precision=fp8 on a (faked) GPU below compute capability 8.9 is refused with the
    capability named and train.precision=bf16 as the fix; 8.9 and 9.0 pass, CPU runs pass."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)

    def problems(ov):
        return [p for p in validate(compose(ov), world_size=1) if p.rule == "fp8.device"]

    fp8 = ["train.precision=fp8", "train.device=cuda"]
    for cc, refused in (((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, cc=cc: cc)
        found = problems(fp8)
        assert bool(found) == refused, (cc, found)
        if refused:
            assert f"cuda_capability={cc[0]}.{cc[1]}" in found[0].render()
            assert not problems(fp8 + found[0].fix)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert not problems(["train.precision=fp8", "train.device=cpu"])


def test_fp8_torchao_rule(monkeypatch):
    """train.precision=fp8 with torchao's import blocked: refused with the install command."""
    monkeypatch.setitem(sys.modules, "torchao", None)
    found = [p for p in validate(compose(["train.precision=fp8"])) if p.rule == "fp8.torchao"]
    assert found and "pip install -e '.[fp8]'" in found[0].render()
    assert not [p for p in validate(compose(["train.precision=bf16"])) if p.rule == "fp8.torchao"]


def test_compile_environment_rule(monkeypatch):
    """train.compile=true refused without dynamo, or with inductor on CPU and no C++ compiler
    (faked); the fix (train.compile=false) clears it, and aot_eager needs no compiler."""
    import torch
    import torch._dynamo

    from mpoverlap.overlap import compile_rules

    def problems(ov):
        return [p for p in validate(compose(ov)) if p.rule == "compile.environment"]

    on = ["train.compile=true", "train.device=cpu"]
    assert not problems(on) and not problems(["train.device=cpu"])
    monkeypatch.setattr(compile_rules, "cxx_compiler", lambda: "")
    found = problems(on)
    assert found and "C++ compiler" in found[0].render() and "train.compile=true" in found[0].render()
    assert found[0].fix == ["train.compile=false"] and not problems(on + found[0].fix)
    assert not problems(on + ["train.compile_backend=aot_eager"])
    # on CUDA (faked): Triton's launcher wants a C compiler
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compile_rules, "c_compiler", lambda: "")
    found = problems(["train.compile=true", "train.device=cuda"])
    assert found and "C compiler" in found[0].render() and not problems(["train.compile=true", "train.device=cuda",
                                                                         "train.compile=false"])
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    found = problems(on + ["train.compile_backend=aot_eager"])
    assert found and "does not support this Python" in found[0].render()


def test_compile_environment_asks_for_the_compiler_inductor_runs(monkeypatch):
    """Inductor on CPU runs $CXX, else g++: a machine with only clang++ (or c++) on PATH cannot
    build its kernels, and the rule says so before any worker starts."""
    import shutil

    monkeypatch.delenv("CXX", raising=False)
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: real(name) if name in ("clang++", "c++", "cc") else None)
    found = [p for p in validate(compose(["train.compile=true", "train.device=cpu"])) if p.rule == "compile.environment"]
    assert found and "g++" in found[0].render()
    from torch._inductor import config as inductor_config

    # $CXX=c++ when inductor's config was read; torch's own patch (a monkeypatch of the config
    # class would delete the entry on undo and break every later compile in this process)
    with inductor_config.patch({"cpp.cxx": (None, "c++")}):
        if real("c++"):
            assert not [p for p in validate(compose(["train.compile=true", "train.device=cpu"]))
                        if p.rule == "compile.environment"]


def test_compile_environment_follows_the_launchers_device_choice(monkeypatch):
    """train.device=auto with more ranks on this machine than GPUs runs on CPU (gloo): inductor
    then needs the C++ compiler, not CUDA's C compiler, and the rule asks for that one."""
    import torch

    from mpoverlap.overlap import compile_rules

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(compile_rules, "cxx_compiler", lambda: "")
    monkeypatch.setattr(compile_rules, "c_compiler", lambda: "cc")
    on = ["train.compile=true", "train.device=auto"]
    found = [p for p in validate(compose(on + ["parallel.dp=2"])) if p.rule == "compile.environment"]
    assert found and "C++ compiler" in found[0].render()
    # one rank per GPU: the run is on CUDA, where the C compiler is what Triton needs
    assert not [p for p in validate(compose(on)) if p.rule == "compile.environment"]


def test_an_old_torch_is_refused_before_anything_starts(monkeypatch, capsys):
    """A torch below the floor: mpoverlap-check (and so mpoverlap-train's validation) exits 2 with
    the installed version and the install command; the floor itself and newer pass."""
    from mpoverlap import check
    from mpoverlap.overlap import environment_rules as env
    from mpoverlap.overlap.environment_rules import TORCH_FLOOR, release

    assert release("2.13.0+cpu") == (2, 13) and release("2.14.0a0+git1234") == (2, 14) and release("nightly") is None
    assert release(env.torch_version()) >= TORCH_FLOOR  # this machine's torch passes
    for ok in (f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}.0", "3.0.1"):
        monkeypatch.setattr(env, "torch_version", lambda v=ok: v)
        assert not [p for p in validate(compose([])) if p.rule == "environment.torch_version"]
    monkeypatch.setattr(env, "torch_version", lambda: "2.9.1+cu128")
    found = [p for p in validate(compose([])) if p.rule == "environment.torch_version"]
    assert len(found) == 1 and "torch=2.9.1+cu128" in found[0].render()
    assert found[0].fix == [f"pip install 'torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}'"]
    capsys.readouterr()
    assert check.main([]) == 2
    assert "torch=2.9.1+cu128" in capsys.readouterr().err


def test_default_config_is_valid():
    assert validate(compose([])) == []
    assert validate(compose(["parallel.dp=2", "overlap.dp=true", "train.distributed_optimizer=true",
                             "overlap.dp_param_gather=true"])) == []


@pytest.mark.parametrize("rule_id,overrides,world", CASES, ids=[f"{r}:{' '.join(o)}" for r, o, _ in CASES])
def test_rule_rejects_and_fix_clears(rule_id, overrides, world):
    problems = [p for p in validate(compose(overrides), world) if p.rule == rule_id]
    assert problems, f"{rule_id} did not fire for {overrides}"
    for p in problems:
        assert p.keys and p.reason and p.fix
        # The message names at least one key the user set, with its value.
        text = p.render()
        assert any(k in text for k in p.keys)
    fixed = list(overrides)
    for p in problems:
        fixed += p.fix
    remaining = [p for p in validate(compose(fixed), world) if p.rule == rule_id]
    assert not remaining, f"fix {fixed} left {[p.render() for p in remaining]}"


def test_all_problems_reported_at_once():
    problems = validate(compose(["parallel.tp=0", "model.num_attention_heads=3", "overlap.dp=true",
                                 "overlap.dp_bucket_mb=0"]))
    assert {p.rule for p in problems} >= {"parallel.degree_positive", "model.heads_divide_hidden",
                                          "dp.overlap_needs_replicas", "dp.bucket_size"}


def test_cli_false_beats_preset_true():
    # overlap=all requires every mode; a command-line false must win over the preset.
    cfg = compose(["overlap=all", "parallel.dp=2", "train.distributed_optimizer=true", "overlap.tp=false",
                   "overlap.pp=false", "overlap.cp=false", "overlap.ep=false", "overlap.ep_pairing=false"])
    assert validate(cfg) == []
    ov = CommOverlapConfig.from_config(cfg)
    assert ov.dp.enabled and ov.dp.requested == "true" and ov.dp_param_gather.enabled
    assert not ov.tp.enabled and ov.tp.requested == "false"


def test_auto_says_why_off():
    ov = CommOverlapConfig.from_config(compose([]))
    assert not ov.dp.enabled and "single replica" in ov.dp.reason
    ov = CommOverlapConfig.from_config(compose(["overlap.dp=false", "parallel.dp=2"]))
    assert not ov.dp.enabled and "waited at once" in ov.dp.reason



def test_tp_overlap_applies_without_sequence_parallelism():
    """tp 2 without SP: overlap.tp=auto turns on (the column-parallel input-gradient all-reduce
    under the wgrad GEMM), true is accepted, false keeps it off; the reason says what hides
    under what, and under zb1p where the deferred W leaves the all-reduce."""
    for asked in ("auto", "true"):
        cfg = compose(["parallel.tp=2", f"overlap.tp={asked}"])
        assert validate(cfg, 2) == []
        tp = CommOverlapConfig.from_config(cfg, 2).tp
        assert tp.enabled and "input-gradient all-reduce" in tp.reason and "wgrad GEMM" in tp.reason
        assert "pp_schedule" not in tp.reason
    off = CommOverlapConfig.from_config(compose(["parallel.tp=2", "overlap.tp=false"]), 2).tp
    assert not off.enabled and "waited at once" in off.reason
    zb = compose(["parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=zb1p"])
    tp = CommOverlapConfig.from_config(zb, 4).tp
    assert tp.enabled and "parallel.pp_schedule=zb1p" in tp.reason and "bias-gradient sum only" in tp.reason
    from mpoverlap.overlap.plan import render_plan

    assert "overlap.tp                auto -> ON" in render_plan(zb, 4)


def test_dp_overlap_applies_to_expert_buckets_over_tp_at_dp1():
    """MoE + SP + parallel.etp=1 at tp 2, dp 1 reduces the expert
    gradients over tp x edp in the dp buckets: overlap.dp=auto turns on and true is accepted;
    without SP (whole-sequence expert gradients, nothing to reduce) true is still refused."""
    moe_sp = ["model=moe_tiny", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=1"]
    assert validate(compose([*moe_sp, "overlap.dp=true"]), 2) == []
    ov = CommOverlapConfig.from_config(compose(moe_sp), 2)
    assert ov.dp.enabled and "tp x edp" in ov.dp.reason
    refused = validate(compose(["model=moe_tiny", "parallel.tp=2", "overlap.dp=true"]), 2)
    assert [p.rule for p in refused] == ["dp.overlap_needs_replicas"]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mpoverlap.check", *args], capture_output=True, text=True,
                          timeout=60)


def test_check_cli_exit_codes_and_messages():
    ok = _cli("parallel.dp=2")
    assert ok.returncode == 0, ok.stderr
    assert "overlap.dp" in ok.stdout and "ON" in ok.stdout
    bad = _cli("overlap.dp=true", "parallel.tp=0", "model.num_attention_heads=3")
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    for needle in ("overlap.dp=true", "parallel.tp=0", "model.num_attention_heads=3", "fix:"):
        assert needle in bad.stderr
    unknown = _cli("model.hidden=3")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr and "hidden" in unknown.stderr
    rules = _cli("--rules")
    assert rules.returncode == 0 and all(r.id in rules.stdout for r in all_rules())


@pytest.mark.parametrize("overrides", [[], ["model=gpt_125m"], ["model.tie_embeddings=false", "model.norm=layernorm",
                                                                 "model.activation=gelu"]])
def test_parameter_estimate_is_exact(overrides):
    from mpoverlap.models.gpt import GPT, num_parameters
    from mpoverlap.overlap.estimate import estimate
    from mpoverlap.training.pipeline_glue import build_chunks

    cfg = compose(overrides + (["model.num_layers=2", "model.seq_length=64"] if overrides == ["model=gpt_125m"] else []))
    assert estimate(cfg).params == num_parameters(GPT(cfg.model))
    # Pipeline stages: the estimate is the busiest stage; every stage's count is exact.
    from mpoverlap.overlap.estimate import stage_params
    from mpoverlap.overlap.layout import build_layout

    cfg2 = compose(overrides + ["parallel.pp=2", "model.num_layers=4"])
    lo = build_layout(cfg2)
    for stage in range(2):
        chunks = build_chunks(cfg2.model, 2, 1, stage, seed=1)
        assert stage_params(cfg2, lo, stage) == sum(num_parameters(c) for c in chunks)


@pytest.mark.parametrize("overrides,noted", [
    (["parallel.tp=2", "parallel.sequence_parallel=true", "model.moe_capacity_factor=1.25"], True),
    (["parallel.cp=2", "model.moe_capacity_factor=1.25"], True),
    (["parallel.tp=2", "model.moe_capacity_factor=1.25"], False),  # no SP: every tp rank routes all tokens
    (["parallel.tp=2", "parallel.sequence_parallel=true"], False),  # dropless: layout-invariant
])
def test_plan_states_when_capacity_drops_depend_on_the_layout(overrides, noted):
    """Capacity is applied per rank; with split sequences the plan (and so
    mpoverlap-check and the start-up output) says that drops then depend on the layout."""
    from mpoverlap.overlap.plan import render_plan

    cfg = compose(["model=moe_tiny", *overrides])
    plan = render_plan(cfg, 4)
    assert ("note: model.moe_capacity_factor=1.25" in plan) == noted, plan
    if noted:
        assert "depend on the layout" in plan and "model.moe_capacity_factor=null" in plan


@pytest.mark.parametrize("extra", [[], ["model.mtp_num_layers=1"], ["model.mtp_num_layers=1", "model.tie_embeddings=false"]],
                         ids=["tied", "tied_mtp", "untied_mtp"])
def test_paired_v_runs_a_weight_both_chunks_of_stage_0_use(extra):
    """The paired V (overlap.ep_pairing=true with zbv) with a tied head or MTP depths: stage 0's
    embedding chunk and head chunk share the embedding, whose gradient the pipeline executor adds
    in each microbatch's last W (tests/test_zero_bubble_parity.py, tests/test_mtp_paired_pipeline.py
    train them against the single process): no rule refuses it, and the plan pairs."""
    cfg = compose(["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "parallel.vpp=2",
                   "parallel.pp_schedule=zbv", "overlap.ep_pairing=true", "overlap.ep=true", "overlap.dp=true",
                   "train.global_batch_size=16", "train.micro_batch_size=2", *extra])
    assert [p.render() for p in validate(cfg, 4)] == []
    state = CommOverlapConfig.from_config(cfg).ep_pairing
    assert state.enabled and "paired V" in state.reason, state.reason


def test_ep_pairing_auto_resolves_off_with_the_reason_and_on_where_it_applies():
    """overlap.ep_pairing=auto never refuses: where pairing cannot run the plan says why.
    overlap.ep=true: pairing needs EP overlap, which auto turns on only where the simulator
    predicts a gain (tests/test_ep_auto.py)."""
    moe = ["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "overlap.ep_pairing=auto", "overlap.ep=true"]
    on = CommOverlapConfig.from_config(compose(moe)).ep_pairing
    assert on.enabled and "paired" in on.reason
    for extra, why in ((["parallel.pp=2"], "parallel.vpp=1"), (["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv"],
                                                                  "parallel.pp_schedule=zbv"),
                       (["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zb1p"], "parallel.pp_schedule=zb1p"),
                       (["train.micro_batch_size=4", "train.global_batch_size=8"], "microbatch"), (["parallel.ep=1"], "parallel.ep=1")):
        cfg = compose([*moe, *extra])
        assert not [p for p in validate(cfg) if p.rule.startswith("ep_pairing")]
        state = CommOverlapConfig.from_config(cfg).ep_pairing
        assert not state.enabled and why in state.reason, (extra, state.reason)
    assert not CommOverlapConfig.from_config(compose(["model=moe_tiny", "parallel.dp=2", "parallel.ep=2"])).ep_pairing.enabled
    # full recompute: paired (each MoE block's forward replayed as sub-steps in its backward)
    assert CommOverlapConfig.from_config(compose([*moe, "model.recompute=full"])).ep_pairing.enabled
    # zb1p at vpp 2 with true: the paired zb1p table, accepted
    zb1p = compose([*moe, "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zb1p", "overlap.ep_pairing=true"])
    assert not [p for p in validate(zb1p) if p.rule.startswith("ep_pairing")]
    assert "zb1p" in CommOverlapConfig.from_config(zb1p).ep_pairing.reason
    # pp 2 x vpp 2 (the interleaved table): paired
    piped = CommOverlapConfig.from_config(compose([*moe, "parallel.pp=2", "parallel.vpp=2"])).ep_pairing
    assert piped.enabled and "FB" in piped.reason, piped.reason
