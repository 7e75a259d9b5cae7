"""Attention kernels with log-sum-exp, the building block of every context-parallel algorithm.

``attention_forward(q, k, v, q_pos, k_pos, ...) -> (out, lse)`` attends over one key block (fp32, fp64 for fp64
inputs), ``merge`` combines blocks exactly, ``attention_backward`` gives one block's gradients from the final
merged ``out``/``lse``. Masks come only from global token indices and document ids (``visible``); ``classify``
names a block's kind and ``kernel_for`` its kernel: ``reference`` (explicit scores, the oracle), ``cpu_flash``,
``flash_attn``, or ``documents`` for masked blocks. Pure tensor functions, no autograd. Layouts: q/out/dout
``[sq, b, n, d]``, k/v ``[sk, b, g, d]`` with ``g | n``, lse ``[b, n, sq]``. The layer's own causal kernels
(``dot_product_attention``; ``cached_attention`` for decoding) live here too. Theory: docs/attention.md.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from megatron_sp import device as device_mod
from megatron_sp.model.attention import documents

log = logging.getLogger("megatron_sp")

KINDS = ("empty", "full", "causal", "masked")
"""What ``classify`` returns, from cheapest to most general."""

KERNELS = ("reference", "cpu_flash", "flash_attn")
"""Kernel names accepted by ``kernel=``; ``None`` picks one per block (``kernel_for``)."""

FLASH_ATTN_MAX_HEAD_DIM = 256
_HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------- Masks

def _check_docs(q_doc: torch.Tensor | None, k_doc: torch.Tensor | None) -> bool:
    """True when document ids are given; both or neither must be."""
    if (q_doc is None) != (k_doc is None):
        raise ValueError("q_doc and k_doc must be given together (or both None for one document per sample)")
    return q_doc is not None


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None = None,
            k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """bool ``[b, sq, sk]``: key ``j`` is visible to query ``i`` iff ``k_pos[b, j] <= q_pos[b, i]`` and (no
    documents or ``q_doc[b, i] == k_doc[b, j]``). Positions: int64 global token indices ``[b, sq]``/``[b, sk]``
    (not rotary positions); documents: int64 ids of the same shapes, or None for one document per sample."""
    mask = k_pos[:, None, :] <= q_pos[:, :, None]  # [b, sq, sk]
    if _check_docs(q_doc, k_doc):
        mask &= q_doc[:, :, None] == k_doc[:, None, :]
    return mask


def classify(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None = None,
             k_doc: torch.Tensor | None = None) -> str:
    """The kind of the block's mask (``KINDS``, defined in docs/attention.md), decided from per-row min/max
    (O(s) per-document reductions when documents vary inside a row), never from the ``[sq, sk]`` mask."""
    has_docs = _check_docs(q_doc, k_doc)
    b, sq = q_pos.shape
    sk = k_pos.shape[1]
    if b == 0 or sq == 0 or sk == 0:
        return "empty"
    q_lo, q_hi = torch.aminmax(q_pos, dim=1)
    k_lo, k_hi = torch.aminmax(k_pos, dim=1)
    keys_after = k_lo > q_hi  # [b]: no key at or before any query of the row
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
    if bool((k_hi <= q_lo).all()):
        return "full"
    if sq == sk and torch.equal(q_pos, k_pos) and (sq == 1 or bool((q_pos[:, 1:] > q_pos[:, :-1]).all())):
        return "causal"
    return "masked"


# ---------------------------------------------------------------------------------- Helpers

def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 inputs, else fp32: the dtype of every out/lse/grad this module returns."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a contiguous tensor of ``dtype``, copying at most once."""
    return x.contiguous() if x.dtype == dtype else x.to(dtype, memory_format=torch.contiguous_format)


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
             kernel: str | None) -> tuple[str | None, bool, float]:
    """Tell the observers, check a block: its kernel (``kernel_for``; None for an empty block), whether it is
    causal, and its scale."""
    for callback in _BLOCK_OBSERVERS:
        callback(phase, q, k, q_pos, k_pos, q_doc, k_doc, kind)
    _check_shapes(q, k, v, q_pos, k_pos)
    if kind is None:
        kind = classify(q_pos, k_pos, q_doc, k_doc)
    elif kind not in KINDS:
        raise ValueError(f"attention: unknown block kind {kind!r}; expected one of {' | '.join(KINDS)}")
    if kind == "empty":
        return None, False, 0.0
    return kernel_for(kind, q, kernel), kind == "causal", q.shape[-1] ** -0.5 if scale is None else float(scale)


