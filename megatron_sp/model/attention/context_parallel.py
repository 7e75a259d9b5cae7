"""Context-parallel attention: ring, zigzag, llama3 all-gather, Ulysses and USP over the ``cp`` group.

The sequence of every sample is split over the ``cp`` ranks (``layout.shard_batch``); only
attention communicates. ``AttentionMeta.build`` gathers every rank's token positions once per
micro-batch; ``context_parallel_attention(q, k, v, meta)`` runs the algorithm named by
``parallel.cp_algo`` (``ALGORITHMS``) and ``attention_with_lse`` also returns the log-sum-exp.
Masks come only from global token indices and document ids (``kernels.visible``); partial results
merge in fp32 and ``out`` has the input dtype. cp == 1 with packed documents uses the local path.

Theory and invariants (how each algorithm moves K/V or heads, load balance, GQA handling,
communication volumes): docs/attention.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...mpu import comm
from ...mpu.mappings import all_to_all
from . import kernels
from .layout import sequence_layout

ALGORITHMS = ("ring", "zigzag", "llama3", "ulysses", "usp")


@dataclass
class AttentionMeta:
    """Where every CP rank's tokens sit in the sample, for one micro-batch (what masks are built from).

    ``positions[r]`` ``[b, s/cp]`` global token indices held by cp rank r (this rank is ``rank``);
    ``documents[r]`` their document ids (packed sequences) or None; ``algo`` one of ``ALGORITHMS``
    (``"local"`` for cp == 1); ``group`` the cp process group; ``heads_k_stride`` kv heads per
    llama3 all-gather.
    """

    algo: str
    group: Any
    rank: int
    positions: list[torch.Tensor]
    documents: list[torch.Tensor] | None = None
    heads_k_stride: int = 1
    ulysses_group: Any = None
    """USP: the Ulysses sub-group (consecutive cp ranks) and the ring sub-group across them."""
    ring_group: Any = None
    chunks: int | None = None
    """Chunks per rank's block classified separately (default: 2 for the zigzag layout, else 1)."""

    @staticmethod
    def build(token_index: torch.Tensor, document_ids: torch.Tensor | None, algo: str, group: Any,
              heads_k_stride: int = 1, ulysses_group: Any = None, ring_group: Any = None) -> AttentionMeta:
        """All-gather this rank's ``token_index`` (and ``document_ids``) ``[b, s/cp]`` over the cp group."""
        if algo not in ALGORITHMS:
            raise ValueError(f"parallel.cp_algo = {algo!r}; supported: {', '.join(ALGORITHMS)}")
        n, rank = comm.group_size(group), comm.group_rank(group)
        if n == 1:
            return AttentionMeta("local", group, 0, [token_index],
                                 None if document_ids is None else [document_ids], heads_k_stride)
        if algo == "usp" and (ulysses_group is None or ring_group is None):
            algo = "zigzag"  # Ulysses degree 1 (no sub-groups): USP is the zigzag ring
        stacked = token_index if document_ids is None else torch.stack([token_index, document_ids])
        gathered = comm.all_gather(stacked.unsqueeze(0).contiguous(), group, dim=0)  # [n, (2,) b, s/cp]
        parts = list(gathered.unbind(0))
        positions = parts if document_ids is None else [g[0] for g in parts]
        documents = None if document_ids is None else [g[1] for g in parts]
        return AttentionMeta(algo, group, rank, positions, documents, heads_k_stride, ulysses_group, ring_group)

    @property
    def size(self) -> int:
        return len(self.positions)

    @property
    def parts(self) -> int:
        """Chunks per rank's block, classified separately (2 for the zigzag layout)."""
        if self.chunks is not None:
            return self.chunks
        return 2 if self.algo != "local" and sequence_layout(self.algo) == "zigzag" else 1

    def doc(self, r: int) -> torch.Tensor | None:
        return None if self.documents is None else self.documents[r]


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                               scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence. q ``[s/cp, b, n, d]``, k/v ``[s/cp, b, g, d]``.

    Returns ``[s/cp, b, n, d]`` in q's dtype. Differentiable in q, k, v.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if meta.algo in ("local", "ulysses"):  # skip the lse all-to-all nobody reads
        return _ulysses(q, k, v, meta, scale, with_lse=False)[0]
    if meta.algo == "usp":
        return _usp(q, k, v, meta, scale, with_lse=False)[0]
    return attention_with_lse(q, k, v, meta, scale)[0]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``context_parallel_attention`` plus this rank's rows' log-sum-exp ``[b, n, s/cp]`` (fp32, not differentiable)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if meta.algo in ("local", "ulysses"):
        return _ulysses(q, k, v, meta, scale)
    if meta.algo in ("ring", "zigzag"):
        return _Ring.apply(q, k, v, meta, scale)
    if meta.algo == "usp":
        return _usp(q, k, v, meta, scale)
    if meta.algo == "llama3":
        return _Llama3.apply(q, k, v, meta, scale)
    raise ValueError(f"parallel.cp_algo = {meta.algo!r}; supported: {', '.join(ALGORITHMS)}")


