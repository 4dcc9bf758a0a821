"""Multi-token prediction rules (model.mtp_num_layers, model.mtp_loss_scale; models/mtp.py).

The MTP depths run on the chunk with the head and read a copy of the embedding there, summed
over the embedding group like a tied head's (training/pipeline_glue.py, `shares_embedding`); in
zbv's V that chunk is on stage 0 beside the embedding, one module for both. parallel.mtp_stage=0
in a loop schedule (1f1b, interleaved, zb1p) makes the depths a model chunk of their own on
stage 0 (the "loop_mtp" layout: pipeline/actions.py, models/mtp_chunk.py), fed the final hidden
state by the head's stage, with copies of the embedding and of an untied output layer summed
with the originals (training/pipeline_ties.py; at every ZeRO level each copy is a bucket of its
own, gathered under ZeRO-3 with the depth units that read it). What that machinery cannot carry
is refused here rather than run wrong: a middle stage (the embedding group holds the first and
the last stage only).
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


@rule("mtp.stage", "pp", ("parallel.mtp_stage", "model.mtp_num_layers", "parallel.pp", "parallel.pp_schedule"),
      "parallel.mtp_stage is -1, the stage of the head's chunk (the last; 0 in zbv's V), or 0 in a loop "
      "schedule (the depths a chunk of their own there), and is set only with MTP depths")
def _stage(lo: Layout):
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
    if s != 0:
        yield Problem("mtp.stage", {"parallel.mtp_stage": s, "parallel.pp": pp,
                                    "parallel.pp_schedule": c.parallel.pp_schedule},
                      f"the depths run on the head's stage ({head}) or, in a loop schedule, on stage 0 as a chunk "
                      "of their own, their copies of the embedding and output head summed over the embedding "
                      f"group (the first and the last stage); stage {s} is neither",
                      ["parallel.mtp_stage=0", "parallel.mtp_stage=-1"])
