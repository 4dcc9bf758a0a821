# The README's two commands are `make run` and `make test`; both set up .venv on first use.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.mpoverlap-installed
TORCH   ?= torch==2.13.0
# The main job: 8 ranks (dp2 x tp2 x pp2, sequence parallel) with DP, TP and PP overlap on.
RUN_ARGS ?= parallel.dp=2 parallel.tp=2 parallel.pp=2 parallel.sequence_parallel=true overlap.dp_bucket_mb=0.5 train.steps=200 train.log_interval=20 train.eval_interval=100 checkpoint.interval=100
BENCH_ARGS ?=

.PHONY: setup run test test-slurm test-exits test-compositions test-peaks bench gpu-check gpu-check-fp8 gpu-wheels clean

setup: $(STAMP)

# torch goes in first and pinned: a bare `torch` requirement on a machine without it
# would pull several GB of CUDA wheels. The editable install maps `models/` and `conf/` under
# mpoverlap (package-dir), so setuptools uses its import-hook finder and says so in an
# information-only warning that asks nothing of us: the filter silences that one message (by its
# text) and no other.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: setup
	$(VENV)/bin/mpoverlap-train $(RUN_ARGS)

# Two pytest workers (pytest-xdist), each file whole on one worker (its module fixtures, which
# train many layouts in one spawn, run once), the longest files first (tests/conftest.py; without
# --no-loadscope-reorder xdist would sort files by their number of tests, the long few-test files last):
# a file's single-process reference or pipeline warm-up leaves a core idle that the other
# worker fills. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

# launch/slurm.sbatch on a two-node SLURM cluster made on this machine (root; installs
# slurm-wlm and munge with apt-get when missing): launch/slurm-testcluster.sh, tests/test_slurm.py.
test-slurm: setup
	MPOVERLAP_TEST_SLURM=1 $(VENV)/bin/pytest -q -rs -s tests/test_slurm.py

# Parity of compositions that make test's 20 minutes leave out (the paired V with tp + SP + etp
# at world 8, the paired tables with ZeRO-3 and in bf16; about a minute): tests/test_paired_compositions.py.
test-compositions: setup
	$(VENV)/bin/pytest -q -rs -s -m compositions tests/test_paired_compositions.py

# Peak RSS of whole pp 2 runs with MTP depths against the activation estimate (about two
# minutes; the saved-bytes checks of the same estimate run in make test): tests/test_estimate_mtp.py.
test-peaks: setup
	$(VENV)/bin/pytest -q -rs -s -m peaks tests/test_estimate_mtp.py

# Back-to-back mpoverlap-train and bench runs, each must exit 0 without an abort (about 2 minutes).
test-exits: setup
	$(VENV)/bin/pytest -q -m exits tests/test_clean_exit.py

bench: setup
	$(PY) -m bench.run $(BENCH_ARGS)

# The CUDA path on one GPU in one call, within 10 minutes (docs/gpu-check.md): the CUDA tier
# (pytest -m cuda), throughput (bf16 and fp8) beside plain loops and the simulator, gpu-report.md + .json under
# $(OUT) (else runs/gpu-check). No GPU: one line, exit 0. Needs no setup: on a bare GPU machine
# it installs the wheels `make gpu-wheels` put in .gpu/whl (no network).
GPU_PY ?= $(shell test -x $(PY) && echo $(PY) || echo python3)
GPU_CHECK_ARGS ?=
gpu-check:
	@$(GPU_PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

# train.precision=fp8 on one GPU, a call of its own (docs/gpu-check.md): the tier's fp8 tests,
# llama3_1b and moe_350m in fp8 beside bf16, eager and compiled, the FP8 GEMM kernels named.
gpu-check-fp8:
	@$(GPU_PY) -m bench.gpu_check --fp8 $(GPU_CHECK_ARGS)

# The wheels a bare GPU machine lacks (Python 3.12 there), into the git-ignored .gpu/whl;
# torchao (train.precision=fp8) ships one cp310-abi3 manylinux_2_24/2_28 wheel for every
# CPython from 3.10.
gpu-wheels: setup
	mkdir -p .gpu/whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
		--platform any -d .gpu/whl hydra-core==1.3.2 omegaconf==2.3.0
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
		-d .gpu/whl torchao==0.18.0
	$(PY) -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w .gpu/whl
	ls .gpu/whl

clean:
	rm -rf runs outputs .pytest_cache