# ---------------------------------------------------------------------------------------- blocks


def _cut(x: torch.Tensor, parts: int, dim: int) -> list[torch.Tensor]:
    return list(x.chunk(parts, dim=dim)) if parts > 1 else [x]


class _Accumulator:
    """The merged (out, lse) of this rank's query chunks over the key blocks seen so far (fp32)."""

    def __init__(self, q: torch.Tensor, q_pos: torch.Tensor, q_doc: torch.Tensor | None, parts: int,
                 scale: float) -> None:
        self.q, self.scale = _cut(q, parts, 0), scale
        self.q_pos, self.q_doc = _cut(q_pos, parts, 1), (_cut(q_doc, parts, 1) if q_doc is not None else [None] * parts)
        self.acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.q)

    def add(self, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, k_doc: torch.Tensor | None, parts: int) -> None:
        """Attend every query chunk to every chunk of this key block (skipping pairs no query sees)."""
        ks, vs, kps = _cut(k, parts, 0), _cut(v, parts, 0), _cut(k_pos, parts, 1)
        kds = _cut(k_doc, parts, 1) if k_doc is not None else [None] * parts
        for i, (q, qp, qd) in enumerate(zip(self.q, self.q_pos, self.q_doc)):
            for kc, vc, kp, kd in zip(ks, vs, kps, kds):
                kind = kernels.classify(qp, kp, qd, kd)
                if kind == "empty":
                    continue
                out, lse = kernels.attention_forward(q, kc, vc, qp, kp, qd, kd, scale=self.scale, kind=kind)
                prev = self.acc[i]
                self.acc[i] = (out, lse) if prev is None else kernels.merge(prev[0], prev[1], out, lse)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        outs, lses = [], []
        for q, acc in zip(self.q, self.acc):
            if acc is None:  # no key visible to any query of this chunk: out 0, lse −inf
                acc = kernels.empty_result(q)
            outs.append(acc[0])
            lses.append(acc[1])
        return torch.cat(outs, 0), torch.cat(lses, 2)


