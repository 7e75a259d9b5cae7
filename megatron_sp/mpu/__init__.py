"""Model-parallel utilities: the rank grid and process groups (``parallel_state``)."""
from .parallel_state import ParallelDims, ParallelState, init_default_group, initialize

__all__ = ["ParallelDims", "ParallelState", "initialize", "init_default_group"]
