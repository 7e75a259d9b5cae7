"""RNGTracker streams, seeds, and activation checkpointing that replays dropout bit for bit (one process)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_sp.mpu.random import (
    TP_DIFFERENT,
    RNGTracker,
    checkpoint,
    get_tracker,
    init_rng,
    model_parallel_seed,
)

EXACT = {"rtol": 0.0, "atol": 0.0}  # recomputation must replay the forward bit for bit
P = 0.4  # dropout probability


def _exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, **EXACT, msg=lambda m: f"{what}: {m}")


def _states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- tracker


def test_fork_draws_from_its_stream_and_advances_only_it():
    tracker = RNGTracker("cpu")
    tracker.add("a", 11)
    tracker.add("b", 22)
    torch.manual_seed(5)
    default_before = torch.get_rng_state()
    b_before = tracker.get_states()["b"]
    ref_a = torch.Generator().manual_seed(11)

    with tracker.fork("a"):
        first = torch.rand(7)
    _exact(first, torch.rand(7, generator=ref_a), "first draw of stream a")
    assert torch.equal(torch.get_rng_state(), default_before), "fork changed the default generator"
    assert torch.equal(tracker.get_states()["b"], b_before), "fork('a') changed stream b"

    with tracker.fork("a"):  # continues where it stopped
        second = torch.rand(7)
    _exact(second, torch.rand(7, generator=ref_a), "second draw of stream a")

    with tracker.fork("b"):
        from_b = torch.rand(7)
    _exact(from_b, torch.rand(7, generator=torch.Generator().manual_seed(22)), "stream b")
    _exact(torch.rand(7), torch.rand(7, generator=torch.Generator().manual_seed(5)), "default stream after forks")


def test_fork_nesting_errors_and_exceptions():
    tracker = RNGTracker("cpu")
    tracker.add("a", 1)
    tracker.add("b", 2)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        with tracker.fork("b"):
            inner = torch.rand(3)
        outer = torch.rand(3)
        with pytest.raises(RuntimeError, match="inside fork"), tracker.fork("a"):
            pass
    _exact(inner, torch.rand(3, generator=torch.Generator().manual_seed(2)), "nested fork b")
    _exact(outer, torch.rand(3, generator=torch.Generator().manual_seed(1)), "outer fork a after nested b")
    assert torch.equal(torch.get_rng_state(), before)

    with pytest.raises(ValueError, match="boom"), tracker.fork("a"):
        torch.rand(4)
        raise ValueError("boom")
    assert torch.equal(torch.get_rng_state(), before), "default state not restored after an exception"
    ref = torch.Generator().manual_seed(1)
    torch.rand(3, generator=ref)
    torch.rand(4, generator=ref)
    with tracker.fork("a"):  # the draws made before the exception count
        _exact(torch.rand(2), torch.rand(2, generator=ref), "stream a after an exception")

    with pytest.raises(KeyError, match="no RNG stream"), tracker.fork("missing"):
        pass
    with pytest.raises(ValueError, match="exists already"):
        tracker.add("a", 99)
    with pytest.raises(ValueError, match="seed 2"):
        tracker.add("c", 2)
    with tracker.fork("a"), pytest.raises(RuntimeError, match="reset"):
        tracker.reset()
    tracker.reset()
    assert tracker.names == ()
    tracker.add("a", 2)  # the seed is free again
    with pytest.raises(ValueError, match="cpu and cuda"):
        RNGTracker("meta")


def test_get_set_states_round_trip():
    tracker = RNGTracker("cpu")
    tracker.add(TP_DIFFERENT, 7)
    tracker.add("other", 8)
    with tracker.fork(TP_DIFFERENT):
        torch.rand(5)  # not at the seed's first state any more
    saved = tracker.get_states()
    assert set(saved) == {TP_DIFFERENT, "other"} and all(s.dtype == torch.uint8 for s in saved.values())
    with tracker.fork(TP_DIFFERENT):
        first = torch.rand(9)
    assert not _states_equal(tracker.get_states(), saved), "fork did not advance the stream"
    copy = tracker.get_states()
    copy[TP_DIFFERENT].zero_()  # get_states hands out copies ...
    assert tracker.get_states()[TP_DIFFERENT].any()
    tracker.set_states(saved)
    saved[TP_DIFFERENT].zero_()  # ... and set_states keeps its own
    with tracker.fork(TP_DIFFERENT):
        _exact(torch.rand(9), first, "draws after set_states(saved)")
    restored = RNGTracker("cpu")
    restored.set_states({"x": tracker_state_after(7, 5)})
    with restored.fork("x"):
        _exact(torch.rand(9), first, "a new tracker loaded with a saved state replays the draws")
    with pytest.raises(TypeError, match="uint8"):
        restored.set_states({"x": torch.zeros(3)})


def tracker_state_after(seed: int, draws: int) -> torch.Tensor:
    """The CPU generator state of ``seed`` after ``draws`` float draws."""
    g = torch.Generator().manual_seed(seed)
    torch.rand(draws, generator=g)
    return g.get_state()


def test_model_parallel_seed_and_init_rng():
    seeds = {(t, p): model_parallel_seed(1234, t, p) for t in range(64) for p in range(32)}
    for (t, p), (default, tp_diff) in seeds.items():
        assert default == seeds[(0, p)][0], "default seed must be the same on every TP rank of a stage"
        assert default == 1234 + 100 * p and tp_diff == 1234 + 100 * p + 2718 + t
    flat = [s for pair in seeds.values() for s in pair]
    defaults = {pair[0] for pair in seeds.values()}
    assert len(set(flat)) == len(seeds) + len(defaults), "two streams share a seed"
    with pytest.raises(ValueError):
        model_parallel_seed(0, -1, 0)

    tracker = RNGTracker("cpu")
    tracker.add("stale", 5)
    init_rng(tracker, 1234, tp_rank=3, pp_rank=2)
    assert tracker.names == (TP_DIFFERENT,)
    _exact(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(1434)), "default stream")
    with tracker.fork(TP_DIFFERENT):
        _exact(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(1434 + 2718 + 3)), "tp-different")
    assert get_tracker() is get_tracker()


# ---------------------------------------------------------------------------------------------- checkpoint

H = 16


class Block(nn.Module):
    """linear → dropout (default stream) → gelu → [dropout in a tracker fork] → linear."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = nn.Linear(H, 2 * H)
        self.fc2 = nn.Linear(2 * H, H)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.calls = 0

    def forward(self, x: torch.Tensor, scale: float, tracker: RNGTracker | None, bias: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = F.dropout(self.fc1(x), P, True)  # [s, b, 2h]
        h = F.gelu(h) * scale
        if tracker is not None:
            with tracker.fork(TP_DIFFERENT):
                h = F.dropout(h, P, True)
        out = self.fc2(h)  # [s, b, h]
        return out + bias.to(out.dtype)


def _call(block: Block, x: torch.Tensor, scale: float, bias: torch.Tensor, tracker: RNGTracker | None
          ) -> torch.Tensor:
    return block(x, scale, tracker, bias)


def _rng_snapshot(tracker: RNGTracker) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return torch.get_rng_state(), tracker.get_states()


def _rng_restore(snap: tuple[torch.Tensor, dict[str, torch.Tensor]], tracker: RNGTracker) -> None:
    torch.set_rng_state(snap[0])
    tracker.set_states(snap[1])


def _run(blocks: list[Block], x0: torch.Tensor, bias: torch.Tensor, g: torch.Tensor, tracker: RNGTracker,
         use_fork: bool, ckpt: bool, autocast: bool) -> dict[str, object]:
    """Two blocks in a row, forward + backward; between them the default stream is advanced."""
    for b in blocks:
        b.zero_grad(set_to_none=True)
    x = x0.detach().clone().requires_grad_(True)
    fork_tracker = tracker if use_fork else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = x
        for b in blocks:
            if ckpt:  # a grad-requiring tensor, a float and a tensor without grad go through checkpoint
                y = checkpoint(functools.partial(_call, b, tracker=fork_tracker), y, 1.5, bias, tracker=tracker)
            else:
                y = b(y, 1.5, fork_tracker, bias)
            torch.rand(3)  # other randomness between the blocks
    after_forward = _rng_snapshot(tracker)
    torch.rand(5)  # and between forward and backward
    before_backward = _rng_snapshot(tracker)
    y.float().backward(g)
    after_backward = _rng_snapshot(tracker)
    return {"y": y.detach(), "grad x": x.grad,
            "grads": {f"{i}.{n}": p.grad for i, b in enumerate(blocks) for n, p in b.named_parameters()},
            "after forward": after_forward, "before backward": before_backward, "after backward": after_backward,
            "calls": [b.calls for b in blocks]}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("use_fork", [False, True], ids=["default-stream", "with-fork"])
def test_checkpoint_replays_dropout_exactly(use_fork: bool, autocast: bool):
    tracker = RNGTracker("cpu")
    tracker.add(TP_DIFFERENT, 99)
    torch.manual_seed(0)
    blocks = [Block(1), Block(2)]
    x0 = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(H, generator=torch.Generator().manual_seed(4))  # a tensor argument without grad
    g = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(5))
    start = _rng_snapshot(tracker)

    ref = _run(blocks, x0, bias, g, tracker, use_fork, ckpt=False, autocast=autocast)
    _rng_restore(start, tracker)
    got = _run(blocks, x0, bias, g, tracker, use_fork, ckpt=True, autocast=autocast)

    assert ref["calls"] == [1, 1] and got["calls"] == [3, 3], "checkpoint must run each block twice"
    want_dtype = torch.bfloat16 if autocast else torch.float32
    assert got["y"].dtype == want_dtype == ref["y"].dtype
    _exact(got["y"], ref["y"], "output")
    _exact(got["grad x"], ref["grad x"], "input grad")
    assert got["grads"].keys() == ref["grads"].keys()
    for name, want in ref["grads"].items():
        assert want is not None and want.dtype == torch.float32
        _exact(got["grads"][name], want, f"grad of {name}")
    for when in ("after forward", "after backward"):
        _exact(got[when][0], ref[when][0], f"CPU RNG state {when}")
        assert _states_equal(got[when][1], ref[when][1]), f"tracker states {when}"
    _exact(got["after backward"][0], got["before backward"][0], "backward changed the CPU RNG state")
    assert _states_equal(got["after backward"][1], got["before backward"][1]), "backward changed the tracker"
    if use_fork:
        assert not _states_equal(got["after forward"][1], start[1]), "the fork inside the block was not used"

    # the test can tell masks apart: another RNG state gives another output
    torch.manual_seed(1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        other = blocks[0](x0, 1.5, tracker if use_fork else None, bias)
    with torch.no_grad():
        _rng_restore(start, tracker)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            same = blocks[0](x0, 1.5, tracker if use_fork else None, bias)
    assert (other.float() - same.float()).abs().max().item() > 1e-3


def test_checkpoint_without_grad_inputs_still_gives_weight_grads():
    tracker = RNGTracker("cpu")
    tracker.add(TP_DIFFERENT, 1)
    block = Block(7)
    x = torch.randn(4, 2, H, generator=torch.Generator().manual_seed(8))  # requires no grad
    bias = torch.zeros(H)
    torch.manual_seed(2)
    start = _rng_snapshot(tracker)
    block(x, 1.0, tracker, bias).square().sum().backward()
    want = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    _rng_restore(start, tracker)
    y = checkpoint(lambda z: block(z, 1.0, tracker, bias), x, tracker=tracker)
    assert y.requires_grad
    y.square().sum().backward()
    for name, p in block.named_parameters():
        _exact(p.grad, want[name], f"grad of {name}")


def test_checkpoint_saves_only_its_inputs():
    """Bytes saved for backward (saved_tensors_hooks): the input only, versus every activation without it."""
    tracker = RNGTracker("cpu")
    tracker.add(TP_DIFFERENT, 1)
    block = Block(9)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    bias = torch.zeros(H)

    def saved_bytes(ckpt: bool) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and t.numel() > 0:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(8, 2, H, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn = (lambda z: checkpoint(lambda u: block(u, 1.0, tracker, bias), z, tracker=tracker)) if ckpt \
                else (lambda z: block(z, 1.0, tracker, bias))
            fn(x)
        return sum(seen.values())

    x_bytes = 8 * 2 * H * 4
    assert saved_bytes(True) == x_bytes  # bias is closed over, not an argument
    assert saved_bytes(False) >= 4 * x_bytes


def test_checkpoint_guards():
    tracker = RNGTracker("cpu")
    tracker.add(TP_DIFFERENT, 1)
    other = RNGTracker("cpu")
    other.add(TP_DIFFERENT, 2)
    block = Block(3)
    x = torch.randn(2, 1, H, requires_grad=True)
    with pytest.raises(RuntimeError, match="pass this tracker to checkpoint"):
        checkpoint(lambda z: block(z, 1.0, other, torch.zeros(H)), x, tracker=tracker)

    y = checkpoint(lambda z: block(z, 1.0, tracker, torch.zeros(H)), x, tracker=tracker)
    with pytest.raises(RuntimeError, match="torch.autograd.grad"):
        torch.autograd.grad(y.sum(), x)

    with pytest.raises(TypeError, match="tuple of tensors"):
        checkpoint(lambda z: [z * 2], x, tracker=tracker)

    pair = checkpoint(lambda z, k: (z * k, z.sin()), x, 3.0, tracker=tracker)  # tuple outputs, a non-tensor arg
    (pair[0].sum() + pair[1].sum()).backward()
    _exact(x.grad, 3.0 + x.detach().cos(), "grad through a tuple output")

    calls = block.calls
    with torch.no_grad():
        out = checkpoint(lambda z: block(z, 1.0, tracker, torch.zeros(H)), x, tracker=tracker)
    assert out.grad_fn is None and block.calls == calls + 1, "no grad mode: a plain call"
