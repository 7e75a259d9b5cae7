"""Pipeline parallelism: the stage split (``partition``) and the schedules (``schedules``).

One entry point per concern: ``build_stage`` builds this rank's ``GPTModel`` stage (its model
chunks), ``forward_backward`` runs a step's micro-batches through the pipeline on a schedule
(none, 1f1b, interleaved, zero_bubble), ``tied_embedding_params`` names what to sum over the
embedding group.
"""
from .partition import (
    PARTITIONS,
    PipelineConfigError,
    build_stage,
    check_micro_batches,
    layer_split,
    stage_chunks,
    tied_embedding_params,
)
from .schedules import (
    SCHEDULES,
    Action,
    ScheduleStats,
    Simulation,
    activation_shape,
    agree_costs,
    build_schedule,
    forward_backward,
    forward_only,
    simulate,
    theory_bubble,
)

__all__ = [
    "PARTITIONS",
    "SCHEDULES",
    "Action",
    "PipelineConfigError",
    "ScheduleStats",
    "Simulation",
    "activation_shape",
    "agree_costs",
    "build_schedule",
    "build_stage",
    "check_micro_batches",
    "forward_backward",
    "forward_only",
    "layer_split",
    "simulate",
    "stage_chunks",
    "theory_bubble",
    "tied_embedding_params",
]
