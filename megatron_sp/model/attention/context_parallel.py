"""Context-parallel attention: ring, zigzag, llama3 all-gather, Ulysses and USP over the ``cp`` group.

``AttentionMeta.build`` gathers every rank's token positions once per micro-batch;
``context_parallel_attention`` runs ``parallel.cp_algo`` (``attention_with_lse`` also returns the log-sum-exp).
Masks come only from global token indices and document ids; partial results merge in fp32, ``out`` has the
input dtype. cp == 1 with packed documents uses the local path. Theory: docs/attention.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any

import torch

from ...mpu import comm
from ...mpu.cp_layout import sequence_layout
from ...mpu.mappings import all_to_all
from . import kernels

ALGORITHMS = ("ring", "zigzag", "llama3", "ulysses", "usp")


@dataclass
class AttentionMeta:
    """Where every CP rank's tokens sit in the sample, for one micro-batch: ``positions[r]`` ``[b, s/cp]`` global
    token indices held by cp rank r, ``documents[r]`` their document ids or None; ``algo`` one of ``ALGORITHMS``
    (``"local"`` for cp == 1); ``heads_k_stride`` kv heads per llama3 all-gather."""

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
    window: int | None = None
    """Sliding window (``model.sliding_window``): a query sees the keys of the last ``window`` global positions."""
    cache: dict = field(default_factory=dict, repr=False, compare=False)
    """Per micro-batch, shared by every layer's forward and backward: each block's chunk pairs, kinds and
    document plans (keyed by the position tensors this object holds, which stay alive with it)."""

    @staticmethod
    def build(token_index: torch.Tensor, document_ids: torch.Tensor | None, algo: str, group: Any,
              heads_k_stride: int = 1, ulysses_group: Any = None, ring_group: Any = None,
              window: int | None = None) -> AttentionMeta:
        """All-gather this rank's ``token_index`` (and ``document_ids``) ``[b, s/cp]`` over the cp group."""
        if algo not in ALGORITHMS:
            raise ValueError(f"parallel.cp_algo = {algo!r}; supported: {', '.join(ALGORITHMS)}")
        n, rank = comm.group_size(group), comm.group_rank(group)
        if n == 1:
            return AttentionMeta("local", group, 0, [token_index], None if document_ids is None else [document_ids],
                                 heads_k_stride, window=window)
        if algo == "usp" and (ulysses_group is None or ring_group is None):
            algo = "zigzag"  # Ulysses degree 1 (no sub-groups): USP is the zigzag ring
        stacked = token_index if document_ids is None else torch.stack([token_index, document_ids])
        gathered = comm.all_gather(stacked.unsqueeze(0).contiguous(), group, dim=0)  # [n, (2,) b, s/cp]
        parts = list(gathered.unbind(0))
        positions = parts if document_ids is None else [g[0] for g in parts]
        documents = None if document_ids is None else [g[1] for g in parts]
        return AttentionMeta(algo, group, rank, positions, documents, heads_k_stride, ulysses_group, ring_group,
                             window=window)

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
    """Attention of this rank's queries over the whole sequence, differentiable in q, k, v: q ``[s/cp, b, n, d]``,
    k/v ``[s/cp, b, g, d]`` → ``[s/cp, b, n, d]`` in q's dtype."""
    if meta.algo in ("ulysses", "usp"):  # skip the lse all-to-all nobody reads
        return _ulysses(q, k, v, meta, q.shape[-1] ** -0.5 if scale is None else scale, with_lse=False)[0]
    return attention_with_lse(q, k, v, meta, scale)[0]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``context_parallel_attention`` plus this rank's rows' log-sum-exp ``[b, n, s/cp]`` (fp32, not differentiable)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if meta.algo in ("ulysses", "usp"):
        return _ulysses(q, k, v, meta, scale)
    if meta.algo in ("local", "ring", "zigzag", "llama3"):
        return _Exact.apply(q, k, v, meta, scale)
    raise ValueError(f"parallel.cp_algo = {meta.algo!r}; supported: {', '.join(ALGORITHMS)}")


# ---------------------------------------------------------------------------------------- blocks


def _cols(x: torch.Tensor | None, cols: slice) -> torch.Tensor | None:
    return None if x is None else x[:, cols]


