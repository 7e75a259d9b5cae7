"""The GPT model: ``GPTModel`` and its layout-independent initialisation ``init_full_tensor``; ``generate`` (inference)."""
from megatron_sp.model.gpt import (
    GPTModel,
    count_parameters,
    flops_per_token,
    init_full_tensor,
)
from megatron_sp.model.inference import generate

__all__ = ["GPTModel", "count_parameters", "flops_per_token", "generate", "init_full_tensor"]
