"""Which layers a pipeline stage holds, and building that stage.

Stage ``r`` of ``pp`` holds a contiguous block of global layer indices (``stage_layers``); the first
stage also holds the input embedding, the last the final norm, the output layer and the loss
(``build_stage``). Parameter names stay global (``layers.<i>.…``) and ``GPTModel`` initialises each
parameter from (seed, name), so a stage's parameters equal the full model's of the same name: a
checkpoint keyed by name loads into any pipeline layout.

Tied embeddings (``model.tie_embeddings``): with pp > 1 the last stage holds its own copy
``output_layer.weight`` (tagged ``shared_embedding``, initialised from ``embedding.weight``); its
gradient and the first stage's ``embedding.weight`` gradient must be summed over
``state.embedding_group`` every step (``tied_embedding_params``).
"""
from __future__ import annotations

from torch import nn

from ..config.schema import ModelConfig
from ..errors import ConfigError
from ..model.gpt import GPTModel
from ..model.transformer import TensorParallel
from ..mpu.parallel_state import ParallelState

PARTITIONS = ("uniform",)


class PipelineConfigError(ConfigError, ValueError):
    """An invalid pipeline layout (a ``ConfigError`` for ``train.py``, a ``ValueError`` for callers)."""


def stage_layers(num_layers: int, pp: int, pp_rank: int, partition: str = "uniform") -> range:
    """The global layer indices stage ``pp_rank`` of ``pp`` holds: ``num_layers / pp`` contiguous layers.

    Raises ``PipelineConfigError`` (a ``ValueError``) when the layers do not divide evenly, a degree
    is out of range, or ``partition`` is not one of ``PARTITIONS``.
    """
    if partition not in PARTITIONS:
        raise PipelineConfigError(f"parallel.pp_partition = {partition!r}; supported: {', '.join(PARTITIONS)}")
    if pp < 1:
        raise PipelineConfigError(f"parallel.pp = {pp} must be >= 1")
    if not 0 <= pp_rank < pp:
        raise PipelineConfigError(f"pipeline rank {pp_rank} outside 0..{pp - 1}")
    if num_layers < pp or num_layers % pp:
        raise PipelineConfigError(f"model.num_layers = {num_layers} is not divisible by parallel.pp = {pp} "
                                  f"(each stage needs the same number of layers, at least one)")
    per_stage = num_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def check_micro_batches(num_micro_batches: int, pp: int) -> None:
    """1F1B keeps every stage busy only with at least ``pp`` micro-batches: fewer is a config error."""
    if num_micro_batches < max(1, pp):
        raise PipelineConfigError(f"{num_micro_batches} micro-batches per step with parallel.pp = {pp}: need at "
                                  f"least pp (raise train.global_batch_size or lower train.micro_batch_size)")


def build_stage(cfg_model: ModelConfig, seed: int, state: ParallelState, tp: TensorParallel | None = None) -> GPTModel:
    """This rank's pipeline stage: its layers, the embedding on the first stage, the head on the last."""
    layers = stage_layers(cfg_model.num_layers, state.pp_size, state.pp_rank)
    return GPTModel(cfg_model, seed=seed, layer_range=layers, pre_process=state.is_first_stage,
                    post_process=state.is_last_stage, tp=tp)


def tied_embedding_params(stage: GPTModel, state: ParallelState) -> list[nn.Parameter]:
    """The parameters to sum over ``state.embedding_group`` for tied embeddings ([] when nothing to do).

    First stage: ``[embedding.weight]``; last stage: ``[output_layer.weight]`` (the copy); a middle
    stage, an untied model or pp == 1 (one tensor serves both uses): ``[]``. Pass the result to
    ``DistributedOptimizer.sync_grads_over(params, state.embedding_group)`` after ``finish_grad_sync``
    (on every rank of the embedding group; with ``[]`` it is a no-op).
    """
    if not stage.cfg.tie_embeddings or state.pp_size == 1:
        return []
    if state.is_first_stage:
        assert stage.embedding is not None
        return [stage.embedding.weight]
    if state.is_last_stage:
        assert stage.output_layer is not None and stage.output_layer.weight is not None
        return [stage.output_layer.weight]
    return []
