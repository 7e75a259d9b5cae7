"""What the tools/bench scripts share: the import path, the flags, a config, launching, one layer, timing, output.

The scripts import it as a sibling (``import common``): ``python tools/bench/x.py`` puts
tools/bench first on ``sys.path``, and the tests (and their ``run_distributed`` children) add it.
Importing it makes ``megatron_sp`` (from a checkout that is not installed) and ``tools/planner`` importable.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

try:
    import megatron_sp  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # tools/: the planner's measurements
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_sp import config, device
from megatron_sp.config import Config
from megatron_sp.config.schema import ModelConfig
from megatron_sp.mpu.cp_layout import required_divisor
from megatron_sp.model.gpt import GPTModel
from megatron_sp.model.transformer import RotaryEmbedding, TransformerLayer, rotary_dim
from megatron_sp.mpu import ParallelContext
from megatron_sp.testing import run_distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

MODEL_FLAGS: dict[str, tuple[type, str]] = {
    "layers": (int, "transformer layers"),
    "hidden": (int, "hidden size h"),
    "heads": (int, "attention heads"),
    "kv_heads": (int, "llama key/value heads (default: --heads)"),
    "seq": (int, "sequence length s"),
    "batch": (int, "micro-batch size b"),
    "vocab": (int, "vocabulary size"),
    "seed": (int, "random seed"),
    "arch": (str, "model architecture"),
    "warmup": (int, "untimed repetitions first"),
    "reps": (int, "timed repetitions (the median is reported)"),
    "steps": (int, "timed steps (the median is reported)"),
    "verbose": (bool, "print the per-rank / per-op detail of every row"),
    "system_malloc": (bool, "leave glibc malloc as it is (train.cache_host_memory=false); by default the process "
                            "keeps freed memory for reuse, as train.py does"),
}
"""The flags most benchmarks take: ``name: (type, help)``; each script picks its own defaults."""


def parser(doc: str, **defaults: Any) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first paragraph, with the ``MODEL_FLAGS`` named in ``defaults``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    for name, default in defaults.items():
        kind, text = MODEL_FLAGS[name]
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, action="store_true", help=text)
        else:
            choices = ("neox", "llama") if name == "arch" else None
            p.add_argument(flag, type=kind, default=default, choices=choices, help=text)
    return p


def host_memory(args: argparse.Namespace) -> bool:
    """Keep freed host memory for reuse as train.py does (``train.cache_host_memory``) unless
    ``--system-malloc``; records the outcome as ``args.host_memory_cached`` (the JSON's config) and returns it."""
    args.host_memory_cached = not args.system_malloc and device.cache_host_memory()
    return args.host_memory_cached


CONFIG_KEYS = {"arch": "arch", "layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads",
               "kv_heads": "num_kv_heads", "seq": "seq_length"}
"""The model flags a bench may have: ``flag: model config key``."""


def gpt_config(args: argparse.Namespace, vocab: int | None = None, *overrides: str, world_size: int | None = None,
               **model: Any) -> Config:
    """A finalized Config with the byte tokenizer and no data: ``model.<key>=value`` of the ``CONFIG_KEYS`` flags
    ``args`` has and the ``model`` items over them (None values left out), then the dotted ``overrides``; the
    vocabulary ``vocab`` (default ``--vocab``)."""
    flags = {key: getattr(args, flag) for flag, key in CONFIG_KEYS.items() if hasattr(args, flag)}
    items = ["data.paths=[unused-by-the-benchmark]", "tokenizer.type=byte",
             *(f"model.{k}={v}" for k, v in {**flags, **model}.items() if v is not None), *overrides]
    cfg = config.load(overrides=items, world_size=world_size)
    config.set_vocab(cfg, vocab or args.vocab)
    return cfg


def ints(text: str) -> list[int]:
    """``"1,2,4"`` → ``[1, 2, 4]``."""
    return [int(x) for x in text.split(",") if x.strip()]


def names(text: str) -> list[str]:
    """``"ring, zigzag"`` → ``["ring", "zigzag"]``."""
    return [x.strip() for x in text.split(",") if x.strip()]


def apply_quick(args: argparse.Namespace, argv: list[str] | None, quick: dict[str, Any]) -> None:
    """``--quick``: set ``quick``'s values on ``args``, except the flags given on the command line (they keep theirs)."""
    if not args.quick:
        return
    given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (sys.argv[1:] if argv is None else argv)
             if a.startswith("--")}
    for key, value in quick.items():
        if key not in given:
            setattr(args, key, value)


def per_rank(fn: Callable[..., Any], world_size: int, **kwargs: Any) -> list[Any]:
    """``fn(rank, world_size, **kwargs)`` of every rank: in this process for one rank, else on gloo ranks."""
    if world_size == 1:
        return [fn(0, 1, **kwargs)]
    return run_distributed(fn, world_size, **kwargs)


def world_group(world_size: int, alone: Any = None) -> Any:
    """The group of every ``run_distributed`` rank, or ``alone`` when the bench runs in one process."""
    import torch.distributed as dist

    return dist.group.WORLD if world_size > 1 else alone


