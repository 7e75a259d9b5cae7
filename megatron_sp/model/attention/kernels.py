"""Attention kernels with log-sum-exp, the building block of every context-parallel algorithm.

``attention_forward(q, k, v, q_pos, k_pos, ...) -> (out, lse)`` attends over one key block (fp32, fp64 for fp64
inputs), ``merge`` combines blocks exactly, ``attention_backward`` gives one block's gradients from the final
merged ``out``/``lse``. Masks come only from global token indices and document ids (``visible``); ``classify``
names a block's kind and ``kernel_for`` its kernel: ``reference`` (explicit scores, the oracle), the fused
``cpu_flash``, ``flash_attn`` or ``efficient`` (``fused.py``), or ``documents`` for masked blocks. No autograd. Layouts: q/out/dout
``[sq, b, n, d]``, k/v ``[sk, b, g, d]`` with ``g | n``, lse ``[b, n, sq]``. The layer's own causal kernels
(``dot_product_attention``; ``cached_attention`` for decoding) live here too. Theory: docs/attention.md.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megatron_sp import device as device_mod
from megatron_sp.model.attention import band, documents, fused
from megatron_sp.model.attention.fused import compute_dtype, repeat_kv

log = logging.getLogger("megatron_sp")

KINDS = ("empty", "full", "causal", "masked")
"""What ``classify`` returns, from cheapest to most general."""

KERNELS = ("reference", "cpu_flash", "flash_attn", "efficient")
"""Kernel names accepted by ``kernel=``; ``None`` picks one per block (``kernel_for``)."""


# ---------------------------------------------------------------------------------- Masks

def _check_docs(q_doc: torch.Tensor | None, k_doc: torch.Tensor | None) -> bool:
    """True when document ids are given; both or neither must be."""
    if (q_doc is None) != (k_doc is None):
        raise ValueError("q_doc and k_doc must be given together (or both None for one document per sample)")
    return q_doc is not None


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None = None,
            k_doc: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """bool ``[b, sq, sk]``: key ``j`` is visible to query ``i`` iff ``k_pos[b, j] <= q_pos[b, i]``, (no window or
    ``k_pos[b, j] > q_pos[b, i] − window``: the query and ``window − 1`` keys before it, as transformers' Mistral)
    and (no documents or ``q_doc[b, i] == k_doc[b, j]``). Positions: int64 global token indices ``[b, sq]``/``[b, sk]``
    (not rotary positions); documents: int64 ids of the same shapes, or None for one document per sample."""
    mask = k_pos[:, None, :] <= q_pos[:, :, None]  # [b, sq, sk]
    if window:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
    if _check_docs(q_doc, k_doc):
        mask &= q_doc[:, :, None] == k_doc[:, None, :]
    return mask


def classify(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None = None,
             k_doc: torch.Tensor | None = None, window: int | None = None) -> str:
    """The kind of the block's mask (``KINDS``, defined in docs/attention.md), decided from per-row min/max
    (O(s) per-document reductions when documents vary inside a row), never from the ``[sq, sk]`` mask."""
    has_docs = _check_docs(q_doc, k_doc)
    b, sq = q_pos.shape
    sk = k_pos.shape[1]
    if b == 0 or sq == 0 or sk == 0:
        return "empty"
    q_lo, q_hi = torch.aminmax(q_pos, dim=1)
    k_lo, k_hi = torch.aminmax(k_pos, dim=1)
    keys_after = k_lo > q_hi  # [b]: no key at or before any query of the row (or inside any query's window)
    if window:
        keys_after |= k_hi <= q_lo - window
    if has_docs:
        qd_lo, qd_hi = torch.aminmax(q_doc, dim=1)
        kd_lo, kd_hi = torch.aminmax(k_doc, dim=1)
        one_doc = (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)  # [b]: a single shared document
        no_row_visible = keys_after | (qd_hi < kd_lo) | (kd_hi < qd_lo)
    else:
        one_doc = None
        no_row_visible = keys_after
    if bool(no_row_visible.all()):
        return "empty"
    if one_doc is not None and not bool(one_doc.all()):
        # Some row holds two documents: it cannot be full or causal; a pair is visible iff some
        # document's first key here comes at or before its last query here (O(s), no mask).
        ids, inverse = torch.unique(torch.cat([q_doc, k_doc], 1), return_inverse=True)
        per_row = (torch.arange(b, device=ids.device) * ids.numel())[:, None]
        last_q = torch.full((b * ids.numel(),), -1, dtype=q_pos.dtype, device=q_pos.device)
        last_q = last_q.scatter_reduce(0, (inverse[:, :sq] + per_row).flatten(), q_pos.flatten(), "amax")
        first_k = torch.full_like(last_q, torch.iinfo(k_pos.dtype).max)
        first_k = first_k.scatter_reduce(0, (inverse[:, sq:] + per_row).flatten(), k_pos.flatten(), "amin")
        return "masked" if bool((first_k <= last_q).any()) else "empty"
    # One document per row from here on: the position ranges decide.
    inside = not window or bool((k_lo > q_hi - window).all())  # no window bound cuts the block
    if inside and bool((k_hi <= q_lo).all()):
        return "full"
    if (inside and sq == sk and torch.equal(q_pos, k_pos)
            and (sq == 1 or bool((q_pos[:, 1:] > q_pos[:, :-1]).all()))):
        return "causal"
    return "masked"


# ---------------------------------------------------------------------------------- Helpers

def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"attention: expected q [sq, b, n, d] and k, v [sk, b, g, d], got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    sq, b, n, d = q.shape
    sk, bk, g, dk = k.shape
    if bk != b or dk != d or g == 0 or n % g:
        raise ValueError(f"attention: k/v {tuple(k.shape)} do not match q {tuple(q.shape)} "
                         "(same b and d, kv heads dividing query heads)")
    if tuple(q_pos.shape) != (b, sq) or tuple(k_pos.shape) != (b, sk):
        raise ValueError(f"attention: q_pos {tuple(q_pos.shape)} / k_pos {tuple(k_pos.shape)} must be "
                         f"[b, sq] = [{b}, {sq}] / [b, sk] = [{b}, {sk}]")


def _prepare(phase: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
             q_doc: torch.Tensor | None, k_doc: torch.Tensor | None, scale: float | None, kind: str | None,
             kernel: str | None, window: int | None) -> tuple[str | None, bool, float]:
    """Tell the observers, check a block: its kernel (``kernel_for``; None for an empty block), whether it is
    causal, and its scale."""
    for callback in _BLOCK_OBSERVERS:
        callback(phase, q, k, q_pos, k_pos, q_doc, k_doc, kind)
    _check_shapes(q, k, v, q_pos, k_pos)
    if kind is None:
        kind = classify(q_pos, k_pos, q_doc, k_doc, window)
    elif kind not in KINDS:
        raise ValueError(f"attention: unknown block kind {kind!r}; expected one of {' | '.join(KINDS)}")
    if kind == "empty":
        return None, False, 0.0
    return kernel_for(kind, q, kernel), kind == "causal", q.shape[-1] ** -0.5 if scale is None else float(scale)


def kernel_for(kind: str, q: torch.Tensor, kernel: str | None = None) -> str:
    """The kernel that runs a block of ``kind`` for queries like ``q``: auto (docs/attention.md; ``documents`` for
    masked blocks, which runs its pieces on ``piece_kernel``), or ``kernel``, which raises ``ValueError`` where it
    cannot compute the block exactly."""
    if kernel is None:
        return "documents" if kind == "masked" else piece_kernel(q)
    if kernel not in KERNELS:
        raise ValueError(f"attention: unknown kernel {kernel!r}; expected one of {' | '.join(KERNELS)}")
    if kernel != "reference" and kind == "masked":
        raise ValueError(f"attention: kernel {kernel!r} cannot apply a '{kind}' mask; use the reference kernel")
    if kernel == "cpu_flash" and q.device.type != "cpu":
        raise ValueError(f"attention: kernel 'cpu_flash' needs CPU tensors, got {q.device}")
    if kernel == "flash_attn" and not fused.flash_attn_fits(q):
        raise ValueError(f"attention: kernel 'flash_attn' needs flash-attn on a GPU, fp16/bf16 inputs and a head dim that is "
                         f"a multiple of 8 up to {fused.FLASH_ATTN_MAX_HEAD_DIM} (got {q.dtype}, d={q.shape[-1]})")
    if kernel == "efficient" and not efficient_fits(q):
        raise ValueError(f"attention: kernel 'efficient' needs a GPU, fp16/bf16/fp32 inputs (got {q.dtype} on "
                         f"{q.device}) and a kernel that passed its check (see the log)")
    return kernel


def piece_kernel(q: torch.Tensor) -> str:
    """The fused kernel for full and causal blocks and pieces: ``cpu_flash`` on CPU; on GPU flash-attn, else torch's
    memory-efficient kernel, else (fp64) explicit scores."""
    if q.device.type == "cpu":
        return "cpu_flash"
    if fused.flash_attn_fits(q):
        return "flash_attn"
    return "efficient" if efficient_fits(q) else "reference"


def efficient_fits(q: torch.Tensor) -> bool:
    """torch's memory-efficient kernel runs ``q`` exactly: CUDA, fp16/bf16/fp32, and its once-per-dtype check
    against explicit scores (full, causal and packed-document blocks, out/lse/grads) passed."""
    return q.device.type == "cuda" and q.dtype in (*fused.HALF, torch.float32) and _efficient_checked(q.device, q.dtype)


@functools.cache
def _efficient_checked(dev: torch.device, dtype: torch.dtype) -> bool:
    with torch.autocast(dev.type, enabled=False), torch.no_grad():  # the first block may come inside autocast
        return _efficient_check(dev, dtype)


def _efficient_check(dev: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(40, 2, 4, 16, generator=gen).to(dev, dtype) for _ in range(2))
    k, v = (torch.randn(40, 2, 2, 16, generator=gen).to(dev, dtype) for _ in range(2))
    pos = torch.arange(40, device=dev).expand(2, 40)
    docs = (pos >= 13).long() + (pos >= 14).long() + (pos >= 37).long()  # documents of 13, 1, 23 and 3 tokens
    blocks = {"full": (pos + 40, pos, None, None), "causal": (pos, pos, None, None), "masked": (pos, pos, docs, docs)}
    tolerance = 3e-2 if dtype in fused.HALF else 1e-4
    try:
        for kind, (q_pos, k_pos, q_doc, k_doc) in blocks.items():
            mask = visible(q_pos, k_pos, q_doc, k_doc)  # the oracle, called directly: no block observers
            want = _reference_forward(q, k, v, mask, 0.25)
            want = (*want, *_reference_backward(dout, q, k, v, *want, mask, 0.25))
            got = _run_efficient(dout, q, k, v, q_pos, k_pos, q_doc, k_doc, masked=kind == "masked")
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                error = float((a.double() - b.double()).abs().max() / b.double().abs().max())
                if not error <= tolerance:
                    raise RuntimeError(f"{kind} block: {name} differs from explicit scores by {error:.1e}")
    except (RuntimeError, TypeError, ValueError) as exc:  # a missing, changed or broken kernel, or a wrong result
        log.warning("torch's memory-efficient attention failed its check on %s %s (%s); attention blocks there use "
                    "explicit scores", dev, dtype, exc)
        return False
    log.info("attention blocks and packed documents on %s %s use torch's memory-efficient kernel", dev, dtype)
    return True


def _run_efficient(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                   k_pos: torch.Tensor, q_doc: torch.Tensor | None, k_doc: torch.Tensor | None,
                   masked: bool) -> tuple[torch.Tensor, ...]:
    """out, lse, dq, dk, dv of one block on the efficient kernel (varlen for ``masked``), scale 1/4."""
    if masked:
        groups = documents.plan(q_pos, k_pos, q_doc, k_doc, packed=True, device=q.device)
        run_f, run_b = _document_runners("efficient", 0.25)
        out, lse = documents.forward(q, k, v, groups, torch.float32, run_f)
        return out, lse, *documents.backward(dout, q, k, v, out, lse, groups, torch.float32, run_b)
    causal = bool(torch.equal(q_pos, k_pos))
    out, lse = fused.efficient_forward(q, k, v, 0.25, causal)
    return out, lse, *fused.efficient_backward(dout, q, k, v, out, lse, 0.25, causal)


def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of a block no query sees: out 0 and lse −inf, in ``compute_dtype``."""
    sq, b, n, d = q.shape
    dtype = compute_dtype(q.dtype)
    return (torch.zeros(sq, b, n, d, dtype=dtype, device=q.device),
            torch.full((b, n, sq), float("-inf"), dtype=dtype, device=q.device))


# ---------------------------------------------------------------------------------- Public API

BlockObserver = Callable[..., None]
"""``callback(phase, q, k, q_pos, k_pos, q_doc, k_doc, kind)``: see ``observe``."""
_BLOCK_OBSERVERS: list[BlockObserver] = []


@contextlib.contextmanager
def observe(callback: BlockObserver) -> Iterator[None]:
    """Call ``callback(phase, q, k, q_pos, k_pos, q_doc, k_doc, kind)`` before each block's kernel runs
    (phase ``forward``/``backward``; ``kind`` None if the caller did not classify): for benchmarks."""
    _BLOCK_OBSERVERS.append(callback)
    try:
        yield
    finally:
        _BLOCK_OBSERVERS.remove(callback)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                      q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None, *,
                      scale: float | None = None, kind: str | None = None, kernel: str | None = None,
                      memo: dict | None = None, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over one key block (``window``: sliding, see ``visible``):
    ``(out [sq, b, n, d], lse [b, n, sq])``, fp32 (fp64 for
    fp64 inputs) and contiguous, so callers ``merge`` without rounding; a row that sees no key: out 0, lse −inf.
    ``kind``: the ``classify`` result if the caller has it; ``kernel`` forces a kernel; ``memo``: a dict the caller
    keeps for this block's positions, in which a document plan is made once for every later call."""
    name, causal, scale = _prepare("forward", q, k, v, q_pos, k_pos, q_doc, k_doc, scale, kind, kernel, window)
    if name is None:
        return empty_result(q)
    with torch.autocast(q.device.type, enabled=False):  # the contract's fp32 out/lse, also inside autocast
        if name == "documents":
            groups = _plan(q, q_pos, k_pos, q_doc, k_doc, (piece := piece_kernel(q)) in VARLEN, memo, window)
            if isinstance(groups, band.Band):
                return band.forward(q, k, v, groups, scale)
            return documents.forward(q, k, v, groups, compute_dtype(q.dtype), _document_runners(piece, scale)[0])
        if name == "reference":
            return _reference_forward(q, k, v, visible(q_pos, k_pos, q_doc, k_doc, window), scale)
        return DENSE[name][0](q, k, v, scale, causal)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None = None,
                       k_doc: torch.Tensor | None = None, *, scale: float | None = None, kind: str | None = None,
                       kernel: str | None = None, memo: dict | None = None, window: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ONE key block given the FINAL ``out``/``lse`` over all key blocks: contiguous
    ``(dq [sq, b, n, d], dk [sk, b, g, d], dv [sk, b, g, d])`` in fp32 (fp64 for fp64 inputs), dk/dv summed over
    the query heads of each kv head. ``dq`` is this block's share (the caller sums over key blocks). ``memo``: as
    in ``attention_forward``."""
    name, causal, scale = _prepare("backward", q, k, v, q_pos, k_pos, q_doc, k_doc, scale, kind, kernel, window)
    dtype = compute_dtype(q.dtype)
    if name is None:
        return tuple(torch.zeros(x.shape, dtype=dtype, device=x.device) for x in (q, k, v))  # type: ignore[return-value]
    with torch.autocast(q.device.type, enabled=False):  # fp32 gradients from the fp32 lse, also inside autocast
        if name == "documents":
            groups = _plan(q, q_pos, k_pos, q_doc, k_doc, (piece := piece_kernel(q)) in VARLEN, memo, window)
            if isinstance(groups, band.Band):
                return band.backward(dout, q, k, v, out, lse, groups, scale)
            return documents.backward(dout, q, k, v, out, lse, groups, dtype, _document_runners(piece, scale)[1])
        if name == "reference":
            return _reference_backward(dout, q, k, v, out, lse, visible(q_pos, k_pos, q_doc, k_doc, window), scale)
        return DENSE[name][1](dout, q, k, v, out, lse, scale, causal)


def _plan(q: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None,
          k_doc: torch.Tensor | None, packed: bool, memo: dict | None, window: int | None) -> list | band.Band:
    """The block's document plan on ``q``'s device (on CPU a ``band.Band`` where it fits), from ``memo`` if it has it."""
    key = ("documents", packed, q.device, window)
    if memo is not None and key in memo:
        return memo[key]
    groups = ((q.device.type == "cpu" and not packed and band.plan(q_pos, k_pos, q_doc, k_doc, window))
              or documents.plan(q_pos, k_pos, q_doc, k_doc, packed=packed, device=q.device, window=window))
    if memo is not None:
        memo[key] = groups
    return groups


def _dense_mask(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """bool ``[b, sq, sk]``: everything, or the top-left lower triangle."""
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    return (mask.tril() if causal else mask).expand(q.shape[1], -1, -1)


def _reference_dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _reference_forward(q, k, v, _dense_mask(q, k, causal), scale)


def _reference_dense_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                              lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, ...]:
    return _reference_backward(dout, q, k, v, out, lse, _dense_mask(q, k, causal), scale)


DENSE: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "reference": (_reference_dense_forward, _reference_dense_backward),
    "cpu_flash": (fused.cpu_flash_forward, fused.cpu_flash_backward),
    "flash_attn": (fused.flash_attn_forward, fused.flash_attn_backward),
    "efficient": (fused.efficient_forward, fused.efficient_backward),
}
"""Forward and backward of a full or causal block, per kernel: ``(q, k, v, scale, causal)`` and
``(dout, q, k, v, out, lse, scale, causal)``."""

VARLEN: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "flash_attn": (fused.flash_attn_varlen_forward, fused.flash_attn_varlen_backward),
    "efficient": (fused.efficient_varlen_forward, fused.efficient_varlen_backward),
}
"""Kernels that run a document block's pieces packed end to end (``documents.Packed``) in one call."""


def _document_runners(piece: str, scale: float) -> tuple[documents.Forward, documents.Backward]:
    """``documents.forward``/``backward`` runners on kernel ``piece``: varlen, or dense on batched pieces."""
    if piece in VARLEN:
        forward, backward = VARLEN[piece]
        return (lambda q, k, v, group: forward(q, k, v, group, scale),
                lambda *args: backward(*args[:-1], args[-1], scale))
    forward, backward = DENSE[piece]
    return (documents.batched(lambda q, k, v, causal: forward(q, k, v, scale, causal)),
            documents.batched_backward(lambda *args: backward(*args[:-1], scale, args[-1])))


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial results over disjoint key sets, in fp32 (fp64 if either is fp64); a row −inf
    in both stays ``lse = −inf``, ``out = 0`` (no NaN). Symmetric bit for bit; math: docs/attention.md."""
    dtype = torch.float64 if torch.float64 in (out_a.dtype, out_b.dtype, lse_a.dtype, lse_b.dtype) else torch.float32
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    lse = torch.logaddexp(lse_a, lse_b)  # [b, n, sq]; −inf only where both are
    lse_safe = lse.masked_fill(lse == float("-inf"), 0.0)  # exp(−inf − 0) = 0 instead of NaN
    weight_a = torch.exp(lse_a - lse_safe).permute(2, 0, 1).unsqueeze(-1)  # [sq, b, n, 1]
    weight_b = torch.exp(lse_b - lse_safe).permute(2, 0, 1).unsqueeze(-1)
    return out_a.to(dtype) * weight_a + out_b.to(dtype) * weight_b, lse


# ---------------------------------------------------------------------------------- Reference kernel

def _grouped(x: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    """``[s, b, n, d]`` -> ``[b, g, n/g, s, d]`` in ``dtype``: query heads grouped by their kv head."""
    s, b, n, d = x.shape
    return x.to(dtype).permute(1, 2, 0, 3).reshape(b, g, n // g, s, d)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """``[b, g, r, s, d]`` -> contiguous ``[s, b, g·r, d]``."""
    b, g, r, s, d = x.shape
    return x.reshape(b, g * r, s, d).permute(2, 0, 1, 3).contiguous()


def _grouped_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[b, g, r, sq, d]``, k and v ``[b, g, 1, sk, d]`` in the compute dtype, and the scores ``[b, g, r, sq, sk]``."""
    dtype = compute_dtype(q.dtype)
    q_g = _grouped(q, k.shape[2], dtype)
    k_g, v_g = (x.to(dtype).permute(1, 2, 0, 3).unsqueeze(2) for x in (k, v))
    return q_g, k_g, v_g, (q_g @ k_g.transpose(-1, -2)) * scale


def _reference_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, v_g, scores = _grouped_scores(q, k, v, scale)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, g, r, sq]; −inf for rows that see nothing
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))  # 0 on masked entries
    out = _ungrouped(probs @ v_g)  # [sq, b, n, d]
    b, g, r, sq = lse.shape
    return out, lse.reshape(b, g * r, sq)


