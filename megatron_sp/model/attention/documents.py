"""Document-aligned attention: a masked block cut into full and causal pieces, run batched or packed.

Inside one document a run of consecutive query positions meets a run of consecutive key positions in at most
three exact pieces; ``plan`` finds them and groups them either as ``Group`` (pieces of equal bucketed length,
batched for a dense kernel, padding never changes a result) or as ``Packed`` (pieces end to end with
``cu_seqlens``, for a varlen kernel). ``forward``/``backward`` gather each group's rows, call ``run`` and merge
exactly. Work O(Σ dᵢ²), memory O(s). Details: docs/attention.md.
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

    @property
    def q_index(self) -> torch.Tensor:
        return self.q_rows.reshape(-1)

    @property
    def k_index(self) -> torch.Tensor:
        return self.k_rows.reshape(-1)


@dataclass(frozen=True)
class Packed:
    """Pieces end to end, for a varlen kernel: piece ``p`` holds query rows ``q_index[cu_q[p]:cu_q[p+1]]`` and key
    rows ``k_index[cu_k[p]:cu_k[p+1]]``; ``q_seq``/``q_offset`` give each query row's piece and place in it."""

    causal: bool
    q_index: torch.Tensor  # [Tq] int64
    k_index: torch.Tensor  # [Tk] int64
    cu_q: torch.Tensor  # [P + 1] int32
    cu_k: torch.Tensor  # [P + 1] int32
    max_q: int
    max_k: int
    q_seq: torch.Tensor  # [Tq] int64
    q_offset: torch.Tensor  # [Tq] int64


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


def _pieces(q_runs: list[tuple[int, int, int, int]], k_runs: list[tuple[int, int, int, int]],
            window: int | None = None) -> list[tuple[bool, int, int, int, int, int]]:
    """``(causal, q index, q length, k index, k length, occurrence)`` of the visible pieces of one row;
    ``occurrence`` numbers the pieces of one query run, so that a batch never holds a row twice. With a ``window``
    the query runs go in chunks of at most ``window`` positions: keys at or after a chunk's first position meet only
    the causal bound, older ones only the window's, ``j > p − window``, which is the causal bound of the mirrored
    positions ``−j`` and ``window − 1 − p``: those pieces run on rows taken backwards (an index ``~i`` < 0)."""
    by_doc: dict[int, list[tuple[int, int, int]]] = {}
    for d, kp, ki, kn in k_runs:
        by_doc.setdefault(d, []).append((kp, ki, kn))
    pieces: list[tuple[bool, int, int, int, int, int]] = []
    for d, qp, qi, qn in q_runs:
        keys = by_doc.get(d, [])
        if not window:
            pieces += _run_pieces(qp, qi, qn, keys, 0)
            continue
        for p0 in range(qp, qp + qn, window):
            c, i0 = min(window, qp + qn - p0), qi + p0 - qp
            recent = [(max(kp, p0), ki + max(0, p0 - kp), kp + kn - max(kp, p0)) for kp, ki, kn in keys if kp + kn > p0]
            older = [(1 - min(kp + kn, p0), ~(ki + min(kn, p0 - kp) - 1), min(kn, p0 - kp)) for kp, ki, kn in keys if kp < p0]
            mine = _run_pieces(p0, i0, c, recent, 0)
            pieces += mine + _run_pieces(window - p0 - c, ~(i0 + c - 1), c, older, len(mine))
    return pieces


def _run_pieces(qp: int, qi: int, qn: int, keys: list[tuple[int, int, int]],
                occurrence: int) -> list[tuple[bool, int, int, int, int, int]]:
    """The pieces of one query run (first position ``qp``, index ``qi``, length ``qn``) against its document's key
    runs ``(first position, index, length)`` under the causal bound, numbered from ``occurrence``."""
    pieces = []
    for kp, ki, kn in keys:
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


