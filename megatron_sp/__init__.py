"""megatron_sp: Megatron-style GPT pretraining with TP/SP, PP, DP and CP that runs on CPU and GPU."""
from .config import registry as _registry

__version__ = "0.1.0"


def _import_config_checks() -> None:
    """Each part checks its own config keys (``config.registry.check``); the first ``finalize`` imports them."""
    from .pipeline import partition  # noqa: F401  parallel.pp_schedule, virtual_stages, pp_partition, micro-batches
    from .mpu import cp_layout  # noqa: F401  parallel.cp*, attention dropout
    from .model import moe  # noqa: F401  model.num_experts, model.moe_*
    from . import device  # noqa: F401  parallel.device, parallel.backend
    from .optim import reducer, muon  # noqa: F401  parallel.zero, train.precision, train.optimizer, train.muon_*
    from .data import gpt_dataset, blending  # noqa: F401  data.split, data.paths


_registry.discover(_import_config_checks)
