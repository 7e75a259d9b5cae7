"""Fused attention kernels with log-sum-exp: torch's CPU flash op, flash-attn (dense and varlen) and torch's
memory-efficient CUDA kernel (dense and varlen), behind one calling convention.

Dense kernels take q ``[sq, b, n, d]``, k/v ``[sk, b, g, d]`` and return ``(out [sq, b, n, d], lse [b, n, sq])``;
varlen kernels take the rows of many pieces packed end to end, q ``[Tq, n, d]``, k/v ``[Tk, g, d]``, with a
``documents.Packed`` group (``cu_q``/``cu_k``, ``causal``), and return ``(out [Tq, n, d], lse [Tq, n])``.
Backward functions take the FINAL merged ``out``/``lse`` and return fp32 (fp64) ``(dq, dk, dv)``. The CUDA
ops are reached only through ``_flash_attn_ops``/``_efficient_ops``, so CPU tests can stand in for them
(``kernels`` checks the efficient kernel against explicit scores once per dtype before first use).
Theory: docs/attention.md.
"""
from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from megatron_sp import device as device_mod

log = logging.getLogger("megatron_sp")

FLASH_ATTN_MAX_HEAD_DIM = 256
HALF = (torch.float16, torch.bfloat16)
EFFICIENT_LSE_ALIGN = 32
"""torch's memory-efficient kernel pads the lse's query dimension to a multiple of this."""


# ---------------------------------------------------------------------------------- Helpers

