"""`compose` keeps the defaults Hydra composed for each set of group choices and applies value
overrides to a copy (mpoverlap/config.py, `_compose_cached`): the same config and the same errors
as Hydra's own compose of the same overrides, for every kind of override the suite and users pass."""
import pytest
from omegaconf import OmegaConf

from mpoverlap import config as C

SETS = [
    [],
    ["model=moe_tiny", "model.num_layers=2", "parallel.dp=2", "parallel.ep=2", "overlap.ep=true", "overlap.ep_chunks=4"],
    ["model.hidden_size=128", "model.num_attention_heads=4", "train.precision=bf16", "train.grad_reduce_dtype=bf16"],
    ["overlap=none", "parallel.tp=2", "parallel.sequence_parallel=true"],
    ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4", "parallel.pp_schedule=zbv", "overlap=all"],
    ["model=llama_tiny", "hardware=h200_sxm", "data=indexed", "data.path=/nowhere", "checkpoint.dir=/tmp/x"],
    ["model.num_layers=2", "model=moe_fine_tiny", "train.lr=1e-3"],  # a group after a value: same
    ["model=qwen3_moe_tiny", "train.seed=7", "train.steps=3", "run.dir=/tmp/r", "checkpoint.interval=0"],
    ["parallel.dp=auto", "overlap.dp_bucket_mb=0.05", "train.distributed_optimizer=true"],
]
BAD = [["model.nope=1"], ["model=nope"], ["parallel.tp=abc"], ["train.steps"], ["+model=gpt_tiny"],
       ["model=moe_tiny", "~model.num_experts"], ["train.steps=1,2"]]
# Not errors at composition (Hydra's as ours): a hydra.* override; a value the rules refuse later.
ACCEPTED = [["hydra.job.name=x"], ["overlap.dp=maybe"]]


def _plain(cfg):
    """The config as a dict without run.dir, whose default is the time of resolution
    (`runs/<model>-${now:...}`): resolved at each compose in both."""
    out = OmegaConf.to_container(cfg)
    out["run"].pop("dir")
    return out


def _hydra(overrides):
    cfg = C._hydra_compose(overrides)
    OmegaConf.resolve(cfg)
    return cfg


def _error(fn, overrides):
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        fn(overrides)
    except (C.ConfigError, HydraException, OmegaConfBaseException, ValueError) as err:
        return "\n".join(line for line in str(err).splitlines() if not line.startswith("To append"))
    return None


@pytest.mark.parametrize("overrides", SETS, ids=lambda o: " ".join(o) or "defaults")
def test_cached_compose_equals_hydra(overrides):
    C.compose(overrides)  # the second call below reads the kept defaults
    got, want = C.compose(overrides), _hydra(overrides)
    assert _plain(got) == _plain(want)
    assert got.run.dir.split("-")[0] == want.run.dir.split("-")[0]
    assert OmegaConf.is_struct(got) and OmegaConf.is_struct(want)
    got.train.steps = 12345  # a caller's change never reaches the kept defaults
    assert C.compose(overrides).train.steps == want.train.steps


@pytest.mark.parametrize("overrides", BAD, ids=" ".join)
def test_cached_compose_raises_hydras_errors(overrides):
    C.compose(["model=moe_tiny"])
    assert _error(C.compose, overrides) == _error(_hydra, overrides) is not None


@pytest.mark.parametrize("overrides", ACCEPTED, ids=" ".join)
def test_cached_compose_accepts_what_hydra_accepts(overrides):
    assert _plain(C.compose(overrides)) == _plain(_hydra(overrides))
