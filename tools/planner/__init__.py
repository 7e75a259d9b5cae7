"""The layout planner behind ``tools/plan.py``: per-rank memory and communication of a training layout, and
the (tp, pp, cp, dp) layouts that fit. Theory, formulas and what ``--verify`` measures: docs/planner.md.
"""
from .activations import attention_kernel, chunk_activations, layer_terms, megatron_in_flight, moe_terms, table2_layer_bytes
from .dims import ACHIEVABLE_MFU, DEFAULT_BANDWIDTH_GBS, DEFAULT_BUCKET_BYTES, DEFAULT_PEAK_TFLOPS, dims_of, expert_fold
from .dims import kv_cache_bytes_per_token, moe_layers_of, stage_layers
from .layouts import Candidate, LayoutPlan, estimate_step_time, factorizations, format_bytes, layout_overrides
from .layouts import knob_variants, parse_memory, plan_layout, search, stage_flops
from .measure import SavedBytes, measure_state, micro_batch_saved_bytes, parameter_exclusions, run_verify
from .preflight import plan_vocab
from .state import stage_parameters, state_bytes
from .traffic import comm_per_step, moe_all_to_all_bytes

__all__ = ["ACHIEVABLE_MFU", "DEFAULT_BANDWIDTH_GBS", "DEFAULT_BUCKET_BYTES", "DEFAULT_PEAK_TFLOPS", "Candidate", "LayoutPlan",
           "SavedBytes", "attention_kernel", "chunk_activations", "comm_per_step", "dims_of", "estimate_step_time", "expert_fold",
           "factorizations", "format_bytes", "knob_variants", "kv_cache_bytes_per_token", "layer_terms", "layout_overrides",
           "measure_state", "megatron_in_flight", "micro_batch_saved_bytes", "moe_all_to_all_bytes", "moe_layers_of", "moe_terms",
           "parameter_exclusions",
           "parse_memory", "plan_layout", "plan_vocab", "run_verify", "search", "stage_flops", "stage_layers", "stage_parameters",
           "state_bytes", "table2_layer_bytes"]
