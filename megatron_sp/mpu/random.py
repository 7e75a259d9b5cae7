"""Random-number streams for tensor parallelism, and activation checkpointing that replays them.

Rule: dropout on a tensor sharded over TP runs inside ``tracker.fork(TP_DIFFERENT)`` (seeded per TP rank), on a
replicated one on the default stream (TP-same). Theory, seeds and restrictions: docs/tensor_parallel.md.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import device as device_mod

TP_DIFFERENT = "tp-different"  # the tracked stream seeded differently on each TP rank
TP_DIFFERENT_OFFSET = 2718  # offset of the tp-different seed from the default seed (Megatron's choice)
PP_SEED_STRIDE = 100  # seed distance between consecutive pipeline stages (both streams)
TP_SEED_STRIDE = 1  # seed distance between consecutive TP ranks of the tp-different stream


def _device_key(dev: torch.device) -> str:
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"RNG streams are supported on cpu and cuda devices, not {dev}")
    return dev.type


class RNGTracker:
    """Named RNG streams on one compute device, each kept as a saved generator state (a uint8 CPU tensor).
    ``fork(name)`` swaps a stream in as the default generator state of ``device`` for the body and saves the advanced
    state back; ``get_states``/``set_states`` move the states in and out."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device if device is not None else device_mod.default_device_type())
        self._key = _device_key(self.device)
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[int, str] = {}
        self._active: set[str] = set()

    def _get_default(self) -> torch.Tensor:
        return device_mod.rng_state(self.device)[self._key]

    def _set_default(self, state: torch.Tensor) -> None:
        states = {"cpu": torch.get_rng_state()}
        states[self._key] = state
        device_mod.set_rng_state(states, self.device)

    @property
    def names(self) -> tuple[str, ...]:
        """The stream names, in the order they were added."""
        return tuple(self._states)

    def __contains__(self, name: object) -> bool:
        return name in self._states

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` from ``seed``; names and seeds must be new (one seed would draw the same numbers)."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} exists already")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is used by RNG stream {self._seeds[seed]!r} already")
        self._states[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()
        self._seeds[seed] = name

    def reset(self) -> None:
        """Forget every stream and seed."""
        if self._active:
            raise RuntimeError(f"reset() inside fork({sorted(self._active)})")
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state: ``{name: uint8 tensor}``."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace every stream's state by ``states`` (as ``get_states`` returned them); ``add``'s seeds are kept."""
        bad = {name: state.dtype for name, state in states.items() if state.dtype != torch.uint8}
        if bad:
            raise TypeError(f"RNG states are uint8 tensors; got {bad}")
        self._states = {name: state.detach().cpu().clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str) -> Iterator[None]:
        """Draw from stream ``name`` inside the body instead of the default generator. Other streams and the default
        generator's state are untouched; forks of different streams nest. Raises inside a ``checkpoint`` that was
        given another tracker."""
        if name not in self._states:
            raise KeyError(f"no RNG stream {name!r} (have {list(self._states)}); call add() or init_rng() first")
        if name in self._active:
            raise RuntimeError(f"fork({name!r}) inside fork({name!r})")
        _check_checkpoint_scope(self, name)
        outer = self._get_default()
        self._set_default(self._states[name])
        self._active.add(name)
        try:
            yield
        finally:
            self._active.discard(name)
            self._states[name] = self._get_default()
            self._set_default(outer)

    def __repr__(self) -> str:
        return f"RNGTracker(device={self.device}, streams={list(self._states)})"


_DEFAULT_TRACKER: RNGTracker | None = None


def get_tracker() -> RNGTracker:
    """This process's default tracker (created on first use, on ``device.default_device_type()``)."""
    global _DEFAULT_TRACKER
    if _DEFAULT_TRACKER is None:
        _DEFAULT_TRACKER = RNGTracker()
    return _DEFAULT_TRACKER


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int) -> tuple[int, int]:
    """The ``(default, tp_different)`` seeds of the rank at ``(tp_rank, pp_rank)``: ``default = seed + 100·pp_rank``,
    ``tp_different = default + 2718 + tp_rank`` (DP and CP ranks share both; distinct for tp < 82)."""
    if tp_rank < 0 or pp_rank < 0:
        raise ValueError(f"ranks must be >= 0, got tp_rank={tp_rank}, pp_rank={pp_rank}")
    default = seed + PP_SEED_STRIDE * pp_rank
    return default, default + TP_DIFFERENT_OFFSET + TP_SEED_STRIDE * tp_rank


def init_rng(tracker: RNGTracker, seed: int, tp_rank: int, pp_rank: int) -> None:
    """Seed this rank: the default generators (CPU and every CUDA device) get the TP-same seed, ``tracker`` is reset to
    the single stream ``TP_DIFFERENT`` with the per-TP-rank seed (``model_parallel_seed``). Call it after building a
    model that draws its initial weights from the default generator, so layouts do not change the weights."""
    default, tp_different = model_parallel_seed(seed, tp_rank, pp_rank)
    device_mod.manual_seed_all(default)
    tracker.reset()
    tracker.add(TP_DIFFERENT, tp_different)


class _Scope(threading.local):
    """Per thread: the trackers of the running checkpoints, innermost last."""

    def __init__(self) -> None:
        self.stack: list[RNGTracker] = []


_SCOPE = _Scope()


@contextlib.contextmanager
def _checkpoint_scope(tracker: RNGTracker) -> Iterator[None]:
    """Mark ``tracker`` as the one whose forks the innermost running checkpoint replays."""
    _SCOPE.stack.append(tracker)
    try:
        yield
    finally:
        _SCOPE.stack.pop()


def _check_checkpoint_scope(tracker: RNGTracker, name: str) -> None:
    stack = _SCOPE.stack
    if stack and stack[-1] is not tracker:
        raise RuntimeError(f"fork({name!r}) of {tracker!r} inside checkpoint(..., tracker={stack[-1]!r}): its dropout "
                           "masks would not replay in the recomputation; pass this tracker to checkpoint()")


def _capture_rng(devices: tuple[torch.device, ...]) -> list[tuple[torch.device, dict[str, torch.Tensor]]]:
    return [(dev, device_mod.rng_state(dev)) for dev in devices]


def _restore_rng(states: list[tuple[torch.device, dict[str, torch.Tensor]]]) -> None:
    for dev, state in states:
        device_mod.set_rng_state(state, dev)


def _capture_autocast(devices: tuple[torch.device, ...]) -> dict[str, Any]:
    types = dict.fromkeys(["cpu", *(dev.type for dev in devices)])
    return {"cache": torch.is_autocast_cache_enabled(),
            "types": {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types}}


def _autocast_as(state: dict[str, Any]) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for dev_type, (enabled, dtype) in state["types"].items():
        stack.enter_context(torch.autocast(dev_type, dtype=dtype, enabled=enabled, cache_enabled=state["cache"]))
    return stack


class _Checkpoint(torch.autograd.Function):
    """Run ``fn`` without keeping its graph; in backward, rerun it from the saved RNG and autocast state and
    backpropagate through the rerun. ``anchor`` (an empty tensor requiring grad, when no argument does)
    makes the output reach backward, so the parameters used inside ``fn`` get their grads."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], tracker: RNGTracker, devices: tuple[torch.device, ...],
                anchor: torch.Tensor | None, *args: Any) -> Any:
        ctx.fn, ctx.tracker, ctx.devices = fn, tracker, devices
        ctx.rng = _capture_rng(devices)
        ctx.tracker_states = tracker.get_states()
        ctx.autocast = _capture_autocast(devices)
        ctx.tensor_index = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_index))
        ctx.set_materialize_grads(False)
        with _checkpoint_scope(tracker):
            out = fn(*args)
        ctx.single = torch.is_tensor(out)
        if not ctx.single and not (isinstance(out, tuple) and all(torch.is_tensor(o) for o in out)):
            raise TypeError(f"checkpoint: fn must return a tensor or a tuple of tensors, got {type(out).__name__}")
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint() supports Tensor.backward / torch.autograd.backward, "
                               "not torch.autograd.grad")
        needs_grad = ctx.needs_input_grad[4:]
        args = list(ctx.others)
        for i, saved in zip(ctx.tensor_index, ctx.saved_tensors):
            args[i] = saved.detach().requires_grad_(needs_grad[i])
        now_rng = _capture_rng(ctx.devices)
        now_tracker = ctx.tracker.get_states()
        _restore_rng(ctx.rng)
        ctx.tracker.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad(), _autocast_as(ctx.autocast), _checkpoint_scope(ctx.tracker):
                out = ctx.fn(*args)
        finally:
            _restore_rng(now_rng)
            ctx.tracker.set_states(now_tracker)
        outs = (out,) if ctx.single else out
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        arg_grads = [a.grad if need and torch.is_tensor(a) else None for a, need in zip(args, needs_grad)]
        return (None, None, None, None, *arg_grads)


def checkpoint(fn: Callable[..., Any], *args: Any, tracker: RNGTracker | None = None) -> Any:
    """``fn(*args)``, recomputed in backward (same dropout masks, same autocast state; the RNG states are
    restored afterwards) instead of keeping its activations. ``tracker`` defaults to ``get_tracker()``;
    keyword arguments go in with ``functools.partial``. Without grad mode this is plain ``fn(*args)``."""
    if not torch.is_grad_enabled():
        return fn(*args)
    tracker = tracker if tracker is not None else get_tracker()
    devices = tuple(dict.fromkeys([tracker.device, *(a.device for a in args
                                                    if torch.is_tensor(a) and a.device.type != "cpu")]))
    for dev in devices:
        _device_key(dev)
    anchor = None
    if not any(torch.is_tensor(a) and a.requires_grad for a in args):
        anchor = torch.empty(0, requires_grad=True)
    return _Checkpoint.apply(fn, tracker, devices, anchor, *args)
