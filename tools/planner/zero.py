"""ZeRO-2/3 beyond the persistent shards: the fp32 staging buffers of the per-micro-batch reduce-scatters, and the
parameters ZeRO-3 gathers per unit — held at once (the peak) and all-gathered per step (docs/planner.md, "ZeRO-2
and ZeRO-3")."""
from __future__ import annotations

from megatron_sp.config.schema import Config
from megatron_sp.optim.reducer import ZERO2_INFLIGHT
from megatron_sp.mpu.zero3 import Entry

from .dims import DEFAULT_BUCKET_BYTES, GRAD_BYTES, dims_of
from .state import stage_entries, state_bytes


def staging_bytes(cfg: Config, pp_rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """ZeRO-2/3: the fp32 staging buffers alive at once, the ``ZERO2_INFLIGHT + 1`` largest sharded buckets (that many
    reductions left in flight after a launch, and the bucket filling); 0 below ZeRO-2."""
    return sum(sorted(state_bytes(cfg, pp_rank, bucket_bytes).staged, reverse=True)[:ZERO2_INFLIGHT + 1]) * GRAD_BYTES


def _held(plan: list[Entry], size: dict[str, int], prefetch: int) -> int:
    """The most gathered bytes of one chunk's ``plan``: in forward an entry and the ``prefetch`` after it; in backward
    an entry and the ``prefetch`` before it, with every unit between its first and last use (its gradients are
    complete only after the backward of the first entry that reads it: a tied embedding from the head on)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, entry in enumerate(plan):
        for u in entry:
            first.setdefault(u, i)
            last[u] = i
    peak = 0
    for i in range(len(plan)):
        ahead = {u for entry in plan[i:i + prefetch + 1] for u in entry}
        behind = {u for entry in plan[max(0, i - prefetch):i + 1] for u in entry}
        behind |= {u for u in first if first[u] <= i <= last[u]}
        peak = max(peak, sum(size.get(u, 0) for u in ahead), sum(size.get(u, 0) for u in behind))
    return peak


def gathered_bytes(cfg: Config, pp_rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """ZeRO-3: the most bytes of gathered parameters (param dtype, each unit's padded buckets) held at once on a rank
    of stage ``pp_rank``: the largest window of ``_held`` over its chunks; under zero-bubble every unit of the stage (a
    unit stays gathered from a micro-batch's input-gradient action to its weight-gradient action). 0 below ZeRO-3."""
    D = dims_of(cfg)
    units = state_bytes(cfg, pp_rank, bucket_bytes).units
    size = {u: (dense + experts) * D.e for u, (dense, experts) in units.items()}
    if D.schedule == "zero_bubble":
        return sum(size.values())
    return max((_held(plan, size, cfg.parallel.zero3_prefetch) for plan in stage_entries(cfg, pp_rank)), default=0)


def gathered_per_micro_batch(cfg: Config, pp_rank: int = 0,
                             bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[int, int]:
    """ZeRO-3: (dense, expert) parameter elements all-gathered per micro-batch: each forward entry's units (an entry
    gathers its own, the tied embedding again with the head), and every unit once more for backward."""
    units = state_bytes(cfg, pp_rank, bucket_bytes).units
    uses = [u for plan in stage_entries(cfg, pp_rank) for entry in plan for u in entry] + list(units)
    return sum(units.get(u, (0, 0))[0] for u in uses), sum(units.get(u, (0, 0))[1] for u in uses)


def zero_buffers(cfg: Config, pp_rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, int]:
    """The ZeRO-2/3 temporaries in the peak (``RankPlan.buffers``), by label; {} where there are none."""
    out = {}
    staged = staging_bytes(cfg, pp_rank, bucket_bytes)
    if staged:
        out[f"ZeRO-{cfg.parallel.zero} grad staging (fp32, ≤ {ZERO2_INFLIGHT + 1} buckets)"] = staged
    gathered = gathered_bytes(cfg, pp_rank, bucket_bytes)
    if gathered:
        out[f"ZeRO-3 gathered params (prefetch {cfg.parallel.zero3_prefetch})"] = gathered
    return out
