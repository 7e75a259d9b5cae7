"""Sliding-window attention (``model.sliding_window``) in the kernels, against an fp64 oracle with an explicit mask.

The oracle is plain masked softmax with autograd: key j is seen by query i iff ``i - W < j <= i`` (transformers'
Mistral: the query and W - 1 keys before it) and, with packed documents, both are in one document. The blocks are
those the CP algorithms hand the kernels (a whole sequence, zigzag chunk pairs, blocks beyond the window), run on
the auto kernel (document-aligned pieces on the CPU flash op, the older keys on mirrored rows) and on the reference.
Also the KV-cache decode (``cached_attention``) and the cp = 1 path with a window (``AttentionMeta`` local).
"""
from __future__ import annotations

import pytest
import torch

from megatron_sp.model.attention import band, documents, kernels
from megatron_sp.model.attention.context_parallel import AttentionMeta, context_parallel_attention
from megatron_sp.mpu import comm

D = 8


def _oracle(q, k, v, dout, q_pos, k_pos, q_doc, k_doc, window):
    q, k, v = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] > q_pos[:, :, None] - window)
    if q_doc is not None:
        mask &= q_doc[:, :, None] == k_doc[:, None, :]
    r = q.shape[2] // k.shape[2]
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k.repeat_interleave(r, 2)) * D ** -0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0)[..., None])  # rows seeing nothing: 0
    out = torch.einsum("bnqk,kbnd->qbnd", probs, v.repeat_interleave(r, 2))
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got))
    scale = ref[finite].abs().max() if finite.any() else 1.0
    return float((got.detach().double()[finite] - ref[finite]).abs().max() / (scale if scale > 0 else 1.0)) if finite.any() else 0.0


def _docs(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths])


S = 40
POS = torch.arange(S).repeat(2, 1)
ZIG_Q = torch.tensor([list(range(10, 20)) + list(range(20, 30))] * 2)  # zigzag-like: two chunks of one rank
BLOCKS = {  # name: (q_pos, k_pos, q_doc, k_doc, window, kind)
    "whole": (POS, POS, None, None, 7, "masked"),
    "whole_w1": (POS, POS, None, None, 1, "masked"),  # each token sees itself only
    "whole_docs": (POS, POS, _docs([[5, 17, 18], [13, 1, 26]]), _docs([[5, 17, 18], [13, 1, 26]]), 6, "masked"),
    "causal_inside": (POS[:, :6], POS[:, :6], None, None, 6, "causal"),  # the window cuts nothing
    "full_inside": (POS[:, 20:24], POS[:, 14:20], None, None, 10, "full"),
    "edge": (POS[:, 20:30], POS[:, 10:20], None, None, 8, "masked"),  # the older keys, cut by the window only
    "beyond": (POS[:, 30:40], POS[:, 0:10], None, None, 21, "empty"),  # wholly outside the window: skipped
    "zigzag_pair": (ZIG_Q, torch.tensor([list(range(0, 10)) + list(range(30, 40))] * 2), None, None, 9, "masked"),
    "gappy": (torch.tensor([[3, 4, 9, 12, 13, 30]] * 2), torch.tensor([[0, 2, 3, 8, 12, 29]] * 2), None, None, 5,
              "masked"),
}