def kernel_for(kind: str, q: torch.Tensor, kernel: str | None = None) -> str:
    """The kernel that runs a block of ``kind`` for queries like ``q``: auto (docs/attention.md), or ``kernel``,
    which raises ``ValueError`` where it cannot compute the block exactly."""
    if kernel is None:
        if kind == "masked":
            return "documents"
        if q.device.type == "cpu":
            return "cpu_flash"
        if _flash_attn_fits(q) and _flash_attn_ops() is not None:
            return "flash_attn"
        return "reference"
    if kernel not in KERNELS:
        raise ValueError(f"attention: unknown kernel {kernel!r}; expected one of {' | '.join(KERNELS)}")
    if kernel != "reference" and kind == "masked":
        raise ValueError(f"attention: kernel {kernel!r} cannot apply a '{kind}' mask; use the reference kernel")
    if kernel == "cpu_flash" and q.device.type != "cpu":
        raise ValueError(f"attention: kernel 'cpu_flash' needs CPU tensors, got {q.device}")
    if kernel == "flash_attn" and (not _flash_attn_fits(q) or _flash_attn_ops() is None):
        raise ValueError(f"attention: kernel 'flash_attn' needs flash-attn on a GPU, fp16/bf16 inputs and a head dim that is "
                         f"a multiple of 8 up to {FLASH_ATTN_MAX_HEAD_DIM} (got {q.dtype}, d={q.shape[-1]})")
    return kernel


def _flash_attn_fits(q: torch.Tensor) -> bool:
    """fp16/bf16 on CUDA with a head dim flash-attn's low-level functions take unpadded (multiple of 8, <= 256)."""
    d = q.shape[-1]
    return q.device.type == "cuda" and q.dtype in _HALF and d % 8 == 0 and d <= FLASH_ATTN_MAX_HEAD_DIM


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
                      scale: float | None = None, kind: str | None = None,
                      kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over one key block: ``(out [sq, b, n, d], lse [b, n, sq])``, fp32 (fp64 for
    fp64 inputs) and contiguous, so callers ``merge`` without rounding; a row that sees no key: out 0, lse −inf.
    ``kind``: the ``classify`` result if the caller has it; ``kernel`` forces a kernel."""
    name, causal, scale = _prepare("forward", q, k, v, q_pos, k_pos, q_doc, k_doc, scale, kind, kernel)
    if name is None:
        return empty_result(q)
    with torch.autocast(q.device.type, enabled=False):  # the contract's fp32 out/lse, also inside autocast
        if name == "documents":
            return documents.forward(q, k, v, documents.plan(q_pos, k_pos, q_doc, k_doc), compute_dtype(q.dtype),
                                     lambda qs, ks, vs, causal: _dense_forward(qs, ks, vs, scale, causal))
        if name == "reference":
            return _reference_forward(q, k, v, visible(q_pos, k_pos, q_doc, k_doc), scale)
        return _dense_forward(q, k, v, scale, causal, name)


def _dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                   name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A full or causal block on kernel ``name`` (auto: ``kernel_for``)."""
    name = name or kernel_for("causal" if causal else "full", q)
    if name == "reference":
        return _reference_forward(q, k, v, _dense_mask(q, k, causal), scale)
    return (_cpu_flash_forward if name == "cpu_flash" else _flash_attn_forward)(q, k, v, scale, causal)


