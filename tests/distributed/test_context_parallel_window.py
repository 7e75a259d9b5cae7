"""Context-parallel attention with a sliding window (``AttentionMeta.window``) against the fp64 oracle, cp 2 and 4.

One launch runs ring, zigzag, llama3, ulysses and usp (and zigzag over packed documents sharded per document) with
window 5 over S = 24 tokens (GQA, fp64), one causal document and packed documents; the test process puts the shards
back together (``tests/distributed/test_context_parallel.py``'s layout helpers) and compares out, lse and the q/k/v
gradients with masked softmax attention over the whole sequence (``i - 5 < j <= i``, same document) within 1e-10.
Also counted: zigzag hands the kernels fewer query-key pairs with the window than without (a chunk pair wholly
outside it is skipped; at cp = 2 the contiguous ring has none: its one other block borders its own).
"""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_sp.model.attention import kernels
from megatron_sp.model.attention.context_parallel import AttentionMeta, attention_with_lse
from megatron_sp.testing import run_distributed

WINDOW = 5
CASES = [(name, algo, stride, docs) for name, algo, stride in
         (("ring", "ring", 1), ("zigzag", "zigzag", 1), ("llama3_s1", "llama3", 1), ("ulysses", "ulysses", 1),
          ("usp_u2", "usp", 2)) for docs in ("causal", "packed")] + [("zigzag_docs1", "zigzag", 1, "packed")]


def _run(name: str, algo: str, stride: int, docs: str, rank: int, window: int | None) -> dict[str, torch.Tensor]:
    from tests.distributed.test_context_parallel import _indices, _inputs, _take, _usp_groups
    q, k, v, dout, pos, doc = _inputs("gqa", docs, "fp64")
    cp = dist.get_world_size()
    index = _indices(name, doc, cp, q.shape[0])[rank]
    ql, kl, vl = (_take(x, index, 0).requires_grad_(True) for x in (q, k, v))
    sub = _usp_groups(cp, rank, stride) if algo == "usp" else (None, None)
    meta = AttentionMeta.build(_take(pos, index, 1), None if doc is None else _take(doc, index, 1), algo,
                               dist.group.WORLD, heads_k_stride=stride, ulysses_group=sub[0], ring_group=sub[1],
                               window=window)
    out, lse = attention_with_lse(ql, kl, vl, meta)
    out.backward(_take(dout, index, 0))
    return {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def _pairs(algo: str, rank: int, window: int | None) -> int:
    """Query-key pairs the kernels compute for one causal document (forward + backward)."""
    count = [0]
    saved = kernels.attention_forward, kernels.attention_backward

    def counting(fn: Any, backward: bool) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            q, k = (args[1], args[2]) if backward else (args[0], args[1])
            count[0] += q.shape[0] * k.shape[0]
            return fn(*args, **kwargs)
        return wrapped
    kernels.attention_forward, kernels.attention_backward = counting(saved[0], False), counting(saved[1], True)
    try:
        _run(algo, algo, 1, "causal", rank, window)
    finally:
        kernels.attention_forward, kernels.attention_backward = saved
    return count[0]


def _rank(rank: int, world: int) -> dict[str, Any]:
    return {"results": [_run(name, algo, stride, docs, rank, WINDOW) for name, algo, stride, docs in CASES],
            "pairs": {algo: (_pairs(algo, rank, None), _pairs(algo, rank, WINDOW)) for algo in ("zigzag",)}}


@functools.cache
def _launch(cp: int) -> list[dict[str, Any]]:
    return run_distributed(_rank, cp)


@pytest.mark.parametrize("cp", [2, 4])
def test_window_matches_full_sequence_oracle(cp: int) -> None:
    from tests.distributed.test_context_parallel import _indices, _inputs, _put_back
    from tests.unit.test_attention_window import _oracle
    per_rank = _launch(cp)
    bad = []
    for i, (name, _, _, docs) in enumerate(CASES):
        q, k, v, dout, pos, doc = _inputs("gqa", docs, "fp64")
        ref = dict(zip(("out", "lse", "dq", "dk", "dv"), _oracle(q, k, v, dout, pos, pos, doc, doc, WINDOW)))
        index = _indices(name, doc, cp, q.shape[0])
        for t, want in ref.items():
            got = _put_back([r["results"][i][t] for r in per_rank], index, 2 if t == "lse" else 0)
            error = float((got - want).abs().max() / want.abs().max())
            if not error <= 1e-10:
                bad.append(f"{name} {docs} {t}: {error:.1e}")
    assert not bad, "\n".join(bad)


def test_window_skips_blocks_outside_it() -> None:
    for r in _launch(2):
        for algo, (full, windowed) in r["pairs"].items():
            assert windowed < full, (algo, full, windowed)