def _chunk_pairs(q_pos: torch.Tensor, q_doc: torch.Tensor | None, k_pos: torch.Tensor, k_doc: torch.Tensor | None,
                 parts: int, cache: dict, window: int | None) -> list[tuple[slice, slice, tuple, str, dict]]:
    """``(query rows, key rows, (q_pos, k_pos, q_doc, k_doc), kind, memo)`` of each pair of a block's ``parts``
    query and key chunks, classified apart, that some query sees; ``memo`` keeps the pair's document plan. Found
    once per micro-batch: ``cache`` is the meta's, and the positions are tensors the meta holds. Under a ``window``
    the pairs wholly outside it are skipped here: the ring's and llama3's saving."""
    key = (id(q_pos), id(k_pos), parts)
    if key not in cache:
        sq, sk = q_pos.shape[1] // parts, k_pos.shape[1] // parts
        pairs = []
        for i in range(parts):
            qs = slice(i * sq, (i + 1) * sq)
            for j in range(parts):
                ks = slice(j * sk, (j + 1) * sk)
                ids = (q_pos[:, qs], k_pos[:, ks], _cols(q_doc, qs), _cols(k_doc, ks))
                kind = kernels.classify(*ids, window)
                if kind != "empty":
                    pairs.append((qs, ks, ids, kind, {}))
        cache[key] = pairs
    return cache[key]


class _Accumulator:
    """The merged (out, lse) of this rank's query chunks over the key blocks seen so far (fp32)."""

    def __init__(self, q: torch.Tensor, q_pos: torch.Tensor, q_doc: torch.Tensor | None, meta: AttentionMeta,
                 scale: float, parts: int | None = None) -> None:
        self.q, self.q_pos, self.q_doc, self.scale, self.meta = q, q_pos, q_doc, scale, meta
        self.parts = meta.parts if parts is None else parts
        self.acc: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # first row of a query chunk -> (out, lse)

    def add(self, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, k_doc: torch.Tensor | None) -> None:
        """Attend every query chunk to every chunk of this key block (skipping pairs no query sees)."""
        window = self.meta.window
        for qs, ks, ids, kind, memo in _chunk_pairs(self.q_pos, self.q_doc, k_pos, k_doc, self.parts, self.meta.cache,
                                                    window):
            out, lse = kernels.attention_forward(self.q[qs], k[ks], v[ks], *ids, scale=self.scale, kind=kind,
                                                 memo=memo, window=window)
            prev = self.acc.get(qs.start)
            self.acc[qs.start] = (out, lse) if prev is None else kernels.merge(prev[0], prev[1], out, lse)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query chunk's merged (out, lse) in row order; a chunk that saw no key: out 0, lse −inf."""
        sq = self.q.shape[0] // self.parts
        chunks = [self.acc.get(i * sq) or kernels.empty_result(self.q[i * sq:(i + 1) * sq]) for i in range(self.parts)]
        return torch.cat([out for out, _ in chunks], 0), torch.cat([lse for _, lse in chunks], 2)


def _block_backward(dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, q_pos: torch.Tensor,
                    q_doc: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor,
                    k_doc: torch.Tensor | None, meta: AttentionMeta, scale: float, parts: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq share, dk, dv) of one key block, in fp32, chunk pair by chunk pair (empty pairs skipped)."""
    dtype = kernels.compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    parts = meta.parts if parts is None else parts
    for qs, ks, ids, kind, memo in _chunk_pairs(q_pos, q_doc, k_pos, k_doc, parts, meta.cache, meta.window):
        gq, gk, gv = kernels.attention_backward(dout[qs], q[qs], k[ks], v[ks], out[qs], lse[:, :, qs], *ids,
                                                scale=scale, kind=kind, memo=memo, window=meta.window)
        dq[qs] += gq
        dk[ks] += gk
        dv[ks] += gv
    return dq, dk, dv


# ------------------------------------------------------------------------------- ring and zigzag


def _ring_steps(k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """Yield ``(k, v, src)`` of every rank's block as it passes this rank; the next one is in flight meanwhile."""
    n = meta.size
    kv = torch.stack([k, v]).contiguous()  # [2, s/cp, b, g, d]: one message per step
    for step in range(n):
        pending = comm.ring_exchange_async(kv, meta.group) if step < n - 1 else None
        yield kv[0], kv[1], (meta.rank - step) % n
        if pending is not None:
            kv = pending.wait()


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward: K,V passed to the next rank, compute overlapping; fp32 (out, lse)."""
    acc = _Accumulator(q, meta.positions[meta.rank], meta.doc(meta.rank), meta, scale)
    for kb, vb, src in _ring_steps(k, v, meta):
        acc.add(kb, vb, meta.positions[src], meta.doc(src))
    return acc.result()


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, meta: AttentionMeta, scale: float) -> tuple[torch.Tensor, ...]:
    """Ring attention backward: K,V travel again, each block's dK,dV accumulator travels with it."""
    rank, dout = meta.rank, dout.contiguous()
    dq = dkv = None  # dkv: the fp32 accumulator of the block held now; it travels with the block
    for kb, vb, src in _ring_steps(k, v, meta):
        gq, gk, gv = _block_backward(dout, q, out, lse, meta.positions[rank], meta.doc(rank), kb, vb,
                                     meta.positions[src], meta.doc(src), meta, scale)
        dq = gq if dq is None else dq + gq
        mine = torch.stack([gk, gv])
        dkv = mine if dkv is None else dkv + mine
        dkv = comm.ring_exchange_async(dkv, meta.group).wait()  # to the rank that holds this block next
    # after n hand-overs the accumulator of this rank's own block (every rank's share) is here
    assert dq is not None and dkv is not None
    return dq, dkv[0], dkv[1]


