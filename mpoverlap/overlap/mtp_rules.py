"""Multi-token prediction rules (model.mtp_num_layers, model.mtp_loss_scale; models/mtp.py).

The MTP depths run on the chunk with the head and read a copy of the embedding there, summed
over the embedding group like a tied head's (training/pipeline_glue.py, `shares_embedding`); in
zbv's V that chunk is on stage 0 beside the embedding, one module for both. parallel.mtp_stage=s
below the last stage in a loop schedule (1f1b, interleaved, zb1p) makes the depths a model chunk
of their own on stage s (the "loop_mtp" layouts: pipeline/actions.py, models/mtp_chunk.py), fed
the final hidden state by the head's stage, with copies of the embedding and of an untied output
layer summed with the originals (training/pipeline_ties.py; on a middle stage over groups of the
stages holding them, parallel/grid.py's mtp_* kinds; at every ZeRO level each copy is a bucket of
its own, gathered under ZeRO-3 with the depth units that read it). What that machinery cannot
carry is refused here rather than run wrong: a stage other than 0 in zbv's V, the MTP chunk in
the paired tables, and ZeRO-2/3 beside an MTP chunk on a middle stage (built and measured on
stage 0 only).
"""
from __future__ import annotations

from mpoverlap.overlap.layout import Layout
from mpoverlap.overlap.rules import Problem, rule


@rule("mtp.values", "general", ("model.mtp_num_layers", "model.mtp_loss_scale", "model.seq_length"),
      "MTP depths are a count below the sequence length; their loss scale is not negative")
def _values(lo: Layout):
    m = lo.cfg.model
    D, S = m.mtp_num_layers, m.seq_length
    if D < 0 or (isinstance(S, int) and S >= 2 and D >= S):
        yield Problem("mtp.values", {"model.mtp_num_layers": D, "model.seq_length": S},
                      "depth d predicts the token d + 1 positions ahead: 0 (off) up to seq_length - 1 depths",
                      [f"model.mtp_num_layers={0 if D < 0 else 1}"])
    if m.mtp_loss_scale < 0:
        yield Problem("mtp.values", {"model.mtp_loss_scale": m.mtp_loss_scale},
                      "the MTP loss is added times this scale: a negative one would train against it",
                      ["model.mtp_loss_scale=0.1"])


def head_stage(pp: int, pp_schedule: str) -> int:
    """The pipeline stage of the head's chunk: the last one, or 0 in zbv's V."""
    return 0 if pp > 1 and str(pp_schedule) == "zbv" else pp - 1


@rule("mtp.stage", "pp", ("parallel.mtp_stage", "model.mtp_num_layers", "parallel.pp", "parallel.pp_schedule",
                         "train.dp_sharding", "overlap.ep_pairing"),
      "parallel.mtp_stage is -1, the stage of the head's chunk (the last; 0 in zbv's V), or in a loop "
      "schedule any other stage (the depths a chunk of their own there; ZeRO-2/3 beside it on stage 0 "
      "only), and is set only with MTP depths")
def _stage(lo: Layout):
    from mpoverlap.overlap.dp_rules import sharding_level

    c = lo.cfg
    s, D = c.parallel.mtp_stage, c.model.mtp_num_layers
    if s == -1:
        return
    if D <= 0:
        yield Problem("mtp.stage", {"parallel.mtp_stage": s, "model.mtp_num_layers": D},
                      "a model without MTP depths has nothing to place on that stage", ["parallel.mtp_stage=-1"])
        return
    pp = lo.pp or 1
    if not 0 <= s < pp:
        yield Problem("mtp.stage", {"parallel.mtp_stage": s, "parallel.pp": pp},
                      f"the pipeline has stages 0 .. {pp - 1} (-1 = the head's stage)", ["parallel.mtp_stage=-1"])
        return
    head = head_stage(pp, c.parallel.pp_schedule)
    if s == head:
        return
    if head == 0:
        yield Problem("mtp.stage", {"parallel.mtp_stage": s, "parallel.pp": pp,
                                    "parallel.pp_schedule": c.parallel.pp_schedule},
                      "zbv's V holds the head and the embedding on stage 0, where the depths run; a chunk of "
                      f"their own on stage {s} is built for the loop schedules (1f1b, interleaved, zb1p) only",
                      ["parallel.mtp_stage=0", "parallel.pp_schedule=zb1p"])
        return
    if lo.mode("ep_pairing") == "true":
        yield Problem("mtp.stage", {"parallel.mtp_stage": s, "overlap.ep_pairing": True, "parallel.pp": pp},
                      "the depths' chunk of their own runs in the unpaired loop tables only: the "
                      "paired tables have no sub-step program for it (the head's stage runs the depths in "
                      "the head chunk's sub-step, paired; or keep that stage with overlap.ep_pairing=false)",
                      ["parallel.mtp_stage=-1"])
        return
    level = sharding_level(c)
    if s != 0 and level in ("optim_grads", "optim_grads_params"):
        yield Problem("mtp.stage", {"parallel.mtp_stage": s, "train.dp_sharding": level, "parallel.pp": pp},
                      f"the depths' chunk on stage {s} holds copies of the embedding and output head whose "
                      "gradients are summed with the originals' after the reduction; their ZeRO-2/3 buckets and "
                      "units are built and measured for the chunk on stage 0 only",
                      ["train.dp_sharding=optim", "parallel.mtp_stage=0"])