def _dense_mask(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """bool ``[b, sq, sk]``: everything, or the top-left lower triangle."""
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    return (mask.tril() if causal else mask).expand(q.shape[1], -1, -1)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None = None,
                       k_doc: torch.Tensor | None = None, *, scale: float | None = None, kind: str | None = None,
                       kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ONE key block given the FINAL ``out``/``lse`` over all key blocks: contiguous
    ``(dq [sq, b, n, d], dk [sk, b, g, d], dv [sk, b, g, d])`` in fp32 (fp64 for fp64 inputs), dk/dv summed over
    the query heads of each kv head. ``dq`` is this block's share (the caller sums over key blocks)."""
    name, causal, scale = _prepare("backward", q, k, v, q_pos, k_pos, q_doc, k_doc, scale, kind, kernel)
    dtype = compute_dtype(q.dtype)
    if name is None:
        return tuple(torch.zeros(x.shape, dtype=dtype, device=x.device) for x in (q, k, v))  # type: ignore[return-value]
    with torch.autocast(q.device.type, enabled=False):  # fp32 gradients from the fp32 lse, also inside autocast
        if name == "documents":
            return documents.backward(dout, q, k, v, out, lse, documents.plan(q_pos, k_pos, q_doc, k_doc), dtype,
                                      lambda *args: _dense_backward(*args, scale=scale))
        if name == "reference":
            return _reference_backward(dout, q, k, v, out, lse, visible(q_pos, k_pos, q_doc, k_doc), scale)
        return _dense_backward(dout, q, k, v, out, lse, causal, scale=scale, name=name)


def _dense_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, *, scale: float,
                    name: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    name = name or kernel_for("causal" if causal else "full", q)
    if name == "reference":
        return _reference_backward(dout, q, k, v, out, lse, _dense_mask(q, k, causal), scale)
    return (_cpu_flash_backward if name == "cpu_flash" else _flash_attn_backward)(dout, q, k, v, out, lse, scale, causal)


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


# ---------------------------------------------------------------------------------- CPU flash kernel

@functools.cache
def _cpu_flash_native_gqa() -> bool:
    """True when the CPU flash op takes fewer kv heads than query heads (pytorch#157893: 2.9+; no probe that
    might read out of bounds)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 9)


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """kv ``[sk, b, g, d]`` -> ``[sk, b, n, d]``, each kv head repeated for its ``n/g`` query heads."""
    sk, b, g, d = x.shape
    return x[:, :, :, None].expand(sk, b, g, n // g, d).reshape(sk, b, n, d)


def _bnsd_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """kv ``[sk, b, g, d]`` -> ``[b, g, sk, d]`` view, or ``[b, n, sk, d]`` (repeated heads) when the op lacks GQA."""
    if x.shape[2] != n and not _cpu_flash_native_gqa():
        x = _repeat_kv(x, n)
    return x.permute(1, 2, 0, 3)


def _kv_grad(grad_bnsd: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    """The op's dk/dv ``[b, g or n, sk, d]`` -> contiguous ``[sk, b, g, d]`` in ``dtype`` (repeated heads summed)."""
    b, heads, sk, d = grad_bnsd.shape
    if heads != g:
        grad_bnsd = grad_bnsd.to(dtype).reshape(b, g, heads // g, sk, d).sum(2)
    return _dense(grad_bnsd.permute(2, 0, 1, 3), dtype)


def _cpu_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = compute_dtype(q.dtype)
    n = q.shape[2]
    out_bnsd, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.permute(1, 2, 0, 3), _bnsd_kv(k, n), _bnsd_kv(v, n), 0.0, causal, scale=scale)
    return _dense(out_bnsd.permute(2, 0, 1, 3), dtype), _dense(lse, dtype)  # out keeps q's strides: mostly no copy


def _cpu_flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The op wants dout/out in the input dtype and lse in its accumulation dtype. Every row of a
    # full/causal block sees a key of this block, so the final lse is finite on all of its rows.
    dtype = compute_dtype(q.dtype)
    n, g = q.shape[2], k.shape[2]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype).permute(1, 2, 0, 3), q.permute(1, 2, 0, 3), _bnsd_kv(k, n), _bnsd_kv(v, n),
        out.to(q.dtype).permute(1, 2, 0, 3), lse.to(dtype), 0.0, causal, scale=scale)
    return _dense(dq.permute(2, 0, 1, 3), dtype), _kv_grad(dk, g, dtype), _kv_grad(dv, g, dtype)


