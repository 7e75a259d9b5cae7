"""Document-aligned attention: a masked block cut into full and causal sub-blocks, batched by length.

Inside one document a run of consecutive query positions meets a run of consecutive key positions in at most
three exact pieces; ``plan`` finds them, ``forward``/``backward`` batch pieces of equal (bucketed) length into
one fused kernel call with log-sum-exp (``run``: ``(q, k, v, causal) -> (out, lse)``) and merge exactly. Work
O(Σ dᵢ²), memory O(s); padding never changes a result. Details: docs/attention.md.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

BIG_LSE = 1e30
"""The lse given to padded query rows in backward: their probabilities are exactly 0."""


@dataclass(frozen=True)
class Group:
    """Pieces of one shape, batched: row indices into the flattened ``[s·b]`` tokens (pads: ``s·b``)."""

    causal: bool
    q_rows: torch.Tensor  # [lq, G] int64
    k_rows: torch.Tensor  # [lk, G] int64


def bucket(n: int) -> int:
    """``n`` rounded up to one of 8 lengths per octave above 16 (at most 1/8 padding)."""
    if n <= 8:
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def _runs(pos: torch.Tensor, doc: torch.Tensor | None) -> list[tuple[int, int, int, int]]:
    """``(document, first position, first index, length)`` of each run of consecutive positions in one document
    (one row: ``pos``/``doc`` ``[s]``); Python work is per run, not per token."""
    starts = torch.ones(pos.shape[0], dtype=torch.bool, device=pos.device)
    starts[1:] = pos[1:] != pos[:-1] + 1
    if doc is not None:
        starts[1:] |= doc[1:] != doc[:-1]
    first = starts.nonzero().flatten()
    lengths = torch.diff(first, append=first.new_tensor([pos.shape[0]]))
    docs = doc[first].tolist() if doc is not None else [0] * first.numel()
    return list(zip(docs, pos[first].tolist(), first.tolist(), lengths.tolist()))


def _pieces(q_runs: list[tuple[int, int, int, int]],
            k_runs: list[tuple[int, int, int, int]]) -> list[tuple[bool, int, int, int, int, int]]:
    """``(causal, q index, q length, k index, k length, occurrence)`` of the visible pieces of one row;
    ``occurrence`` numbers the pieces of one query run, so that a batch never holds a row twice."""
    by_doc: dict[int, list[tuple[int, int, int]]] = {}
    for d, kp, ki, kn in k_runs:
        by_doc.setdefault(d, []).append((kp, ki, kn))
    pieces = []
    for d, qp, qi, qn in q_runs:
        occurrence = 0
        for kp, ki, kn in by_doc.get(d, ()):
            before = min(kn, max(0, qp - kp))  # keys before the first query: every query sees them
            if before:
                pieces.append((False, qi, qn, ki, before, occurrence))
                occurrence += 1
            offset = kp + before - qp  # queries before the remaining keys see none of them
            shared = min(kn - before, qn - offset)  # keys after the last query are seen by nobody
            if shared <= 0:
                continue
            pieces.append((True, qi + offset, shared, ki + before, shared, occurrence))
            occurrence += 1
            if qn - offset - shared > 0:  # queries after the last key see all of the shared keys
                pieces.append((False, qi + offset + shared, qn - offset - shared, ki + before, shared, occurrence))
                occurrence += 1
    return pieces


def _rows(starts: list[int], lengths: list[int], width: int, b: int, bi: list[int], pad: int) -> torch.Tensor:
    """``[width, G]`` flat rows ``(start + j)·b + bi`` for ``j < length``, else ``pad``."""
    j = torch.arange(width)[:, None]
    start = torch.tensor(starts)[None, :]
    rows = (start + j) * b + torch.tensor(bi)[None, :]
    return torch.where(j < torch.tensor(lengths)[None, :], rows, pad)


def plan(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None,
         k_doc: torch.Tensor | None) -> list[Group]:
    """The batched pieces of a block: positions ``[b, sq]``/``[b, sk]``, documents the same or None."""
    b, sq = q_pos.shape
    sk = k_pos.shape[1]
    shapes: dict[tuple[bool, int, int, int], list[tuple[int, int, int, int, int]]] = {}
    for bi in range(b):
        q_runs = _runs(q_pos[bi], None if q_doc is None else q_doc[bi])
        k_runs = _runs(k_pos[bi], None if k_doc is None else k_doc[bi])
        for causal, qi, qn, ki, kn, occ in _pieces(q_runs, k_runs):
            width = bucket(qn)
            key = (causal, width, width if causal else kn, occ)
            shapes.setdefault(key, []).append((bi, qi, qn, ki, kn))
    groups = []
    for (causal, lq, lk, _), pieces in sorted(shapes.items()):
        bi, qi, qn, ki, kn = (list(column) for column in zip(*pieces))
        groups.append(Group(causal, _rows(qi, qn, lq, b, bi, sq * b), _rows(ki, kn, lk, b, bi, sk * b)))
    return groups


def _flat(x: torch.Tensor, dtype: torch.dtype | None = None, fill: float = 0.0) -> torch.Tensor:
    """``[s, b, ...]`` → ``[s·b + 1, ...]``: one spare row (``fill``) for the pads."""
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    if dtype is not None:
        flat = flat.to(dtype)
    return torch.cat([flat, flat.new_full((1, *flat.shape[1:]), fill)])


Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[Group], dtype: torch.dtype,
            run: Forward) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [sq, b, n, d], lse [b, n, sq])`` in ``dtype``; rows that see nothing: 0 and −inf."""
    sq, b, n, d = q.shape
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    out = torch.zeros(sq * b + 1, n, d, dtype=dtype, device=q.device)
    lse = torch.full((sq * b + 1, n), float("-inf"), dtype=dtype, device=q.device)
    for group in groups:
        o, m = run(qf[group.q_rows], kf[group.k_rows], vf[group.k_rows], group.causal)  # [lq, G, n, d], [G, n, lq]
        rows = group.q_rows.reshape(-1)
        o, m = o.reshape(-1, n, d), m.permute(2, 0, 1).reshape(-1, n)  # row order of q_rows: [lq·G, ...]
        old = lse[rows]
        new = torch.logaddexp(old, m)  # finite: every piece's rows see a key
        out[rows] = out[rows] * torch.exp(old - new)[..., None] + o * torch.exp(m - new)[..., None]
        lse[rows] = new
    return (out[:-1].view(sq, b, n, d),
            lse[:-1].view(sq, b, n).permute(1, 2, 0).contiguous())


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, groups: list[Group], dtype: torch.dtype,
             run: Backward) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's ``(dq, dk, dv)`` from the final ``out``/``lse``, in ``dtype``; ``run(dout, q, k, v, out, lse,
    causal)``. A padded query row gets ``lse = BIG_LSE`` and zero ``dout``/``out``: its gradients are exactly 0."""
    sq, b, n, d = q.shape
    sk, _, g, _ = k.shape
    qf, kf, vf, of, dof = _flat(q), _flat(k), _flat(v), _flat(out, dtype), _flat(dout, dtype)
    lf = _flat(lse.permute(2, 0, 1), dtype, BIG_LSE)  # [sq·b + 1, n]
    dq = torch.zeros(sq * b + 1, n, d, dtype=dtype, device=q.device)
    dk = torch.zeros(sk * b + 1, g, d, dtype=dtype, device=k.device)
    dv = torch.zeros(sk * b + 1, g, d, dtype=dtype, device=k.device)
    for group in groups:
        qr, kr = group.q_rows, group.k_rows
        gq, gk, gv = run(dof[qr], qf[qr], kf[kr], vf[kr], of[qr], lf[qr].permute(1, 2, 0), group.causal)
        dq.index_add_(0, qr.reshape(-1), gq.reshape(-1, n, d))
        dk.index_add_(0, kr.reshape(-1), gk.reshape(-1, g, d))
        dv.index_add_(0, kr.reshape(-1), gv.reshape(-1, g, d))
    return dq[:-1].view(sq, b, n, d), dk[:-1].view(sk, b, g, d), dv[:-1].view(sk, b, g, d)