def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 inputs, else fp32: the dtype of every out/lse/grad the kernels return."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a contiguous tensor of ``dtype``, copying at most once."""
    return x.contiguous() if x.dtype == dtype else x.to(dtype, memory_format=torch.contiguous_format)


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """kv ``[..., g, d]`` -> ``[..., n, d]``, each kv head repeated for its ``n/g`` query heads."""
    *lead, g, d = x.shape
    return x.unsqueeze(-2).expand(*lead, g, n // g, d).reshape(*lead, n, d)


def sum_kv(grad: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    """A kv gradient ``[..., n, d]`` over repeated heads -> contiguous ``[..., g, d]`` in ``dtype``."""
    *lead, n, d = grad.shape
    if n != g:
        grad = grad.to(dtype).reshape(*lead, g, n // g, d).sum(-2)
    return dense(grad, dtype)


def _bsnd(x: torch.Tensor) -> torch.Tensor:
    """``[s, b, h, d]`` <-> ``[b, s, h, d]``, contiguous (the CUDA kernels' layout)."""
    return x.transpose(0, 1).contiguous()


# ---------------------------------------------------------------------------------- CPU flash op

@functools.cache
def _cpu_flash_native_gqa() -> bool:
    """True when the CPU flash op takes fewer kv heads than query heads (pytorch#157893: 2.9+; no probe that
    might read out of bounds)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 9)


def _bnsd_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """kv ``[sk, b, g, d]`` -> ``[b, g, sk, d]`` view, or ``[b, n, sk, d]`` (repeated heads) when the op lacks GQA."""
    if x.shape[2] != n and not _cpu_flash_native_gqa():
        x = repeat_kv(x, n)
    return x.permute(1, 2, 0, 3)


def cpu_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = compute_dtype(q.dtype)
    n = q.shape[2]
    out_bnsd, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.permute(1, 2, 0, 3), _bnsd_kv(k, n), _bnsd_kv(v, n), 0.0, causal, scale=scale)
    return dense(out_bnsd.permute(2, 0, 1, 3), dtype), dense(lse, dtype)  # out keeps q's strides: mostly no copy


def cpu_flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The op wants dout/out in the input dtype and lse in its accumulation dtype. Every row of a
    # full/causal block sees a key of this block, so the final lse is finite on all of its rows.
    dtype = compute_dtype(q.dtype)
    n, g = q.shape[2], k.shape[2]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype).permute(1, 2, 0, 3), q.permute(1, 2, 0, 3), _bnsd_kv(k, n), _bnsd_kv(v, n),
        out.to(q.dtype).permute(1, 2, 0, 3), lse.to(dtype), 0.0, causal, scale=scale)
    return (dense(dq.permute(2, 0, 1, 3), dtype), sum_kv(dk.permute(2, 0, 1, 3), g, dtype),
            sum_kv(dv.permute(2, 0, 1, 3), g, dtype))


# -------------------------------------------------------------------- flash-attn (CUDA, optional)

@functools.cache
def _flash_attn_ops() -> SimpleNamespace | None:
    """flash-attn 2's private ``forward``/``backward``/``varlen_forward``/``varlen_backward``, or None (logged once)."""
    if device_mod.flash_attn_func() is None:
        return None
    try:
        from flash_attn import flash_attn_interface as fa  # type: ignore[import-not-found]
        return SimpleNamespace(forward=fa._flash_attn_forward, backward=fa._flash_attn_backward,
                               varlen_forward=fa._flash_attn_varlen_forward,
                               varlen_backward=fa._flash_attn_varlen_backward)
    except (ImportError, AttributeError) as exc:
        log.info("flash-attn has no usable low-level functions (%s); context-parallel attention uses torch's "
                 "memory-efficient kernel on GPU", exc)
        return None


def flash_attn_fits(q: torch.Tensor) -> bool:
    """flash-attn runs ``q``: installed, fp16/bf16 on CUDA, a head dim it takes unpadded (multiple of 8, <= 256)."""
    d = q.shape[-1]
    return (q.device.type == "cuda" and q.dtype in HALF and d % 8 == 0 and d <= FLASH_ATTN_MAX_HEAD_DIM
            and _flash_attn_ops() is not None)


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


def _flash_attn_result(result: Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a flash-attn forward: 2.7+ returns (out, lse, S_dmask, rng_state), older versions
    (out, q, k, v, out_padded, lse, S_dmask, rng_state)."""
    if len(result) not in (4, 8):
        raise RuntimeError(f"flash-attn {name} returned {len(result)} values; expected 4 or 8")
    return result[0], result[1 if len(result) == 4 else 5]


def flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    result = _flash_attn_call(_flash_attn_ops().forward, q=_bsnd(q), k=_bsnd(k), v=_bsnd(v), dropout_p=0.0,
                              softmax_scale=scale, causal=causal)
    out_bsnd, lse = _flash_attn_result(result, "_flash_attn_forward")
    return dense(out_bsnd.transpose(0, 1), torch.float32), dense(lse[..., :q.shape[0]], torch.float32)


def flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q_bsnd, k_bsnd, v_bsnd = _bsnd(q), _bsnd(k), _bsnd(v)
    dq, dk, dv = torch.empty_like(q_bsnd), torch.empty_like(k_bsnd), torch.empty_like(v_bsnd)  # written in place
    _flash_attn_call(_flash_attn_ops().backward, dout=_bsnd(dout.to(q.dtype)), q=q_bsnd, k=k_bsnd, v=v_bsnd,
                     out=_bsnd(out.to(q.dtype)), softmax_lse=dense(lse, torch.float32), dq=dq, dk=dk, dv=dv,
                     dropout_p=0.0, softmax_scale=scale, causal=causal)
    return tuple(dense(x.transpose(0, 1), torch.float32) for x in (dq, dk, dv))  # type: ignore[return-value]


@functools.cache
def _flash_attn_varlen_lse_padded(device: torch.device) -> bool:
    """True when this flash-attn's varlen lse is padded ``[P, n, max_q]`` (before 2.5.9), False for the packed
    ``[n, Tq]`` its backward then also expects; probed once with one token."""
    x = torch.zeros(1, 1, 8, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    result = _flash_attn_call(_flash_attn_ops().varlen_forward, q=x, k=x, v=x, cu_seqlens_q=cu, cu_seqlens_k=cu,
                              max_seqlen_q=1, max_seqlen_k=1, dropout_p=0.0, softmax_scale=1.0, causal=False)
    return _flash_attn_result(result, "_flash_attn_varlen_forward")[1].dim() == 3


def flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    result = _flash_attn_call(_flash_attn_ops().varlen_forward, q=q.contiguous(), k=k.contiguous(),
                              v=v.contiguous(), cu_seqlens_q=group.cu_q, cu_seqlens_k=group.cu_k,
                              max_seqlen_q=group.max_q, max_seqlen_k=group.max_k, dropout_p=0.0,
                              softmax_scale=scale, causal=group.causal)
    out, lse = _flash_attn_result(result, "_flash_attn_varlen_forward")
    lse = lse[group.q_seq, :, group.q_offset] if lse.dim() == 3 else lse.t()
    return dense(out, torch.float32), dense(lse, torch.float32)


def flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, group: Any,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # written in place
    padded = _flash_attn_varlen_lse_padded(q.device)
    lse = _pad_lse(lse, group, group.max_q) if padded else dense(lse.t(), torch.float32)  # the forward's layout
    _flash_attn_call(_flash_attn_ops().varlen_backward, dout=dout.to(q.dtype).contiguous(), q=q, k=k, v=v,
                     out=out.to(q.dtype).contiguous(), softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                     cu_seqlens_q=group.cu_q, cu_seqlens_k=group.cu_k,
                     max_seqlen_q=group.max_q, max_seqlen_k=group.max_k, dropout_p=0.0, softmax_scale=scale,
                     causal=group.causal)
    return dense(dq, torch.float32), dense(dk, torch.float32), dense(dv, torch.float32)


def _pad_lse(lse: torch.Tensor, group: Any, width: int) -> torch.Tensor:
    """Packed lse ``[Tq, n]`` -> fp32 ``[P, n, width]`` with row ``j`` of piece ``p`` at ``[p, :, j]``."""
    padded = lse.new_zeros(group.cu_q.shape[0] - 1, lse.shape[1], width, dtype=torch.float32)
    padded[group.q_seq, :, group.q_offset] = lse.float()
    return padded


# -------------------------------------------------- torch's memory-efficient kernel (CUDA; fp16/bf16/fp32)

def _efficient_ops() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(forward, backward)``: ``torch.ops.aten._efficient_attention_forward``/``_backward`` (CUDA kernels)."""
    return torch.ops.aten._efficient_attention_forward, torch.ops.aten._efficient_attention_backward


def _aligned(n: int) -> int:
    return -(-n // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN


def _efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: tuple | None, max_q: int, max_k: int,
               scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward call on ``[B, s, h, d]`` tensors (kv heads repeated: the op has no GQA)."""
    forward, _ = _efficient_ops()
    n = q.shape[2]
    out, lse, *_ = forward(q.contiguous(), repeat_kv(k, n).contiguous(), repeat_kv(v, n).contiguous(), None,
                           *(cu or (None, None)), max_q, max_k, 0.0, int(causal), True, scale=scale)
    return out, lse  # lse [B or P, n, aligned max_q], fp32


def _efficient_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse_padded: torch.Tensor, cu: tuple | None, max_q: int, max_k: int, scale: float,
                        causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, backward = _efficient_ops()
    n, g = q.shape[2], k.shape[2]
    no_dropout = torch.empty((), dtype=torch.long)  # philox seed/offset: unread without dropout
    dq, dk, dv, _ = backward(dout.to(q.dtype).contiguous(), q.contiguous(), repeat_kv(k, n).contiguous(),
                             repeat_kv(v, n).contiguous(), None, out.to(q.dtype).contiguous(), *(cu or (None, None)),
                             max_q, max_k, lse_padded.contiguous(), 0.0, no_dropout, no_dropout, int(causal), False,
                             scale=scale)
    dtype = compute_dtype(q.dtype)
    return dense(dq, dtype), sum_kv(dk, g, dtype), sum_kv(dv, g, dtype)


def efficient_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _efficient(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), None, q.shape[0], k.shape[0],
                          scale, causal)
    return dense(out.transpose(0, 1), torch.float32), dense(lse[..., :q.shape[0]], torch.float32)


def efficient_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sq, sk = q.shape[0], k.shape[0]
    lse_padded = torch.nn.functional.pad(lse.float(), (0, _aligned(sq) - sq))
    grads = _efficient_backward(dout.transpose(0, 1), q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                out.transpose(0, 1), lse_padded, None, sq, sk, scale, causal)
    return tuple(dense(x.transpose(0, 1), torch.float32) for x in grads)  # type: ignore[return-value]


def efficient_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _efficient(q[None], k[None], v[None], (group.cu_q, group.cu_k), group.max_q, group.max_k, scale,
                          group.causal)
    return dense(out[0], torch.float32), dense(lse[group.q_seq, :, group.q_offset], torch.float32)


def efficient_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, group: Any,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _efficient_backward(dout[None], q[None], k[None], v[None], out[None],
                                _pad_lse(lse, group, _aligned(group.max_q)), (group.cu_q, group.cu_k), group.max_q,
                                group.max_k, scale, group.causal)
    return tuple(x[0] for x in grads)  # type: ignore[return-value]
