"""Pipeline rules: stage partitioning, the schedule choice, the interleaved and zbv microbatch
counts, tied embeddings."""
from __future__ import annotations

from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, next_multiple, rule


@rule("pp.layers_divisible", "pp", ("model.num_layers", "parallel.pp", "parallel.vpp"),
      "the layers split evenly over pp x vpp model chunks")
def _layers(lo: Layout):
    L = lo.cfg.model.num_layers
    if None in (lo.pp, lo.vpp) or L < 1:
        return
    chunks = lo.pp * lo.vpp
    if L % chunks:
        yield Problem("pp.layers_divisible", {"model.num_layers": L, "parallel.pp": lo.pp, "parallel.vpp": lo.vpp},
                      f"each of the pp x vpp = {chunks} model chunks holds num_layers / {chunks} layers",
                      [f"model.num_layers={next_multiple(L, chunks)}"])


@rule("pp.vpp_needs_pp", "pp", ("parallel.vpp", "parallel.pp"), "virtual stages need pp >= 2")
def _vpp(lo: Layout):
    if lo.vpp is not None and lo.vpp > 1 and lo.pp == 1:
        yield Problem("pp.vpp_needs_pp", {"parallel.vpp": lo.vpp, "parallel.pp": 1},
                      "interleaving assigns model chunks round-robin over pipeline stages; with one stage "
                      "there is nothing to interleave", ["parallel.vpp=1"])


@rule("pp.schedule", "pp", ("parallel.pp_schedule", "parallel.pp", "parallel.vpp"),
      "the pipeline schedule fits the layout")
def _schedule(lo: Layout):
    choice = lo.cfg.parallel.pp_schedule
    if None in (lo.pp, lo.vpp) or choice == "auto":
        return
    keys = {"parallel.pp_schedule": choice, "parallel.pp": lo.pp, "parallel.vpp": lo.vpp}
    if lo.pp == 1 and choice in ("1f1b", "interleaved", "zb1p", "zbv"):
        yield Problem("pp.schedule", keys, f"the {choice} pipeline schedule needs pipeline stages; with pp=1 "
                      "there is no pipeline to schedule (or set parallel.pp >= 2)",
                      ["parallel.pp_schedule=auto"])
    elif choice == "1f1b" and lo.vpp > 1:
        yield Problem("pp.schedule", keys, "1F1B runs one model chunk per stage; vpp > 1 chunks need the "
                      "interleaved (or zb1p) schedule (or set parallel.vpp=1)",
                      ["parallel.pp_schedule=interleaved"])
    elif choice == "interleaved" and lo.vpp == 1:
        yield Problem("pp.schedule", keys, "the interleaved schedule runs vpp > 1 model chunks per stage "
                      "(or set parallel.vpp >= 2)", ["parallel.pp_schedule=1f1b"])
    elif choice == "zbv" and lo.vpp != 2:
        # Spelled out rather than implied: parallel.vpp sizes the chunks everywhere (layer split,
        # estimates, plan), and a requested vpp is never silently changed.
        layers = lo.cfg.model.num_layers
        fix = ["parallel.vpp=2"] + ([f"model.num_layers={next_multiple(layers, 2 * lo.pp)}"]
                                    if layers % (2 * lo.pp) else [])
        yield Problem("pp.schedule", keys, "zbv lays the model out in a V, exactly two model chunks per stage "
                      "(stage s holds chunks s and 2pp-1-s: down the V and back up)", fix)


@rule("pp.interleaved_microbatches", "pp",
      ("train.global_batch_size", "train.micro_batch_size", "parallel.dp", "parallel.pp", "parallel.vpp"),
      "the interleaved schedule needs at least pp microbatches per step")
def _interleaved(lo: Layout):
    from mpoverlap.pipeline import SCHEDULE_CHOICES, resolve_schedule, schedule_constraints

    t = lo.cfg.train
    m = lo.num_microbatches
    choice = lo.cfg.parallel.pp_schedule
    if None in (lo.pp, lo.vpp, m) or lo.vpp == 1 or lo.pp == 1 or choice not in SCHEDULE_CHOICES:
        return
    kind = resolve_schedule(choice, lo.vpp)
    if kind in ("1f1b", "zbv"):
        return  # rules pp.schedule, pp.zbv_microbatches
    for message in schedule_constraints(kind, lo.pp, lo.vpp, m):
        per = t.micro_batch_size * lo.dp * lo.pp
        yield Problem("pp.interleaved_microbatches",
                      {"train.global_batch_size": t.global_batch_size, "train.micro_batch_size": t.micro_batch_size,
                       "parallel.dp": lo.dp, "parallel.pp": lo.pp, "parallel.vpp": lo.vpp},
                      message, [f"train.global_batch_size={next_multiple(t.global_batch_size, per)}"])


@rule("pp.zbv_microbatches", "pp",
      ("parallel.pp_schedule", "train.global_batch_size", "train.micro_batch_size", "parallel.dp", "parallel.pp"),
      "the zbv schedule needs at least 2(pp-1) microbatches per step")
def _zbv_microbatches(lo: Layout):
    from mpoverlap.pipeline import schedule_constraints

    t = lo.cfg.train
    m = lo.num_microbatches
    if lo.cfg.parallel.pp_schedule != "zbv" or None in (lo.pp, m) or lo.pp < 2 or m >= 2 * (lo.pp - 1):
        return
    message = next(x for x in schedule_constraints("zbv", lo.pp, 2, m) if "microbatches" in x)
    per = t.micro_batch_size * lo.dp
    yield Problem("pp.zbv_microbatches",
                  {"parallel.pp_schedule": "zbv", "train.global_batch_size": t.global_batch_size,
                   "train.micro_batch_size": t.micro_batch_size, "parallel.dp": lo.dp, "parallel.pp": lo.pp},
                  message, [f"train.global_batch_size={per * 2 * (lo.pp - 1)}"])