# -------------------------------------------------------------------- flash-attn kernel (CUDA, optional)

@functools.cache
def _flash_attn_ops() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """flash-attn 2's private ``(_flash_attn_forward, _flash_attn_backward)``, or None (logged once)."""
    if device_mod.flash_attn_func() is None:
        return None
    try:
        from flash_attn import flash_attn_interface  # type: ignore[import-not-found]
        return flash_attn_interface._flash_attn_forward, flash_attn_interface._flash_attn_backward
    except (ImportError, AttributeError) as exc:
        log.info("flash-attn has no usable _flash_attn_forward/_flash_attn_backward (%s); "
                 "context-parallel attention uses the reference kernel on GPU", exc)
        return None


def _flash_attn_call(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """Call a flash-attn 2.x low-level function by keyword, filling the arguments its versions differ in (2.3
    ``window_size``, 2.4 ``alibi_slopes``/``deterministic``, 2.6 ``softcap``, 2.7+ split windows and ``_init_fn``)."""
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    if "window_size_left" in params:
        kwargs.update(window_size_left=-1, window_size_right=-1)
    elif "window_size" in params:
        kwargs["window_size"] = (-1, -1)
    for name, value in (("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_softmax", False)):
        if name in params:
            kwargs[name] = value
    return fn(**kwargs)


def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    forward, _ = _flash_attn_ops()
    sq = q.shape[0]
    result = _flash_attn_call(forward, q=q.transpose(0, 1).contiguous(), k=k.transpose(0, 1).contiguous(),
                              v=v.transpose(0, 1).contiguous(), dropout_p=0.0, softmax_scale=scale, causal=causal)
    # 2.7+: (out, lse, S_dmask, rng_state); before: (out, q, k, v, out_padded, lse, S_dmask, rng_state).
    if len(result) not in (4, 8):
        raise RuntimeError(f"flash-attn _flash_attn_forward returned {len(result)} values; expected 4 or 8")
    out_bsnd, lse = result[0], result[1 if len(result) == 4 else 5]
    dtype = compute_dtype(q.dtype)
    return _dense(out_bsnd.transpose(0, 1), dtype), _dense(lse[..., :sq], dtype)


def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, backward = _flash_attn_ops()
    q_bsnd, k_bsnd, v_bsnd = (x.transpose(0, 1).contiguous() for x in (q, k, v))
    dq, dk, dv = torch.empty_like(q_bsnd), torch.empty_like(k_bsnd), torch.empty_like(v_bsnd)  # written in place
    _flash_attn_call(backward, dout=dout.to(q.dtype).transpose(0, 1).contiguous(), q=q_bsnd, k=k_bsnd, v=v_bsnd,
                     out=out.to(q.dtype).transpose(0, 1).contiguous(), softmax_lse=_dense(lse, torch.float32),
                     dq=dq, dk=dk, dv=dv, dropout_p=0.0, softmax_scale=scale, causal=causal)
    return tuple(_dense(x.transpose(0, 1), torch.float32) for x in (dq, dk, dv))  # type: ignore[return-value]


# ------------------------------------------ the layer's causal kernel (no LSE), and cached_attention for decoding

MATH_ATTENTION_MAX_SCORES = 1 << 24
"""CPU attention in ``MATH_ATTENTION_DTYPES`` materialises the scores when ``b · n · s²`` is at most this
(faster than the CPU flash kernel in bf16, at most 32 MiB of probabilities per layer; docs/attention.md).
0: always SDPA."""

_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)