def _block_backward(dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, q_pos: torch.Tensor,
                    q_doc: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor,
                    k_doc: torch.Tensor | None, parts: int, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq share, dk, dv) of one key block, in fp32, chunk pair by chunk pair (empty pairs skipped)."""
    dtype = kernels.compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    sq, sk = q.shape[0] // parts, k.shape[0] // parts
    kds = _cut(k_doc, parts, 1) if k_doc is not None else [None] * parts
    qds = _cut(q_doc, parts, 1) if q_doc is not None else [None] * parts
    for i, (qp, qd) in enumerate(zip(_cut(q_pos, parts, 1), qds)):
        qs = slice(i * sq, (i + 1) * sq)
        for j, (kp, kd) in enumerate(zip(_cut(k_pos, parts, 1), kds)):
            kind = kernels.classify(qp, kp, qd, kd)
            if kind == "empty":
                continue
            ks = slice(j * sk, (j + 1) * sk)
            gq, gk, gv = kernels.attention_backward(dout[qs], q[qs], k[ks], v[ks], out[qs], lse[:, :, qs], qp, kp, qd, kd,
                                                    scale=scale, kind=kind)
            dq[qs] += gq
            dk[ks] += gk
            dv[ks] += gv
    return dq, dk, dv


# ------------------------------------------------------------------------------- ring and zigzag


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward: K,V passed to the next rank, compute overlapping; fp32 (out, lse)."""
    n, rank, parts = meta.size, meta.rank, meta.parts
    acc = _Accumulator(q, meta.positions[rank], meta.doc(rank), parts, scale)
    kv = torch.stack([k, v]).contiguous()  # [2, s/cp, b, g, d]: one message per step
    for step in range(n):
        src = (rank - step) % n
        pending = comm.ring_exchange_async(kv, meta.group) if step < n - 1 else None
        acc.add(kv[0], kv[1], meta.positions[src], meta.doc(src), parts)
        if pending is not None:
            kv = pending.wait()
    return acc.result()


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, meta: AttentionMeta, scale: float) -> tuple[torch.Tensor, ...]:
    """Ring attention backward: K,V travel again, each block's dK,dV accumulator travels with it."""
    n, rank, parts = meta.size, meta.rank, meta.parts
    dout = dout.contiguous()
    dq = None
    kv = torch.stack([k, v]).contiguous()
    dkv = None  # the fp32 accumulator of the block held now; it travels with the block
    for step in range(n):
        src = (rank - step) % n
        pending = comm.ring_exchange_async(kv, meta.group) if step < n - 1 else None
        gq, gk, gv = _block_backward(dout, q, out, lse, meta.positions[rank], meta.doc(rank), kv[0], kv[1],
                                     meta.positions[src], meta.doc(src), parts, scale)
        dq = gq if dq is None else dq + gq
        mine = torch.stack([gk, gv])
        dkv = mine if dkv is None else dkv + mine
        dkv = comm.ring_exchange_async(dkv, meta.group).wait()  # to the rank that holds this block next
        if pending is not None:
            kv = pending.wait()
    # after n hand-overs the accumulator of this rank's own block (every rank's share) is here
    assert dq is not None and dkv is not None
    return dq, dkv[0], dkv[1]


