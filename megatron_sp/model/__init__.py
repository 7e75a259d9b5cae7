"""The GPT model: ``GPTModel`` and its layout-independent initialisation ``init_full_tensor``; ``generate_batch``
(inference)."""
from megatron_sp.model.gpt import (
    GPTModel,
    count_parameters,
    flops_per_token,
    init_full_tensor,
)
from megatron_sp.model.inference import generate_batch

__all__ = ["GPTModel", "count_parameters", "flops_per_token", "generate_batch", "init_full_tensor"]
