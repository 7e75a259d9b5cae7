"""The rank grid (order ``tp-cp-dp-pp``, TP innermost as Megatron's RankGenerator), every process group (built once
by ``initialize``) and the ``ParallelContext`` handed to the model. Groups: ``tp``, ``cp`` (USP adds ``cp_ulysses``,
``cp_ring``), ``dp``, ``pp`` (plus ``p2p_groups``, one per directed link), ``dp_cp`` (gradient, loss and token-count
reductions), ``mp`` (tp × pp), ``embedding`` (first + last stage) and, with MoE expert parallelism, ``ep`` and ``edp``
(the cp·dp ranks of each (tp, pp) position, or with ``ep_tp`` the tp·cp·dp ranks of each stage, folded as ep × edp, ep
consecutive: docs/moe.md).
"""
from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..errors import ConfigError
from . import comm
from .random import TP_DIFFERENT, RNGTracker, get_tracker

if TYPE_CHECKING:
    from ..config.schema import Config

AXES = ("tp", "cp", "dp", "pp")  # innermost first


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of each parallel axis; validates that they multiply to the world size."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    world_size: int | None = None
    cp_ulysses: int = 1
    """USP: the Ulysses degree inside each cp group (innermost); the ring runs over cp / cp_ulysses."""
    ep: int = 1
    """MoE expert parallelism, folded from the cp·dp ranks of each (tp, pp) position (experts replicated over tp) ..."""
    ep_tp: bool = False
    """... or, under sequence parallelism (TP ranks route different tokens), from the tp·cp·dp ranks of each stage."""

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ConfigError(f"parallel.{axis} = {getattr(self, axis)} must be >= 1")
        if self.cp_ulysses < 1 or self.cp % self.cp_ulysses:
            raise ConfigError(f"parallel.cp_ulysses = {self.cp_ulysses} must divide parallel.cp = {self.cp}")
        if self.ep < 1 or self.expert_fold % self.ep:
            ranks = "tp·cp·dp" if self.ep_tp else "cp·dp"
            raise ConfigError(f"parallel.ep = {self.ep} must divide {ranks} = {self.expert_fold}")
        product = self.tp * self.cp * self.dp * self.pp
        if self.world_size is None:
            object.__setattr__(self, "world_size", product)
        elif product != self.world_size:
            raise ConfigError(f"tp·cp·dp·pp = {self.tp}·{self.cp}·{self.dp}·{self.pp} = {product} "
                              f"!= world size {self.world_size}")

    def coords(self, rank: int) -> dict[str, int]:
        """The (tp, cp, dp, pp) coordinates of a global rank."""
        out = {}
        for axis in AXES:
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return out

    def rank_of(self, **coords: int) -> int:
        """The global rank at the given coordinates (missing axes are 0)."""
        rank, stride = 0, 1
        for axis in AXES:
            rank += coords.get(axis, 0) * stride
            stride *= getattr(self, axis)
        return rank

    def groups_along(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group of ranks that differ only along ``axes``, in a fixed order (each sorted)."""
        fixed = [a for a in AXES if a not in axes]
        result = []
        for fixed_vals in itertools.product(*(range(getattr(self, a)) for a in fixed)):
            base = dict(zip(fixed, fixed_vals))
            ranks = sorted(self.rank_of(**base, **dict(zip(axes, vals)))
                           for vals in itertools.product(*(range(getattr(self, a)) for a in axes)))
            result.append(ranks)
        return sorted(result)

    def pipeline_links(self) -> list[tuple[int, int]]:
        """Every directed link (src, dst) between ring neighbours of a pp group (last ↔ first: virtual stages);
        each gets its own two-rank group, so on NCCL the two directions never queue on one stream."""
        links: set[tuple[int, int]] = set()
        if self.pp > 1:
            for ranks in self.groups_along(("pp",)):
                for i, src in enumerate(ranks):
                    dst = ranks[(i + 1) % len(ranks)]
                    links.update({(src, dst), (dst, src)})
        return sorted(links)

    @property
    def expert_fold(self) -> int:
        """The ranks whose experts are folded as ep × edp: cp·dp (tp·cp·dp with ``ep_tp``)."""
        return self.cp * self.dp * (self.tp if self.ep_tp else 1)

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """(ep groups, edp groups): each group of folded ranks (dp_cp, or tp·cp·dp with ``ep_tp``; sorted, innermost
        axis first) cut into runs of ``ep`` consecutive ranks (one ep group each); edp: the ranks at the same place
        of each run."""
        folds = self.groups_along(("tp", "cp", "dp") if self.ep_tp else ("cp", "dp"))
        return ([ranks[j:j + self.ep] for ranks in folds for j in range(0, len(ranks), self.ep)],
                [ranks[i::self.ep] for ranks in folds for i in range(self.ep)])

    def embedding_groups(self) -> list[list[int]]:
        """Per (tp, cp, dp) position: the first and last pipeline stage (one rank when pp == 1)."""
        return [sorted({ranks[0], ranks[-1]}) for ranks in self.groups_along(("pp",))]


GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",),
    "dp_cp": ("cp", "dp"), "mp": ("tp", "pp"),
}


@dataclass
class ParallelState:
    """This rank's place in the grid and its process groups. Build with ``initialize``."""

    dims: ParallelDims
    rank: int
    groups: dict[str, Any] = field(default_factory=dict)
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    p2p_groups: dict[tuple[int, int], Any] = field(default_factory=dict)
    """(src, dst) global ranks → the process group of that directed pipeline link (see ``pipeline_links``)."""

    @property
    def coords(self) -> dict[str, int]:
        return self.dims.coords(self.rank)

    @property
    def tp_size(self) -> int: return self.dims.tp
    @property
    def cp_size(self) -> int: return self.dims.cp
    @property
    def dp_size(self) -> int: return self.dims.dp
    @property
    def pp_size(self) -> int: return self.dims.pp
    @property
    def dp_cp_size(self) -> int: return self.dims.dp * self.dims.cp
    @property
    def tp_rank(self) -> int: return self.coords["tp"]
    @property
    def cp_rank(self) -> int: return self.coords["cp"]
    @property
    def dp_rank(self) -> int: return self.coords["dp"]
    @property
    def pp_rank(self) -> int: return self.coords["pp"]
    @property
    def dp_cp_rank(self) -> int: return self.group_ranks["dp_cp"].index(self.rank)

    @property
    def tp_group(self) -> Any: return self.groups["tp"]
    @property
    def cp_group(self) -> Any: return self.groups["cp"]
    @property
    def pp_group(self) -> Any: return self.groups["pp"]
    @property
    def dp_cp_group(self) -> Any: return self.groups["dp_cp"]
    @property
    def mp_group(self) -> Any: return self.groups["mp"]
    @property
    def embedding_group(self) -> Any: return self.groups["embedding"]
    @property
    def ep_size(self) -> int: return self.dims.ep
    @property
    def ep_group(self) -> Any: return self.groups.get("ep", comm.LOCAL)
    @property
    def edp_group(self) -> Any: return self.groups.get("edp", self.dp_cp_group)  # ep == 1: edp is dp_cp

    @property
    def is_first_stage(self) -> bool: return self.pp_rank == 0
    @property
    def is_last_stage(self) -> bool: return self.pp_rank == self.dims.pp - 1

    def destroy(self) -> None:
        """Destroy this state's groups (the default group is left to ``destroy_process_group``)."""
        for name, group in list(self.groups.items()):
            if group is not None and group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
            del self.groups[name]
        for link, group in list(self.p2p_groups.items()):
            dist.destroy_process_group(group)
            del self.p2p_groups[link]


RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ParallelContext:
    """What the model needs to know about its layout: TP/SP and CP settings, their groups, the RNG. ``ParallelContext()``
    is the plain model in one process (``comm.LOCAL``: no collective, even inside a multi-rank job); training builds it
    with ``from_state``. ``tp_size``/``tp_rank`` are read from ``tp_group``, so they cannot disagree with it."""

    tp_group: Any = comm.LOCAL
    sequence_parallel: bool = False  # activations between TP regions are [s/t, b, h] (at tp > 1: ``sp``)
    recompute_allgather: bool = True  # SP: column-parallel layers save [s/t, b, h] inputs, re-gather in backward
    recompute: str = "none"  # model.recompute: none | selective (attention core) | full (whole layers)
    tracker: RNGTracker = field(default_factory=get_tracker)  # its "tp-different" stream (mpu.random)
    cp_group: Any = comm.LOCAL  # each of its ranks holds s/cp of every sample's tokens
    cp_algo: str = "ring"  # ring | zigzag | llama3 | ulysses | usp (attention.context_parallel)
    cp_heads_k_stride: int = 1  # llama3: kv heads per all-gather
    cp_ulysses_group: Any = None  # USP: the Ulysses sub-group of cp_group ...
    cp_ring_group: Any = None  # ... and the ring sub-group across them
    ep_group: Any = comm.LOCAL  # MoE: the ranks whose experts together make all experts (dispatcher all-to-all)
    expert_tp: bool = False  # MoE: each expert's matrices split over tp_group (parallel.expert_tp = tp, no SP)
    tp_size: int = field(init=False)
    tp_rank: int = field(init=False)

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute {self.recompute!r}; expected one of {RECOMPUTE}")
        object.__setattr__(self, "tp_size", comm.group_size(self.tp_group))
        object.__setattr__(self, "tp_rank", comm.group_rank(self.tp_group))

    @classmethod
    def from_state(cls, state: ParallelState, cfg: Config | None = None) -> ParallelContext:
        """This rank's context: the groups of ``state``, the settings of ``cfg.parallel`` and
        ``cfg.model.recompute`` (without ``cfg``: plain TP and ring CP over the state's groups)."""
        groups = {"tp_group": state.tp_group, "cp_group": state.cp_group,
                  "cp_ulysses_group": state.groups.get("cp_ulysses"), "cp_ring_group": state.groups.get("cp_ring"),
                  "ep_group": state.ep_group}
        if cfg is None:
            return cls(**groups)
        p = cfg.parallel
        return cls(**groups, sequence_parallel=p.sequence_parallel, recompute_allgather=p.tp_recompute_allgather,
                   recompute=cfg.model.recompute, cp_algo=p.cp_algo, cp_heads_k_stride=p.cp_heads_k_stride,
                   expert_tp=p.expert_tp > 1)

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect: activations between TP regions are ``[s/t, b, h]``."""
        return self.sequence_parallel and self.tp_size > 1

    def sharded_rng(self) -> contextlib.AbstractContextManager:
        """The RNG context for random ops on a tensor split over TP (a different stream per TP rank)."""
        return self.tracker.fork(TP_DIFFERENT) if TP_DIFFERENT in self.tracker else contextlib.nullcontext()


def init_default_group(backend: str, timeout_s: float = 600.0) -> None:
    """Initialise the default process group from torchrun-style environment variables, once."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"torch.distributed environment variables missing: {missing}; launch with torchrun "
                           "or train.py")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        return
    # Under torchrun the ranks share the agent's store, and it is the same store after a restart
    # (--max-restarts): without a per-attempt prefix a restarted rank can read a dead rank's gloo
    # address left by the previous attempt ("connectFullMesh failed ... Connection refused").
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), rank=rank, world_size=world,
                            store=dist.PrefixStore(f"megatron_sp/attempt_{restart}", store))


