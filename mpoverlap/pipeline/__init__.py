"""Pipeline parallelism: schedules as pure action tables, their checker, and the executor.

    tables = build_schedule(schedule_kind(vpp), pp, vpp, num_microbatches)  # one list per stage
    validate_schedule(tables)                                              # pure, no processes
    PipelineExecutor(tables[stage], stage=..., pp_ranks=..., group=..., overlap=..., ...).run(m)
"""
from mpoverlap.pipeline.actions import (Action, Batch, Message, P2POp, ScheduleError,
                                        chunk_index, stage_of, vchunk_of)
from mpoverlap.pipeline.executor import PipelineExecutor
from mpoverlap.pipeline.schedules import (SCHEDULE_CHOICES, SCHEDULE_KINDS, bubble_fraction,
                                          build_schedule, chunk_layout, compute_orders, defers_weight_grads,
                                          microbatch_groups, resolve_schedule,
                                          schedule_constraints, schedule_kind, simulated_bubble,
                                          simulated_bubble_time)
from mpoverlap.pipeline.validate import validate_schedule

__all__ = ["Action", "Batch", "Message", "P2POp", "ScheduleError", "chunk_index", "stage_of",
           "vchunk_of", "PipelineExecutor", "SCHEDULE_CHOICES", "SCHEDULE_KINDS", "bubble_fraction",
           "build_schedule", "chunk_layout", "compute_orders", "defers_weight_grads", "microbatch_groups",
           "resolve_schedule", "schedule_constraints", "schedule_kind", "simulated_bubble",
           "simulated_bubble_time", "validate_schedule"]
