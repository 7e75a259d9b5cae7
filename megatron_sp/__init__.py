"""megatron_sp: Megatron-style GPT pretraining with TP/SP, PP, DP and CP that runs on CPU and GPU."""
__version__ = "0.1.0"