class _Ring(torch.autograd.Function):
    """Ring attention (contiguous or zigzag layout)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                scale: float) -> torch.Tensor:
        out, lse = _ring_forward(q, k, v, meta, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta, ctx.scale = meta, scale
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.meta, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


# ------------------------------------------------------------------------------------------ llama3


def _head_groups(g: int, stride: int) -> list[tuple[int, int]]:
    stride = max(1, min(stride, g))
    return [(h, min(h + stride, g)) for h in range(0, g, stride)]


def _gather_kv(k: torch.Tensor, v: torch.Tensor, h0: int, h1: int, group: Any) -> comm.Pending:
    """Start gathering kv heads [h0, h1) of every rank: ``wait()`` gives ``[cp·s, 2, b, h1−h0, d]``."""
    kv = torch.stack([k[:, :, h0:h1], v[:, :, h0:h1]], dim=1).contiguous()  # [s, 2, b, hg, d]
    return comm.all_gather_async(kv, group)


class _Llama3(torch.autograd.Function):
    """All-gather K,V (kv-head groups, next group prefetched), local exact attention, reduce-scatter dK,dV."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                scale: float) -> torch.Tensor:
        n, rank, parts = meta.size, meta.rank, meta.parts
        s, g, r = k.shape[0], k.shape[2], q.shape[2] // k.shape[2]
        groups = _head_groups(g, meta.heads_k_stride)
        outs, lses = [], []
        pending = _gather_kv(k, v, *groups[0], meta.group)
        for i, (h0, h1) in enumerate(groups):
            kv = pending.wait()
            if i + 1 < len(groups):
                pending = _gather_kv(k, v, *groups[i + 1], meta.group)  # in flight during this group's attention
            acc = _Accumulator(q[:, :, h0 * r:h1 * r], meta.positions[rank], meta.doc(rank), parts, scale)
            for src in range(n):
                block = kv[src * s:(src + 1) * s]
                acc.add(block[:, 0], block[:, 1], meta.positions[src], meta.doc(src), parts)
            out, lse = acc.result()
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, 2), torch.cat(lses, 1)
        ctx.save_for_backward(q, k, v, out, lse)  # not the gathered K,V: gathered again in backward
        ctx.meta, ctx.scale = meta, scale
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        meta, scale = ctx.meta, ctx.scale
        n, rank, parts = meta.size, meta.rank, meta.parts
        s, g, r = k.shape[0], k.shape[2], q.shape[2] // k.shape[2]
        dout = dout.contiguous()
        dtype = kernels.compute_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dkv_local = torch.zeros((s, 2, *k.shape[1:]), dtype=dtype, device=k.device)  # [s, 2, b, g, d]
        groups = _head_groups(g, meta.heads_k_stride)
        pending = _gather_kv(k, v, *groups[0], meta.group)
        scatters: list[tuple[tuple[int, int], comm.Pending]] = []
        for i, (h0, h1) in enumerate(groups):
            kv = pending.wait()
            if i + 1 < len(groups):
                pending = _gather_kv(k, v, *groups[i + 1], meta.group)
            qh = slice(h0 * r, h1 * r)
            dkv = torch.zeros((n * s, 2, *kv.shape[2:]), dtype=dtype, device=k.device)
            for src in range(n):
                rows = slice(src * s, (src + 1) * s)
                gq, gk, gv = _block_backward(dout[:, :, qh], q[:, :, qh], out[:, :, qh], lse[:, qh], meta.positions[rank],
                                             meta.doc(rank), kv[rows, 0], kv[rows, 1], meta.positions[src],
                                             meta.doc(src), parts, scale)
                dq[:, :, qh] += gq
                dkv[rows, 0] += gk
                dkv[rows, 1] += gv
            scatters.append(((h0, h1), comm.reduce_scatter_async(dkv, meta.group)))  # overlaps the next group
        for (h0, h1), pend in scatters:
            dkv_local[:, :, :, h0:h1] = pend.wait()
        return dq.to(q.dtype), dkv_local[:, 0].to(k.dtype), dkv_local[:, 1].to(v.dtype), None, None


# -------------------------------------------------------------------------------- ulysses / local


def _whole_sequence(meta: AttentionMeta) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Positions and documents of every rank's tokens in rank order, and the chunks to classify apart."""
    doc = None if meta.documents is None else torch.cat(meta.documents, 1)
    return torch.cat(meta.positions, 1), doc, meta.size * meta.parts


