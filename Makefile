# The README's two commands are `make run` and `make test`; both set up .venv on first use.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.mpoverlap-installed
TORCH   ?= torch==2.13.0
# The main job: 8 ranks (dp2 x tp2 x pp2, sequence parallel) with DP, TP and PP overlap on.
RUN_ARGS ?= parallel.dp=2 parallel.tp=2 parallel.pp=2 parallel.sequence_parallel=true overlap.dp_bucket_mb=0.5 train.steps=200 train.log_interval=20 train.eval_interval=100 checkpoint.interval=100
BENCH_ARGS ?=

.PHONY: setup run test test-slurm test-exits bench clean

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

test: setup
	$(VENV)/bin/pytest -q --durations=15 tests

# launch/slurm.sbatch on a two-node SLURM cluster made on this machine (root; installs
# slurm-wlm and munge with apt-get when missing): launch/slurm-testcluster.sh, tests/test_slurm.py.
test-slurm: setup
	MPOVERLAP_TEST_SLURM=1 $(VENV)/bin/pytest -q -rs tests/test_slurm.py

# Back-to-back mpoverlap-train and bench runs, each must exit 0 without an abort (about 2 minutes).
test-exits: setup
	$(VENV)/bin/pytest -q -m exits tests/test_clean_exit.py

bench: setup
	$(PY) -m bench.run $(BENCH_ARGS)

clean:
	rm -rf runs outputs .pytest_cache
