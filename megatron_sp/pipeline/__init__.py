"""Pipeline parallelism: the stage split (``partition``) and the schedules (``schedules``).

One entry point per concern: ``build_stage`` builds this rank's ``GPTModel`` stage,
``forward_backward`` runs a step's micro-batches through the pipeline (1F1B, or plain
accumulation), ``tied_embedding_params`` names what to sum over the embedding group.
"""
from .partition import (
    PARTITIONS,
    PipelineConfigError,
    build_stage,
    check_micro_batches,
    stage_layers,
    tied_embedding_params,
)
from .schedules import SCHEDULES, ScheduleStats, activation_shape, forward_backward, forward_only

__all__ = [
    "PARTITIONS",
    "SCHEDULES",
    "PipelineConfigError",
    "ScheduleStats",
    "activation_shape",
    "build_stage",
    "check_micro_batches",
    "forward_backward",
    "forward_only",
    "stage_layers",
    "tied_embedding_params",
]