# ------------------------------------------------------------------------------------------ llama3


def _gather_kv(k: torch.Tensor, v: torch.Tensor, heads: slice, group: Any) -> comm.Pending:
    """Start gathering kv ``heads`` of every rank: ``wait()`` gives ``[cp·s, 2, b, heads, d]``."""
    return comm.all_gather_async(torch.stack([k[:, :, heads], v[:, :, heads]], dim=1).contiguous(), group)


def _gathered_heads(k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> Iterator[tuple[slice, torch.Tensor]]:
    """Yield ``(kv heads, gathered kv)`` per group of ``heads_k_stride`` kv heads, the next group's all-gather
    in flight while the caller works on this one."""
    g = k.shape[2]
    stride = max(1, min(meta.heads_k_stride, g))
    groups = [slice(h, min(h + stride, g)) for h in range(0, g, stride)]
    pending = _gather_kv(k, v, groups[0], meta.group)
    for i, heads in enumerate(groups):
        kv = pending.wait()
        if i + 1 < len(groups):
            pending = _gather_kv(k, v, groups[i + 1], meta.group)
        yield heads, kv


def _llama3_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather K,V (kv-head groups, next group prefetched), local exact attention; fp32 (out, lse).
    The gathered K,V are not saved: backward gathers them again."""
    s, r = k.shape[0], q.shape[2] // k.shape[2]
    outs, lses = [], []
    for heads, kv in _gathered_heads(k, v, meta):
        acc = _Accumulator(q[:, :, heads.start * r:heads.stop * r], meta.positions[meta.rank], meta.doc(meta.rank),
                           meta, scale)
        for src in range(meta.size):
            block = kv[src * s:(src + 1) * s]
            acc.add(block[:, 0], block[:, 1], meta.positions[src], meta.doc(src))
        out, lse = acc.result()
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 1)


def _llama3_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, meta: AttentionMeta, scale: float) -> tuple[torch.Tensor, ...]:
    """K,V gathered again per head group; each group's dK,dV reduce-scattered while the next one computes."""
    rank, n = meta.rank, meta.size
    s, r = k.shape[0], q.shape[2] // k.shape[2]
    dout = dout.contiguous()
    dtype = kernels.compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dkv_local = torch.zeros((s, 2, *k.shape[1:]), dtype=dtype, device=k.device)  # [s, 2, b, g, d]
    scatters: list[tuple[slice, comm.Pending]] = []
    for heads, kv in _gathered_heads(k, v, meta):
        qh = slice(heads.start * r, heads.stop * r)
        dkv = torch.zeros((n * s, 2, *kv.shape[2:]), dtype=dtype, device=k.device)
        for src in range(n):
            rows = slice(src * s, (src + 1) * s)
            gq, gk, gv = _block_backward(dout[:, :, qh], q[:, :, qh], out[:, :, qh], lse[:, qh], meta.positions[rank],
                                         meta.doc(rank), kv[rows, 0], kv[rows, 1], meta.positions[src],
                                         meta.doc(src), meta, scale)
            dq[:, :, qh] += gq
            dkv[rows, 0] += gk
            dkv[rows, 1] += gv
        scatters.append((heads, comm.reduce_scatter_async(dkv, meta.group)))  # overlaps the next group
    for heads, pend in scatters:
        dkv_local[:, :, :, heads] = pend.wait()
    return dq, dkv_local[:, 0], dkv_local[:, 1]


# -------------------------------------------------------------------------------- ulysses / local


def _whole_sequence(meta: AttentionMeta) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Positions and documents of every rank's tokens in rank order, and the chunks to classify apart (made once
    per meta, so that ``_chunk_pairs`` finds them in its cache)."""
    if "whole" not in meta.cache:
        doc = None if meta.documents is None else torch.cat(meta.documents, 1)
        meta.cache["whole"] = torch.cat(meta.positions, 1), doc, meta.size * meta.parts
    return meta.cache["whole"]


def _local_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of queries over keys that both cover the whole sequence: fp32 (out, lse)."""
    pos, doc, parts = _whole_sequence(meta)
    acc = _Accumulator(q, pos, doc, meta, scale, parts)
    acc.add(k, v, pos, doc)
    return acc.result()