def _reference_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = compute_dtype(q.dtype)
    g = k.shape[2]
    b, n, sq = lse.shape
    q_g, k_g, v_g, scores = _grouped_scores(q, k, v, scale)
    do_g = _grouped(dout, g, dtype)  # [b, g, r, sq, d]
    # A row with L = −inf saw no key in any block: L -> +inf makes its P exactly 0 (no NaN).
    lse_g = lse.to(dtype).masked_fill(lse == float("-inf"), float("inf")).reshape(b, g, n // g, sq, 1)
    probs = torch.exp(scores - lse_g).masked_fill(~mask[:, None, None], 0.0)  # P
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1).permute(1, 2, 0).reshape(b, g, n // g, sq, 1)  # D = rowsum(dO∘O)
    dscores = probs * (do_g @ v_g.transpose(-1, -2) - delta)  # dS = P∘(dO·Vᵀ − D)
    dq = (dscores @ k_g) * scale  # [b, g, r, sq, d]
    dk = torch.einsum("bgrqk,bgrqd->bgkd", dscores, q_g) * scale  # summed over the r query heads of each kv head
    dv = torch.einsum("bgrqk,bgrqd->bgkd", probs, do_g)
    return _ungrouped(dq), dk.permute(2, 0, 1, 3).contiguous(), dv.permute(2, 0, 1, 3).contiguous()


# ------------------------------------------ the layer's causal kernel (no LSE), and cached_attention for decoding

MATH_ATTENTION_MAX_SCORES = 1 << 24
"""CPU attention in ``MATH_ATTENTION_DTYPES`` uses the block-causal explicit-scores kernel when ``b · n · s²`` is at
most this (faster than the CPU flash kernel; it keeps about half of the ``[b, n, s, s]`` probabilities for backward:
docs/attention.md). 0: always SDPA. The default of ``model.cpu_attention_max_scores``."""

_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)

