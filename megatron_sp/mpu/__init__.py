"""Model-parallel utilities: the rank grid, process groups and ``ParallelContext`` (``parallel_state``), the collective
wrappers (``comm``), the paired autograd communication functions (``mappings``), the TP/SP layers and the
vocab-parallel cross entropy (``layers``), the gather buffer (``memory``) and ZeRO-3's per-unit parameter gathers
(``zero3``)."""
from . import comm
from .comm import CommCounter
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, set_tp_attributes, shard,
                     vocab_parallel_cross_entropy)
from .mappings import (all_to_all, copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp,
                       scatter_to_sp, scatter_to_tp)
from .memory import GatherBuffer, default_gather_buffer
from .parallel_state import ParallelContext, ParallelDims, ParallelState, init_default_group, initialize

__all__ = [
    "ColumnParallelLinear", "CommCounter", "GatherBuffer", "ParallelContext", "ParallelDims", "ParallelState",
    "RowParallelLinear", "VocabParallelEmbedding", "all_to_all", "comm", "copy_to_tp", "default_gather_buffer",
    "gather_from_sp", "gather_from_tp", "init_default_group", "initialize", "reduce_from_tp", "reduce_scatter_to_sp",
    "scatter_to_sp", "scatter_to_tp", "set_tp_attributes", "shard", "vocab_parallel_cross_entropy",
]