def _local_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, meta: AttentionMeta, scale: float) -> tuple[torch.Tensor, ...]:
    pos, doc, parts = _whole_sequence(meta)
    return _block_backward(dout.contiguous(), q, out, lse, pos, doc, k, v, pos, doc, meta, scale, parts)


_PASSES = {"ring": (_ring_forward, _ring_backward), "zigzag": (_ring_forward, _ring_backward),
           "llama3": (_llama3_forward, _llama3_backward)}
"""(forward, backward) of each algorithm over ``meta``'s ranks; any other (local, ulysses): the local pair."""


def _passes(meta: AttentionMeta) -> tuple[Any, Any]:
    return _PASSES.get(meta.algo, (_local_forward, _local_backward))


class _Exact(torch.autograd.Function):
    """Ring (contiguous or zigzag layout), llama3, or cp == 1 local attention: fp32 inside, q's dtype out."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                scale: float) -> torch.Tensor:
        out, lse = _passes(meta)[0](q, k, v, meta, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta, ctx.scale = meta, scale
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _passes(ctx.meta)[1](dout, q, k, v, out, lse, ctx.meta, ctx.scale)
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
        k, v = (x.repeat_interleave(n // g, dim=2) for x in (k, v))
    return tuple(all_to_all(x, group, scatter_dim=2, gather_dim=0) for x in (q, k, v))  # type: ignore[return-value]


def _ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta, scale: float,
             with_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ulysses over the cp group; USP: over ``meta.ulysses_group``, a ring over ``meta.ring_group`` inside."""
    group, inner = meta.group, meta
    if meta.algo == "usp":
        u = comm.group_size(meta.ulysses_group)
        docs = None if meta.documents is None else [torch.cat(meta.documents[j:j + u], 1) for j in range(0, meta.size, u)]
        group = meta.ulysses_group
        inner = AttentionMeta("ring", meta.ring_group, meta.rank // u,
                              [torch.cat(meta.positions[j:j + u], 1) for j in range(0, meta.size, u)], docs,
                              chunks=u * meta.parts, window=meta.window)
    out, lse_h = _Ulysses.apply(q, k, v, group, inner, scale)  # [s/cp, b, n_heads, d], [b, n_heads/u, s·u/cp]
    lse = comm.all_to_all(lse_h, group, scatter_dim=2, gather_dim=1) if with_lse else None  # [b, n_heads, s/cp]
    return out, lse


class _Ulysses(torch.autograd.Function):
    """Ulysses in one Function: heads→sequence all-to-all over ``group``, attention of the gathered sequence
    (local; USP: a ring over ``inner.group``), and back. Memory invariant: only the returned ``[s/cp, b, n, d]``
    output (saved by the output projection anyway) is saved; backward recovers ``[s, b, n/cp, d]`` with one
    more all-to-all instead of keeping a second copy."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, inner: AttentionMeta,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        qh, kh, vh = _heads_to_sequence(q, k, v, group)  # [s·u/cp, b, n_heads/u, d] (no autograd in here)
        out_h, lse_h = _passes(inner)[0](qh, kh, vh, inner, scale)  # every rank's chunk in rank order = the gathered order
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
        dqh, dkh, dvh = _passes(ctx.inner)[1](dout_h, qh, kh, vh, out_h, lse_h, ctx.inner, ctx.scale)
        dq, dk, dv = (comm.all_to_all(x.to(qh.dtype), group, scatter_dim=0, gather_dim=2) for x in (dqh, dkh, dvh))
        if dk.shape[2] != ctx.kv_heads:  # kv heads were repeated for the Ulysses degree: sum the copies
            s, b, _, d = dk.shape
            dk, dv = (x.view(s, b, ctx.kv_heads, -1, d).sum(3) for x in (dk, dv))
        return dq, dk, dv, None, None, None