def build_layer(cfg: ModelConfig, parallel: ParallelContext, seed: int) -> TransformerLayer:
    """Layer 0 of a GPTModel with this rank's shards of the model's initial weights (the model's own init)."""
    stage = GPTModel(cfg, seed, layer_range=range(1), pre_process=False, post_process=False, parallel=parallel)
    return stage.layers["0"].train()


def rope(cfg: ModelConfig, seq: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[s, 1, rotary_dim]`` cos/sin tables of ``seq`` tokens, as ``GPTModel.forward`` makes them."""
    return RotaryEmbedding(rotary_dim(cfg), cfg.rotary_base)(None, seq, torch.device("cpu"), torch.float32, dtype)


def graph_nodes(out: torch.Tensor) -> Iterator[Any]:
    """Every autograd node of ``out``'s backward graph, once each."""
    seen: set[Any] = set()
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(nxt for nxt, _ in node.next_functions)


class LiveBytes(TorchDispatchMode):
    """Storages that ops return while active, except those in ``exclude``, counted from their first appearance
    until freed: ``peak`` is the most bytes alive at once. Storages that existed before (parameters, inputs)
    count only if an op returns them (an in-place op); their ``.grad`` allocations do. ``sdpa``: SDPA ops seen."""

    def __init__(self, exclude: frozenset[int] | set[int] = frozenset()) -> None:
        super().__init__()
        self.exclude = exclude
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self.sdpa: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if "scaled_dot_product" in func.__name__:
            self.sdpa[func.__name__] = self.sdpa.get(func.__name__, 0) + 1
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self.live and key not in self.exclude:
                    self.live[key] = nbytes
                    self.now += nbytes
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def wall_cpu(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall and process-CPU seconds (all threads: less sensitive to waiting for a shared core) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def alternating(steps: dict[str, Callable[[], Any]], warmup: int, reps: int) -> dict[str, list[Any]]:
    """What each ``steps[name]()`` returned in the ``reps`` timed rounds after ``warmup`` untimed ones; the
    order is reversed every other round (ABBA), so that drifting load hits every step alike."""
    out: dict[str, list[Any]] = {name: [] for name in steps}
    for rep in range(warmup + reps):
        for name in list(steps) if rep % 2 == 0 else list(steps)[::-1]:
            result = steps[name]()
            if rep >= warmup:
                out[name].append(result)
    return out


def wall_cpu_stats(samples: list[tuple[float, float]], prefix: str = "") -> dict[str, float]:
    """``{prefix}s`` (median wall), ``{prefix}best_s`` (fastest wall) and ``{prefix}cpu_s`` (median CPU seconds) of
    ``wall_cpu`` results."""
    walls = [w for w, _ in samples]
    return {f"{prefix}s": statistics.median(walls), f"{prefix}best_s": min(walls),
            f"{prefix}cpu_s": statistics.median(c for _, c in samples)}


def opt(x: float | None, spec: str = ".3f") -> str:
    """``x`` formatted by ``spec``, or ``-`` when it is None."""
    return "-" if x is None else format(x, spec)


def mib(n: float, digits: int = 2) -> str:
    """Bytes as MiB with thousands separators."""
    return f"{n / 2**20:,.{digits}f}"


def print_json(bench: str, **fields: Any) -> None:
    """The report's last line: ``{"bench": bench, "torch": version, **fields}`` as JSON."""
    print(json.dumps({"bench": bench, "torch": torch.__version__, **fields}))


def ulysses_degree(args: argparse.Namespace, algo: str, n: int) -> int:
    """``parallel.cp_ulysses`` for ``algo`` at cp = n: ``--cp-ulysses`` (capped at n) for usp, else 1."""
    return min(getattr(args, "cp_ulysses", 1), n) if algo == "usp" else 1


def cp_skip_reason(args: argparse.Namespace, algo: str, n: int, seq: int) -> str:
    """Why ``algo`` cannot run at cp = n on ``seq`` tokens with ``--heads``/``--kv-heads`` ('' if it can)."""
    if n == 1:
        return ""
    need = required_divisor(algo, n)
    if seq % need:
        return f"seq {seq} is not divisible by {need}"
    g = args.kv_heads or args.heads
    u = n if algo == "ulysses" else ulysses_degree(args, algo, n)
    if u > 1 and (n % u or args.heads % u or (g % u and u % g)):
        return f"{args.heads} heads / {g} kv heads / cp {n} do not split over Ulysses degree {u}"
    return ""


def check_attention_args(args: argparse.Namespace, algos: list[str], known: tuple[str, ...]) -> None:
    """``SystemExit`` on an unknown cp algorithm, ``--kv-heads`` without llama, or heads that do not divide."""
    for name in algos:
        if name not in known:
            raise SystemExit(f"unknown algorithm {name!r}; choose from {', '.join(known)}")
    if args.kv_heads is not None and args.arch != "llama":
        raise SystemExit("--kv-heads (grouped-query attention) needs --arch llama")
    g = args.kv_heads or args.heads
    if args.heads % g or args.hidden % args.heads:
        raise SystemExit(f"--heads {args.heads} must divide --hidden {args.hidden} and be divisible by kv heads {g}")