MATH_ATTENTION_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
"""Dtypes for which the explicit-scores CPU kernel is used (see ``MATH_ATTENTION_MAX_SCORES``)."""

CAUSAL_BLOCK_ROWS = 64
"""Query positions per block of the explicit-scores kernel in fp32 (and fp64): block ``[a, e)`` computes scores
against keys ``[0, e)`` only, so above the diagonal it computes just its own triangle (docs/attention.md)."""

CAUSAL_BLOCK_ROWS_16BIT = 128
"""The same in bf16 and fp16. Their ``bmm`` copies a block's key prefix first, so fewer, larger blocks win: 128 rows
were 1.09× (s 512) to 1.29× (s 2048) faster than 64 in ``tools/bench/attention.py``; in fp32 64 rows were faster."""


def causal_block_rows(dtype: torch.dtype) -> int:
    """Query positions per block of the explicit-scores kernel in ``dtype``."""
    return CAUSAL_BLOCK_ROWS_16BIT if dtype.itemsize == 2 else CAUSAL_BLOCK_ROWS


def block_kernel_runs(dtype: torch.dtype, batch: int, heads: int, s: int, max_scores: int | None = None) -> bool:
    """Whether the layer's CPU causal attention is the block-causal explicit-scores kernel for ``batch`` samples of
    ``heads`` local heads and ``s`` tokens (else SDPA), with the bound ``max_scores`` (``model.cpu_attention_max_scores``;
    None: ``MATH_ATTENTION_MAX_SCORES``): the rule ``dot_product_attention``, the planner and the activation bench
    share."""
    bound = MATH_ATTENTION_MAX_SCORES if max_scores is None else max_scores
    return dtype in MATH_ATTENTION_DTYPES and batch * heads * s * s <= bound