def _local_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of queries over keys that both cover the whole sequence: fp32 (out, lse)."""
    pos, doc, parts = _whole_sequence(meta)
    acc = _Accumulator(q, pos, doc, parts, scale)
    acc.add(k, v, pos, doc, parts)
    return acc.result()


def _local_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, meta: AttentionMeta, scale: float) -> tuple[torch.Tensor, ...]:
    pos, doc, parts = _whole_sequence(meta)
    return _block_backward(dout.contiguous(), q, out, lse, pos, doc, k, v, pos, doc, parts, scale)


class _Local(torch.autograd.Function):
    """cp == 1 (packed documents): exact attention of the local queries over the local keys."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                scale: float) -> torch.Tensor:
        out, lse = _local_forward(q, k, v, meta, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta, ctx.scale = meta, scale
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _local_backward(dout, q, k, v, out, lse, ctx.meta, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _heads_to_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ulysses all-to-all over ``group`` (n ranks): ``[s', b, heads, d]`` → ``[n·s', b, heads/n, d]``.

    GQA: kv heads split when ``g % n == 0``, else (``n % g == 0``) repeated so rank j gets kv head j·g/n."""
    n, heads, g = comm.group_size(group), q.shape[2], k.shape[2]
    if heads % n:
        raise ValueError(f"ulysses: {heads} local query heads are not divisible by the Ulysses degree {n}")
    if g % n:
        if n % g:
            raise ValueError(f"ulysses: {g} local kv heads and the Ulysses degree {n}: one must divide the other")
        k = k.repeat_interleave(n // g, dim=2)
        v = v.repeat_interleave(n // g, dim=2)
    return (all_to_all(q, group, scatter_dim=2, gather_dim=0), all_to_all(k, group, scatter_dim=2, gather_dim=0),
            all_to_all(v, group, scatter_dim=2, gather_dim=0))


def _usp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta, scale: float,
         with_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    u = comm.group_size(meta.ulysses_group)
    rings = meta.size // u
    cat_docs = None if meta.documents is None else [torch.cat(meta.documents[j * u:(j + 1) * u], 1)
                                                     for j in range(rings)]
    ring_meta = AttentionMeta("ring", meta.ring_group, meta.rank // u,
                              [torch.cat(meta.positions[j * u:(j + 1) * u], 1) for j in range(rings)], cat_docs,
                              chunks=u * meta.parts)
    out, lse_h = _Ulysses.apply(q, k, v, meta.ulysses_group, ring_meta, scale)  # ring inside each Ulysses group
    lse = comm.all_to_all(lse_h, meta.ulysses_group, scatter_dim=2, gather_dim=1) if with_lse else None
    return out, lse  # [b, n_heads, s/cp]


def _ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta, scale: float,
             with_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    if meta.size == 1:
        return _Local.apply(q, k, v, meta, scale)
    out, lse_h = _Ulysses.apply(q, k, v, meta.group, meta, scale)  # [s/cp, b, n_heads, d], [b, n_heads/cp, s]
    lse = comm.all_to_all(lse_h, meta.group, scatter_dim=2, gather_dim=1) if with_lse else None  # [b, n_heads, s/cp]
    return out, lse


class _Ulysses(torch.autograd.Function):
    """Ulysses in one Function: heads→sequence all-to-all over ``group``, attention of the gathered
    sequence (exact local attention; USP: ring attention over ``inner.group``), and back.

    Memory invariant: the attention output is held once. The returned ``[s/cp, b, n, d]`` output
    (which the output projection saves anyway) is what is saved; backward recovers the
    ``[s, b, n/cp, d]`` layout with one more all-to-all instead of keeping a second copy.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, inner: AttentionMeta,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        qh, kh, vh = _heads_to_sequence(q, k, v, group)  # [s·u/cp, b, n_heads/u, d] (no autograd in here)
        attend = _ring_forward if inner.algo == "ring" else _local_forward
        out_h, lse_h = attend(qh, kh, vh, inner, scale)  # every rank's chunk in rank order = the gathered order
        out = comm.all_to_all(out_h.to(q.dtype), group, scatter_dim=0, gather_dim=2)  # [s/cp, b, n_heads, d]
        ctx.save_for_backward(qh, kh, vh, out, lse_h)
        ctx.group, ctx.inner, ctx.scale, ctx.kv_heads = group, inner, scale, k.shape[2]
        ctx.mark_non_differentiable(lse_h)
        return out, lse_h

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> tuple[torch.Tensor | None, ...]:
        qh, kh, vh, out, lse_h = ctx.saved_tensors
        group = ctx.group
        out_h = comm.all_to_all(out, group, scatter_dim=2, gather_dim=0)  # the local output, recomputed by moving
        dout_h = comm.all_to_all(dout.contiguous(), group, scatter_dim=2, gather_dim=0)
        grads = _ring_backward if ctx.inner.algo == "ring" else _local_backward
        dqh, dkh, dvh = grads(dout_h, qh, kh, vh, out_h, lse_h, ctx.inner, ctx.scale)
        dq, dk, dv = (comm.all_to_all(x.to(qh.dtype), group, scatter_dim=0, gather_dim=2) for x in (dqh, dkh, dvh))
        if dk.shape[2] != ctx.kv_heads:  # kv heads were repeated for the Ulysses degree: sum the copies
            s, b, _, d = dk.shape
            dk, dv = (x.view(s, b, ctx.kv_heads, -1, d).sum(3) for x in (dk, dv))
        return dq, dk, dv, None, None, None