def _index(starts: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Index ``j`` of runs that start at ``starts``, going up, or down from ``i`` for a start ``~i`` < 0."""
    return torch.where(starts < 0, ~starts - j, starts + j)


def _rows(starts: list[int], lengths: list[int], width: int, b: int, bi: list[int], pad: int) -> torch.Tensor:
    """``[width, G]`` flat rows ``(start + j)·b + bi`` for ``j < length``, else ``pad``."""
    j = torch.arange(width)[:, None]
    rows = _index(torch.tensor(starts)[None, :], j) * b + torch.tensor(bi)[None, :]
    return torch.where(j < torch.tensor(lengths)[None, :], rows, pad)


def _spans(starts: list[int], lengths: list[int], b: int,
           bi: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flat rows ``(start + j)·b + bi`` of every span end to end, each row's span and place, and cu_seqlens."""
    length = torch.tensor(lengths)
    seq = torch.repeat_interleave(torch.arange(length.numel()), length)
    cu = torch.nn.functional.pad(length.cumsum(0), (1, 0))
    offset = torch.arange(seq.numel()) - cu[seq]
    return _index(torch.tensor(starts)[seq], offset) * b + torch.tensor(bi)[seq], seq, offset, cu.to(torch.int32)


def plan(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None, k_doc: torch.Tensor | None,
         packed: bool = False, device: torch.device | None = None, window: int | None = None) -> list[Group] | list[Packed]:
    """The pieces of a block, batched (``Group``) or ``packed`` (its tensors on ``device``, default the positions'):
    positions ``[b, sq]``/``[b, sk]``, documents the same or None, a sliding ``window`` or None. A group never holds
    a query row twice."""
    b, sq = q_pos.shape
    sk = k_pos.shape[1]
    shapes: dict[tuple[bool, int, int, int], list[tuple[int, int, int, int, int]]] = {}
    for bi in range(b):
        q_runs = _runs(q_pos[bi], None if q_doc is None else q_doc[bi])
        k_runs = _runs(k_pos[bi], None if k_doc is None else k_doc[bi])
        for causal, qi, qn, ki, kn, occ in _pieces(q_runs, k_runs, window):
            width = 0 if packed else bucket(qn)
            key = (causal, width, width if causal or packed else kn, occ)
            shapes.setdefault(key, []).append((bi, qi, qn, ki, kn))
    groups: list = []
    for (causal, lq, lk, _), pieces in sorted(shapes.items()):
        bi, qi, qn, ki, kn = (list(column) for column in zip(*pieces))
        if not packed:
            groups.append(Group(causal, _rows(qi, qn, lq, b, bi, sq * b), _rows(ki, kn, lk, b, bi, sk * b)))
            continue
        q_index, q_seq, q_offset, cu_q = _spans(qi, qn, b, bi)
        k_index, _, _, cu_k = _spans(ki, kn, b, bi)
        dev = device or q_pos.device
        groups.append(Packed(causal, q_index.to(dev), k_index.to(dev), cu_q.to(dev), cu_k.to(dev), max(qn), max(kn),
                             q_seq.to(dev), q_offset.to(dev)))
    return groups


def _flat(x: torch.Tensor, dtype: torch.dtype | None = None, fill: float = 0.0) -> torch.Tensor:
    """``[s, b, ...]`` → ``[s·b + 1, ...]``: one spare row (``fill``) for the pads."""
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    if dtype is not None:
        flat = flat.to(dtype)
    return torch.cat([flat, flat.new_full((1, *flat.shape[1:]), fill)])


Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "Group | Packed"], tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[Group] | list[Packed],
            dtype: torch.dtype, run: Forward) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [sq, b, n, d], lse [b, n, sq])`` in ``dtype``; rows that see nothing: 0 and −inf. ``run(q, k, v,
    group)`` gets the group's rows (``[R, n, d]``, ``[Rk, g, d]``) and returns ``(out [R, n, d], lse [R, n])``."""
    sq, b, n, d = q.shape
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    out = torch.zeros(sq * b + 1, n, d, dtype=dtype, device=q.device)
    lse = torch.full((sq * b + 1, n), float("-inf"), dtype=dtype, device=q.device)
    for group in groups:
        rows, k_rows = group.q_index, group.k_index
        o, m = run(qf[rows], kf[k_rows], vf[k_rows], group)
        old = lse[rows]
        new = torch.logaddexp(old, m)  # finite: every piece's rows see a key
        out[rows] = out[rows] * torch.exp(old - new)[..., None] + o * torch.exp(m - new)[..., None]
        lse[rows] = new
    return (out[:-1].view(sq, b, n, d),
            lse[:-1].view(sq, b, n).permute(1, 2, 0).contiguous())


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, groups: list[Group] | list[Packed], dtype: torch.dtype,
             run: Backward) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's ``(dq, dk, dv)`` from the final ``out``/``lse``, in ``dtype``; ``run(dout, q, k, v, out, lse,
    group)`` on the group's rows (lse ``[R, n]``) returns their gradients. A padded query row gets
    ``lse = BIG_LSE`` and zero ``dout``/``out``: its gradients are exactly 0."""
    sq, b, n, d = q.shape
    sk, _, g, _ = k.shape
    qf, kf, vf, of, dof = _flat(q), _flat(k), _flat(v), _flat(out, dtype), _flat(dout, dtype)
    lf = _flat(lse.permute(2, 0, 1), dtype, BIG_LSE)  # [sq·b + 1, n]
    dq = torch.zeros(sq * b + 1, n, d, dtype=dtype, device=q.device)
    dk = torch.zeros(sk * b + 1, g, d, dtype=dtype, device=k.device)
    dv = torch.zeros(sk * b + 1, g, d, dtype=dtype, device=k.device)
    for group in groups:
        qr, kr = group.q_index, group.k_index
        gq, gk, gv = run(dof[qr], qf[qr], kf[kr], vf[kr], of[qr], lf[qr], group)
        dq.index_add_(0, qr, gq.to(dtype))
        dk.index_add_(0, kr, gk.to(dtype))
        dv.index_add_(0, kr, gv.to(dtype))
    return dq[:-1].view(sq, b, n, d), dk[:-1].view(sk, b, g, d), dv[:-1].view(sk, b, g, d)


def batched(kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Forward:
    """A ``Group`` runner from a dense kernel ``(q [lq, G, n, d], k, v, causal) -> (out, lse [G, n, lq])``."""
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
        lq, lk = group.q_rows.shape[0], group.k_rows.shape[0]
        o, m = kernel(q.unflatten(0, (lq, -1)), k.unflatten(0, (lk, -1)), v.unflatten(0, (lk, -1)), group.causal)
        return o.flatten(0, 1), m.permute(2, 0, 1).flatten(0, 1)  # row order of q_index
    return run


def batched_backward(kernel: Backward) -> Backward:
    """A ``Group`` runner from a dense backward ``(dout, q, k, v, out, lse [G, n, lq], causal) -> (dq, dk, dv)``."""
    def run(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lq, lk = group.q_rows.shape[0], group.k_rows.shape[0]
        grads = kernel(*(x.unflatten(0, (lq, -1)) for x in (dout, q)), *(x.unflatten(0, (lk, -1)) for x in (k, v)),
                       out.unflatten(0, (lq, -1)), lse.unflatten(0, (lq, -1)).permute(1, 2, 0), group.causal)
        return tuple(x.flatten(0, 1) for x in grads)  # type: ignore[return-value]
    return run