def initialize(dims: ParallelDims, timeout_s: float = 600.0) -> ParallelState:
    """Build every group of the grid (the default group must exist). Every rank creates every group in
    the same order (a torch.distributed requirement) and keeps the ones it belongs to."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != dims.world_size:
        raise ConfigError(f"launched {world} ranks but tp·cp·dp·pp = {dims.world_size}; fix parallel.* or the launch")
    state = ParallelState(dims=dims, rank=rank)
    timeout = timedelta(seconds=timeout_s)
    layouts = {name: dims.groups_along(axes) for name, axes in GROUP_AXES.items()}
    layouts["embedding"] = dims.embedding_groups()
    if dims.cp_ulysses > 1:  # USP: Ulysses groups of consecutive cp ranks, rings across them
        u = dims.cp_ulysses
        layouts["cp_ulysses"] = [ranks[j:j + u] for ranks in layouts["cp"] for j in range(0, len(ranks), u)]
        layouts["cp_ring"] = [ranks[i::u] for ranks in layouts["cp"] for i in range(u)]
    if dims.ep > 1:
        layouts["ep"], layouts["edp"] = dims.expert_groups()
    for name, all_ranks in layouts.items():
        for ranks in all_ranks:
            group = dist.GroupMember.WORLD if len(ranks) == world else dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                state.groups[name] = group
                state.group_ranks[name] = ranks
    for src, dst in dims.pipeline_links():
        group = dist.new_group(sorted((src, dst)), timeout=timeout)
        if rank in (src, dst):
            state.p2p_groups[(src, dst)] = group
    return state