def causal_blocks(s: int, rows: int) -> list[tuple[int, int]]:
    """The explicit-scores kernel's query blocks ``[a, e)`` of ``rows`` positions (``causal_block_rows``), the
    last possibly shorter; block ``[a, e)`` attends over keys ``[0, e)``."""
    return [(a, min(a + rows, s)) for a in range(0, s, rows)]


def causal_block_scores(s: int, rows: int) -> int:
    """Scores per (sample, head) that the explicit-scores kernel computes and keeps with blocks of ``rows``
    positions: ``Σ (e − a)·e`` over its blocks, about ``s²/2 + s·rows/2`` (``s²`` unblocked)."""
    return sum((e - a) * e for a, e in causal_blocks(s, rows))


@functools.lru_cache(maxsize=16)
def _block_bias(rows: int, repeats: int, s: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """Additive causal mask of a block of ``rows`` positions ending at position ``s``, ``[rows·repeats, s]`` (each
    position's row repeated for its ``repeats`` query heads): 0 where key ``j <= s − rows + i``, −inf above.
    A block ``[a, e)`` of ``c`` positions uses the view ``[(rows − c)·repeats:, s − e:]``."""
    with torch.inference_mode(False):  # cached: must stay usable outside inference mode
        position = torch.arange(s - rows, s, device=dev).repeat_interleave(repeats)  # [rows·repeats]
        keys = torch.arange(s, device=dev)
        bias = torch.zeros(rows * repeats, s, dtype=dtype, device=dev)
        return bias.masked_fill_(keys[None, :] > position[:, None], float("-inf"))


class _BlockCausalAttention(torch.autograd.Function):
    """Causal attention with explicit scores, ``rows`` query positions at a time: q ``[s, b, n, d]``,
    k/v ``[s, b, g, d]`` → ``[s, b, n, d]`` in q's dtype (autocast off inside).

    Per block ``[a, e)``: ``P = softmax(q kᵀ/√d + mask)`` against keys ``[0, e)``, ``out = dropout(P) v``. The
    ``n/g`` query heads of a kv group are the rows of one matrix (position-major, so a block is a row range): GQA
    needs no k/v copies. Saves the grouped q, k, v and each block's ``P`` (and ``dropout(P)``: its zeros are the
    dropped entries wherever ``P > 0``, and where ``P = 0`` the gradient is 0 either way). Backward is the softmax
    gradient of autograd (``_softmax_backward_data``) per block, so in fp32/fp64 it equals autograd through the
    same ops; 16-bit ``dk``/``dv`` are summed over the blocks in fp32.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                rows: int) -> torch.Tensor:
        s, b, n, d = q.shape
        g = k.shape[2]
        r = n // g
        with torch.autocast(q.device.type, enabled=False):
            k, v = k.to(q.dtype), v.to(q.dtype)
            q_rows = q.reshape(s, b, g, r, d).permute(1, 2, 0, 3, 4).reshape(b * g, s * r, d)  # a view when r = 1
            k_rows = k.permute(1, 2, 0, 3).reshape(b * g, s, d).contiguous()  # [b·g, s, d]
            v_rows = v.permute(1, 2, 0, 3).reshape(b * g, s, d).contiguous()
            bias = _block_bias(rows, r, s, q.dtype, q.device)
            out = torch.empty(s, b, n, d, dtype=q.dtype, device=q.device)
            saved: list[torch.Tensor] = []
            for a, e in causal_blocks(s, rows):
                c = e - a
                scores = torch.baddbmm(bias[(rows - c) * r:, s - e:], q_rows[:, a * r:e * r],
                                       k_rows[:, :e].transpose(1, 2), alpha=1.0 / math.sqrt(d))  # [b·g, c·r, e]
                probs = torch.softmax(scores, dim=-1)
                del scores
                kept = F.dropout(probs, dropout_p) if dropout_p > 0 else probs
                block = torch.bmm(kept, v_rows[:, :e])  # [b·g, c·r, d]
                out[a:e].view(c, b, g, r, d).copy_(block.view(b, g, c, r, d).permute(2, 0, 1, 3, 4))
                saved += [probs, kept] if dropout_p > 0 else [probs]
        ctx.save_for_backward(q_rows, k_rows, v_rows, *saved)
        ctx.shape, ctx.dropout_p, ctx.rows = (s, b, n, d, g), dropout_p, rows
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q_rows, k_rows, v_rows, *saved = ctx.saved_tensors
        s, b, n, d, g = ctx.shape
        r, p = n // g, ctx.dropout_p
        scale = 1.0 / math.sqrt(d)
        with torch.autocast(q_rows.device.type, enabled=False):
            dout_rows = dout.to(q_rows.dtype).reshape(s, b, g, r, d).permute(1, 2, 0, 3, 4).reshape(b * g, s * r, d)
            dq = torch.empty(s, b, n, d, dtype=q_rows.dtype, device=q_rows.device)
            # [b·g, s, d]; block [a, e) adds to keys [0, e): summed in fp32, as 16-bit sums would round once per block
            dk = torch.zeros_like(k_rows, dtype=compute_dtype(k_rows.dtype))
            dv = torch.zeros_like(v_rows, dtype=compute_dtype(v_rows.dtype))
            per_block = 2 if p > 0 else 1
            for i, (a, e) in enumerate(causal_blocks(s, ctx.rows)):
                c = e - a
                probs, kept = saved[per_block * i], saved[per_block * i + per_block - 1]
                block_dout = dout_rows[:, a * r:e * r]  # [b·g, c·r, d]
                # each product into a fresh tensor, then added: bmm into a strided slice runs matrix by matrix
                dv[:, :e] += torch.bmm(kept.transpose(1, 2), block_dout)
                grad_kept = torch.bmm(block_dout, v_rows[:, :e].transpose(1, 2))
                if p > 0:  # dropout's gradient: the kept entries, scaled by 1/(1 − p)
                    grad_kept.masked_fill_(kept == 0, 0.0).mul_(1.0 / (1.0 - p))
                grad_scores = torch._softmax_backward_data(grad_kept, probs, -1, probs.dtype)  # [b·g, c·r, e]
                del grad_kept
                block_dq = torch.bmm(grad_scores, k_rows[:, :e])  # [b·g, c·r, d]
                dq[a:e].view(c, b, g, r, d).copy_(block_dq.view(b, g, c, r, d).permute(2, 0, 1, 3, 4))
                dk[:, :e] += torch.bmm(grad_scores.transpose(1, 2), q_rows[:, a * r:e * r])
            dq.mul_(scale)
            dk = dk.mul_(scale).to(k_rows.dtype)
            dv = dv.to(v_rows.dtype)
        return dq, dk.view(b, g, s, d).permute(2, 0, 1, 3), dv.view(b, g, s, d).permute(2, 0, 1, 3), None, None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """torch's ``scaled_dot_product_attention`` on q ``[s, b, n, d]``, k/v ``[sk, b, g, d]`` (kv heads repeated on
    torch < 2.5, which lacks GQA) → ``[s, b, n, d]``."""
    n = q.shape[2]
    if k.shape[2] != n and not _SDPA_HAS_GQA:
        k, v = repeat_kv(k, n), repeat_kv(v, n)
    if k.shape[2] != n:
        kwargs["enable_gqa"] = True
    out_bnsd = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                              **kwargs)
    return out_bnsd.permute(2, 0, 1, 3)


def dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                          max_scores: int | None = None) -> torch.Tensor:
    """Causal softmax(q kᵀ / √d) v. q ``[s, b, n, d]``, k/v ``[s, b, g, d]`` with g | n → ``[s, b, n, d]``:
    flash-attn on CUDA (half precision, head dim <= 256); on CPU block-causal explicit scores
    (``_BlockCausalAttention``) in ``MATH_ATTENTION_DTYPES`` while ``b·n·s² <= max_scores`` (None:
    ``MATH_ATTENTION_MAX_SCORES``); else SDPA."""
    s, b, n, d = q.shape
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d <= 256:
        flash = device_mod.flash_attn_func()
        if flash is not None:
            out_bsnd = flash(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                             dropout_p=dropout_p, causal=True)  # [b, s, n, d]
            return out_bsnd.transpose(0, 1)
    if not q.is_cuda and k.shape[0] == s and block_kernel_runs(q.dtype, b, n, s, max_scores):
        return _BlockCausalAttention.apply(q, k, v, float(dropout_p), causal_block_rows(q.dtype))
    return _sdpa(q, k, v, dropout_p=dropout_p, is_causal=True)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_scores: int | None = None,
                     pad: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Attention of the new queries q ``[s, b, n, d]`` over cached + new keys k/v ``[past + s, b, g, d]``:
    query ``i`` sees keys ``0..past + i`` (bottom-right aligned, so not SDPA's top-left ``is_causal``; one new
    token needs no mask), the last ``window`` of them with a sliding window. → ``[s, b, n, d]``. The first call (no
    past, no window) is ``dot_product_attention`` with ``max_scores``. ``pad [b]``: sequence j is left-padded by
    ``pad[j]`` keys, which no other query sees (a padding query sees only itself, so its row stays finite)."""
    s, total = q.shape[0], k.shape[0]
    past = total - s
    windowed = bool(window) and total > window
    if pad is None and not windowed and past == 0:
        return dot_product_attention(q, k, v, 0.0, max_scores)
    if pad is None and not windowed and s == 1:
        return _sdpa(q, k, v)
    key_pos = torch.arange(total, device=q.device)
    query_pos = key_pos[past:, None]  # [s, 1]
    mask = key_pos <= query_pos  # [s, total], True = attend
    if windowed:
        mask &= key_pos > query_pos - window
    if pad is not None:
        mask = ((key_pos >= pad[:, None, None]) & mask | (key_pos == query_pos)).unsqueeze(1)  # [b, 1, s, total]
    return _sdpa(q, k, v, attn_mask=mask)