MATH_ATTENTION_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
"""Dtypes for which the explicit-scores CPU kernel is used (see ``MATH_ATTENTION_MAX_SCORES``)."""


@functools.lru_cache(maxsize=16)
def _causal_bias(s: int, repeats: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """Additive causal mask ``[repeats·s, s]``: 0 where key j <= query i, -inf above the diagonal."""
    with torch.inference_mode(False):  # cached: must stay usable outside inference mode
        bias = torch.full((s, s), float("-inf"), dtype=dtype, device=dev).triu(1)
        return bias.repeat(repeats, 1)


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal attention with explicit scores; q ``[s, b, n, d]``, k/v ``[s, b, g, d]`` → ``[s, b, n, d]``.
    The ``n / g`` query heads of a group are stacked along the rows, so GQA needs no k/v copies."""
    s, b, n, d = q.shape
    g = k.shape[2]
    r = n // g
    q_grouped = q.permute(1, 2, 0, 3).reshape(b * g, r * s, d)  # [b·g, r·s, d]
    k_grouped = k.permute(1, 2, 0, 3).reshape(b * g, s, d)  # [b·g, s, d]
    v_grouped = v.permute(1, 2, 0, 3).reshape(b * g, s, d)  # [b·g, s, d]
    bias = _causal_bias(s, r, q.dtype, q.device)  # [r·s, s]
    scores = torch.baddbmm(bias, q_grouped, k_grouped.transpose(1, 2), alpha=1.0 / math.sqrt(d))  # [b·g, r·s, s]
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    out = torch.bmm(probs.to(v_grouped.dtype), v_grouped)  # [b·g, r·s, d]
    return out.view(b, n, s, d).permute(2, 0, 1, 3)  # [s, b, n, d]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """torch's ``scaled_dot_product_attention`` on q ``[s, b, n, d]``, k/v ``[sk, b, g, d]`` (kv heads repeated on
    torch < 2.5, which lacks GQA) → ``[s, b, n, d]``."""
    n = q.shape[2]
    if k.shape[2] != n and not _SDPA_HAS_GQA:
        k, v = _repeat_kv(k, n), _repeat_kv(v, n)
    if k.shape[2] != n:
        kwargs["enable_gqa"] = True
    out_bnsd = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                              **kwargs)
    return out_bnsd.permute(2, 0, 1, 3)


def dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal softmax(q kᵀ / √d) v. q ``[s, b, n, d]``, k/v ``[s, b, g, d]`` with g | n → ``[s, b, n, d]``:
    flash-attn on CUDA (half precision, head dim <= 256), explicit scores on CPU for short bf16 sequences
    (``MATH_ATTENTION_MAX_SCORES``), else SDPA."""
    s, b, n, d = q.shape
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d <= 256:
        flash = device_mod.flash_attn_func()
        if flash is not None:
            out_bsnd = flash(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                             dropout_p=dropout_p, causal=True)  # [b, s, n, d]
            return out_bsnd.transpose(0, 1)
    if (not q.is_cuda and q.dtype in MATH_ATTENTION_DTYPES and k.shape[0] == s
            and b * n * s * s <= MATH_ATTENTION_MAX_SCORES):
        return _math_attention(q, k, v, dropout_p)
    return _sdpa(q, k, v, dropout_p=dropout_p, is_causal=True)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of the new queries q ``[s, b, n, d]`` over cached + new keys k/v ``[past + s, b, g, d]``:
    query ``i`` sees keys ``0..past + i`` (bottom-right aligned, so not SDPA's top-left ``is_causal``; one new
    token needs no mask). → ``[s, b, n, d]``."""
    s = q.shape[0]
    total = k.shape[0]
    past = total - s
    if past == 0:
        return dot_product_attention(q, k, v, 0.0)
    mask = None
    if s > 1:
        key_pos = torch.arange(total, device=q.device)
        query_pos = torch.arange(past, total, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [s, past + s], True = attend
    return _sdpa(q, k, v, attn_mask=mask)