@pytest.mark.parametrize("kernel", [None, "reference"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_window_block_matches_oracle(name: str, kernel: str | None) -> None:
    q_pos, k_pos, q_doc, k_doc, window, kind = BLOCKS[name]
    assert kernels.classify(q_pos, k_pos, q_doc, k_doc, window) == kind
    gen = torch.Generator().manual_seed(len(name))
    q, dout = (torch.randn(q_pos.shape[1], 2, 4, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(k_pos.shape[1], 2, 2, D, generator=gen, dtype=torch.float64) for _ in range(2))
    ids = (q_pos, k_pos, q_doc, k_doc)
    out, lse = kernels.attention_forward(q, k, v, *ids, window=window, kernel=kernel)
    grads = kernels.attention_backward(dout, q, k, v, out, lse, *ids, window=window, kernel=kernel)
    want = _oracle(q, k, v, dout, *ids, window)
    for got, ref in zip((out, lse, *grads), want):
        assert _rel(got, ref) <= 1e-12


def test_window_pieces_cover_the_band_once() -> None:
    """The plan's pieces (causal ones on mirrored rows included) hold each visible pair exactly once and no other."""
    q_pos, k_pos, q_doc, k_doc, window, _ = BLOCKS["whole_docs"]
    seen = torch.zeros(2, S, S, dtype=torch.long)
    for group in documents.plan(q_pos, k_pos, q_doc, k_doc, window=window):
        for qr, kr in zip(group.q_rows.t(), group.k_rows.t()):
            real_q, real_k = qr[qr < S * 2], kr[kr < S * 2]
            pairs = torch.ones(len(real_q), len(real_k), dtype=torch.bool)
            if group.causal:
                pairs = pairs.tril()
            for i, j in pairs.nonzero().tolist():
                seen[real_q[i] % 2, real_q[i] // 2, real_k[j] // 2] += 1
    assert torch.equal(seen, kernels.visible(q_pos, k_pos, q_doc, k_doc, window).long())


def test_cp1_window_and_bf16() -> None:
    """The cp = 1 path (``AttentionMeta`` local, the layer's route for a window) in fp64 and bf16, GQA."""
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(S, 2, 4, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(S, 2, 1, D, generator=gen, dtype=torch.float64) for _ in range(2))
    want = _oracle(q, k, v, dout, POS, POS, None, None, 11)
    for dtype, bound in ((torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
        meta = AttentionMeta.build(POS, None, "ring", comm.LOCAL, window=11)
        out = context_parallel_attention(*leaves, meta)
        out.backward(dout.to(dtype))
        ref = _oracle(*(x.to(dtype) for x in (q, k, v, dout)), POS, POS, None, None, 11) if dtype != torch.float64 else want
        for got, r in zip((out, *(x.grad for x in leaves)), (ref[0], *ref[2:])):
            assert _rel(got, r) <= bound, dtype



def test_self_blocks_run_as_contiguous_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block whose queries are its keys (consecutive positions, one document per row) takes ``band`` (views of
    chunks, no row gathers or scatters), and only such blocks; exactness: the ``whole*`` blocks above."""
    chosen = {name: isinstance(kernels._plan(torch.zeros(1), *BLOCKS[name][:4], False, None, BLOCKS[name][4]), band.Band)
              for name in ("whole", "whole_w1", "whole_docs", "edge", "zigzag_pair", "gappy")}
    assert chosen == {"whole": True, "whole_w1": True, "whole_docs": False, "edge": False, "zigzag_pair": False,
                      "gappy": False}
    one_doc = torch.tensor([[4] * S, [9] * S])
    assert band.plan(POS, POS, one_doc, one_doc, 7) == band.Band(7)
    monkeypatch.setattr(documents, "forward", None)  # the piece path would fail
    monkeypatch.setattr(documents, "backward", None)
    x = torch.randn(S, 2, 2, D, dtype=torch.float64)
    out, lse = kernels.attention_forward(x, x, x, POS, POS, window=7)
    kernels.attention_backward(x, x, x, x, out, lse, POS, POS, window=7)


@pytest.mark.parametrize("pad", [False, True])
def test_cached_attention_respects_window(pad: bool) -> None:
    """Prefill then one-token decodes with a window: equal to the oracle's rows (left padding: keys before it unseen)."""
    gen = torch.Generator().manual_seed(5)
    total, window = 14, 4
    q, k, v = (torch.randn(total, 2, h, D, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    pads = torch.tensor([0, 3]) if pad else None
    pos = torch.arange(total).repeat(2, 1)
    doc = (pos >= pads[:, None]).long() if pad else None  # padding keys: another document
    want = _oracle(q, k, v, torch.zeros_like(q), pos, pos, doc, doc, window)[0]
    got = [kernels.cached_attention(q[:9], k[:9], v[:9], pad=pads, window=window)]
    got += [kernels.cached_attention(q[i:i + 1], k[:i + 1], v[:i + 1], pad=pads, window=window) for i in range(9, total)]
    got = torch.cat(got)
    rows = slice(3, None) if pad else slice(None)  # a padding query sees itself only; the oracle's document agrees
    assert _rel(got[rows], want[rows]) <= 1e-12
