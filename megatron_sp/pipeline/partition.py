"""Which layers a pipeline stage holds (``pp · v`` contiguous blocks; virtual stage ``s`` is chunk ``s // pp`` of
rank ``s % pp``), and building that stage. Imports no torch (config checks use it). Theory: docs/pipeline.md.
"""
from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from ..config.registry import check
from ..config.schema import Config, ModelConfig
from ..errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from ..model.gpt import GPTModel
    from ..mpu.parallel_state import ParallelContext, ParallelState

PARTITIONS = ("uniform", "balanced")  # parallel.pp_partition may also be a comma-separated list of layer counts
SCHEDULES = ("none", "1f1b", "interleaved", "zero_bubble")  # parallel.pp_schedule: the tables of schedules.py


class PipelineConfigError(ConfigError, ValueError):
    """An invalid pipeline layout (a ``ConfigError`` for ``train.py``, a ``ValueError`` for callers)."""


def layer_split(cfg_model: ModelConfig, pp: int, virtual_stages: int = 1, partition: str = "uniform") -> list[range]:
    """The global layer indices of every virtual stage ``0 .. pp·v − 1``, in pipeline order; a
    ``PipelineConfigError`` naming the config key when the split is impossible."""
    n, stages = cfg_model.num_layers, pp * virtual_stages
    _check_stage_count(n, pp, virtual_stages)
    if partition == "uniform":
        if n % stages:
            raise PipelineConfigError(
                f"model.num_layers = {n} is not divisible by parallel.pp·virtual_stages = {pp}·{virtual_stages}; "
                "set parallel.pp_partition=balanced or list the layers per stage (e.g. \"3,5\")")
        counts = [n // stages] * stages
    elif partition == "balanced":
        counts = _balanced_counts(cfg_model, stages)
    else:
        counts = _explicit_counts(partition, n, stages, pp, virtual_stages)
    starts = [sum(counts[:s]) for s in range(stages)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def _check_stage_count(n: int, pp: int, virtual_stages: int) -> None:
    if n < pp * virtual_stages:
        raise PipelineConfigError(f"model.num_layers = {n} is fewer than parallel.pp·virtual_stages = {pp}·{virtual_stages}"
                                  " (every virtual stage needs at least one layer)")


def _explicit_counts(partition: str, n: int, stages: int, pp: int, v: int) -> list[int]:
    try:
        counts = [int(x) for x in partition.split(",")]
    except ValueError:
        raise PipelineConfigError(f"parallel.pp_partition = {partition!r}: use {' | '.join(PARTITIONS)} or a "
                                  "comma-separated list of layers per stage, e.g. \"3,5\"") from None
    if len(counts) != stages or min(counts) < 1 or sum(counts) != n:
        raise PipelineConfigError(f"parallel.pp_partition = {partition!r}: need pp·virtual_stages = {pp}·{v} = {stages} "
                                  f"counts, each >= 1, summing to model.num_layers = {n}")
    return counts


def _balanced_counts(cfg_model: ModelConfig, stages: int) -> list[int]:
    """Layer counts minimising the largest stage's parameter count (ties: the most even layer counts); a MoE layer
    counts all its experts, the last stage its multi-token prediction modules."""
    from ..model.gpt import parameter_parts  # imports torch: only for the balanced split
    from ..model.moe import is_moe_layer

    parts = parameter_parts(cfg_model)
    n = cfg_model.num_layers
    prefix = [0]  # prefix[i]: the parameters of layers 0 .. i-1
    for i in range(n):
        prefix.append(prefix[-1] + parts["moe_layer" if is_moe_layer(cfg_model, i) else "layer"])
    head = parts["final_norm"] + parts["output_layer"] + parts["mtp"]

    def cost(stage: int, start: int, count: int) -> int:
        return prefix[start + count] - prefix[start] + (parts["embedding"] if stage == 0 else 0) + \
            (head if stage == stages - 1 else 0)

    # best[s][k]: (largest stage cost, Σ count²) for the first s stages holding k layers, and the split.
    best: list[dict[int, tuple[tuple[int, int], list[int]]]] = [{0: ((0, 0), [])}]
    for s in range(stages):
        row: dict[int, tuple[tuple[int, int], list[int]]] = {}
        for k, ((worst, squares), counts) in best[s].items():
            for c in range(1, n - k - (stages - s - 1) + 1):
                key = (max(worst, cost(s, k, c)), squares + c * c)
                if k + c not in row or key < row[k + c][0]:
                    row[k + c] = (key, [*counts, c])
        best.append(row)
    return best[stages][n][1]


def stage_chunks(cfg_model: ModelConfig, pp: int, pp_rank: int, virtual_stages: int = 1,
                 partition: str = "uniform") -> list[range]:
    """The layer ranges of pipeline rank ``pp_rank``'s model chunks: virtual stages r, r + pp, …"""
    if not 0 <= pp_rank < pp:
        raise PipelineConfigError(f"pipeline rank {pp_rank} outside 0..{pp - 1}")
    split = layer_split(cfg_model, pp, virtual_stages, partition)
    return [split[c * pp + pp_rank] for c in range(virtual_stages)]


def check_micro_batches(num_micro_batches: int, pp: int, schedule: str = "1f1b") -> None:
    """A pipelined schedule keeps every stage busy only with at least ``pp`` micro-batches (the
    interleaved one needs a multiple of pp): otherwise a config error. ``none`` takes any count."""
    if schedule == "none" or pp == 1:
        return
    if num_micro_batches < pp:
        raise PipelineConfigError(f"{num_micro_batches} micro-batches per step with parallel.pp = {pp}: the "
                                  f"{schedule} schedule needs at least pp (raise train.global_batch_size or lower "
                                  "train.micro_batch_size)")
    if schedule == "interleaved" and num_micro_batches % pp:
        raise PipelineConfigError(f"{num_micro_batches} micro-batches per step with parallel.pp = {pp}: the "
                                  "interleaved schedule needs a multiple of pp (adjust train.global_batch_size)")


def check_schedule(name: str, pp: int, virtual_stages: int = 1) -> None:
    """``parallel.pp_schedule`` with ``parallel.pp`` and ``parallel.virtual_stages``: an error unless runnable."""
    if name not in SCHEDULES:
        close = difflib.get_close_matches(name, SCHEDULES, n=1, cutoff=0.5)
        raise PipelineConfigError(f"parallel.pp_schedule = {name!r} is not supported; use one of {', '.join(SCHEDULES)}"
                                  + (f" (did you mean '{close[0]}'?)" if close else ""))
    if name == "interleaved" and (virtual_stages < 2 or pp < 2):
        raise PipelineConfigError(f"parallel.pp_schedule = interleaved needs parallel.pp >= 2 and "
                                  f"parallel.virtual_stages >= 2 (got {pp}, {virtual_stages})")
    if name != "interleaved" and virtual_stages != 1:
        raise PipelineConfigError(f"parallel.virtual_stages = {virtual_stages} needs parallel.pp_schedule = interleaved")


@check
def check_pipeline_config(cfg: Config) -> None:
    """The pipeline keys of a config: schedule, layers per virtual stage, micro-batches per step."""
    m, p = cfg.model, cfg.parallel
    check_schedule(p.pp_schedule, p.pp, p.virtual_stages)
    if p.pp_partition != "balanced" or m.padded_vocab_size is not None:  # balanced counts need the vocabulary
        layer_split(m, p.pp, p.virtual_stages, p.pp_partition)
    else:
        _check_stage_count(m.num_layers, p.pp, p.virtual_stages)
    check_micro_batches(cfg.train.grad_accum_steps, p.pp, p.pp_schedule)


def build_stage(cfg_model: ModelConfig, seed: int, state: ParallelState, parallel: ParallelContext | None = None, *,
                virtual_stages: int = 1, partition: str = "uniform", label_smoothing: float = 0.0,
                z_loss: float = 0.0) -> GPTModel:
    """This rank's pipeline stage: its model chunks, the embedding on the first stage, the head (its cross
    entropy with ``label_smoothing`` and ``z_loss``) on the last."""
    from ..model.gpt import GPTModel

    chunks = stage_chunks(cfg_model, state.pp_size, state.pp_rank, virtual_stages, partition)
    return GPTModel(cfg_model, seed=seed, layer_chunks=chunks, pre_process=state.is_first_stage,
                    post_process=state.is_last_stage, parallel=parallel, label_smoothing=label_smoothing, z_loss=z_loss)


def tied_embedding_params(stage: GPTModel, state: ParallelState) -> list[nn.Parameter]:
    """The parameters to sum over ``state.embedding_group`` for tied embeddings, or the embedding copy that
    multi-token prediction uses on the last stage: ``[embedding.weight]`` on the first stage,
    ``[output_layer.weight]`` (tied) or ``[mtp_embedding.weight]`` on the last, else (middle stage, untied model
    without MTP, pp == 1) ``[]``."""
    tied = stage.cfg.tie_embeddings
    if not (tied or stage.cfg.mtp_layers) or state.pp_size == 1:
        return []
    if state.is_first_stage:
        assert stage.embedding is not None
        return [stage.embedding.weight]
    if state.is_last_stage:
        copy = stage.output_layer if tied else stage.mtp_embedding
        assert copy is not None and copy.weight is not None
        return [copy.weight]
    return []
