"""Typed config tree (``schema``) and its loader (``loader``): see ``load``."""
from .loader import apply_override, dumps, finalize, help_text, load, read_file, save, set_vocab, to_dict
from .schema import (CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig,
                     TokenizerConfig, TrainConfig)

__all__ = ["Config", "ModelConfig", "ParallelConfig", "TrainConfig", "DataConfig", "TokenizerConfig",
           "CheckpointConfig", "LoggingConfig", "load", "finalize", "apply_override", "read_file", "save",
           "set_vocab", "to_dict", "help_text", "dumps"]
