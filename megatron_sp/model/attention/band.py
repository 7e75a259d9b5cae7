"""Sliding-window attention of a block whose queries are its keys, on contiguous chunks: no gathers, no scatters.

A block with ``q_pos == k_pos``, consecutive positions in every row and one document per row, under a window ``W``
shorter than it (``plan``), is cut into chunks of ``W`` rows (padded at the end to a multiple of ``W``). Query ``r``
of chunk ``m`` sees the keys ``<= r`` of chunk ``m`` (the CPU flash op's own top-left causal mask) and the keys
``j > r`` of chunk ``m − 1`` (the window bound): a strict upper triangle, which is the causal triangle of both chunks
read backwards (queries 1..W−1 against keys 0..W−2 of the reversed chunks). Each piece is one call of the CPU flash
op over every chunk at once, on views ``[chunks, W, b·h, d]`` (sample and head share the op's head dimension; GQA
maps query head ``b·n + i`` to kv head ``b·g + i·g/n`` as it should), merged by their lse. Work: about ``s·W``
scores (``s²/2`` for full causal); copies O(s): the reversed chunks of q, k, v (and out, dout in backward).
Details: docs/attention.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sp.model.attention import fused
from megatron_sp.model.attention.fused import compute_dtype, repeat_kv, sum_kv

BIG_LSE = 1e30
"""The lse of a padded query row in backward: its probabilities are exactly 0."""


@dataclass(frozen=True)
class Band:
    """The plan of a windowed block that ``forward``/``backward`` run on chunks of ``window`` rows."""

    window: int


def plan(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None, k_doc: torch.Tensor | None,
         window: int | None) -> Band | None:
    """A ``Band`` when the block fits this path (see the module), else None."""
    if not window or q_pos.shape[1] <= window or not torch.equal(q_pos, k_pos):
        return None
    if not bool((q_pos[:, 1:] == q_pos[:, :-1] + 1).all()):
        return None
    if q_doc is not None and not (torch.equal(q_doc, k_doc) and bool((q_doc == q_doc[:, :1]).all())):
        return None
    return Band(window)


def _chunks(x: torch.Tensor, w: int, pad: float = 0.0) -> torch.Tensor:
    """``[s, b, h, d]`` (or ``[s, b, h]``) → ``[s'/w, w, b·h, ...]``, padded with ``pad`` to ``s'``, a multiple of w."""
    s, b, h, *d = x.shape
    x = x.reshape(s, b * h, *d)
    if s % w:
        x = torch.cat([x, x.new_full((-s % w, b * h, *d), pad)])
    return x.view(-1, w, b * h, *d)


def _kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Chunked kv ``[m, w, b·g, d]`` for the op: repeated to ``b·n`` heads where it lacks GQA."""
    return x if fused._cpu_flash_native_gqa() or x.shape[2] == heads else repeat_kv(x, heads)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of chunked views ``[m, w, h, d]``: ``(out [m, w, h, d], lse [m, w, h])``."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), _kv(k, q.shape[2]).transpose(1, 2), _kv(v, q.shape[2]).transpose(1, 2), 0.0, True,
        scale=scale)
    return out.transpose(1, 2).to(compute_dtype(q.dtype)), lse.transpose(1, 2)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: Band,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [s, b, n, d], lse [b, n, s])`` in the compute dtype, as ``kernels.attention_forward``."""
    s, b, n, d = q.shape
    w = band.window
    qc, kc, vc = (_chunks(x, w) for x in (q, k, v))
    out, lse = _flash(qc, kc, vc, scale)  # each chunk against itself
    if w > 1:  # each chunk against the one before, read backwards; rows 0..w−2 of chunks 1.. see it
        o_band, l_band = _flash(qc.flip(1)[1:, 1:], kc.flip(1)[:-1, :-1], vc.flip(1)[:-1, :-1], scale)
        o_band, l_band = o_band.flip(1), l_band.flip(1)
        o_head, l_head = out[1:, :-1], lse[1:, :-1]  # views: merged in place
        new = torch.logaddexp(l_head, l_band)  # finite: every row sees itself
        o_head.copy_(o_head * torch.exp(l_head - new)[..., None] + o_band * torch.exp(l_band - new)[..., None])
        l_head.copy_(new)
    return (out.reshape(-1, b, n, d)[:s].contiguous(),
            lse.reshape(-1, b, n)[:s].permute(1, 2, 0).contiguous())


def _flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``_flash`` from the final out/lse, chunked ``[m, w, h, d]`` in the compute dtype."""
    dtype, n, g = compute_dtype(q.dtype), q.shape[2], k.shape[2]
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2), q.transpose(1, 2), _kv(k, n).transpose(1, 2), _kv(v, n).transpose(1, 2),
        out.transpose(1, 2), lse.transpose(1, 2), 0.0, True, scale=scale)
    dq, dk, dv = (x.transpose(1, 2) for x in grads)
    return dq.to(dtype), sum_kv(dk, g, dtype), sum_kv(dv, g, dtype)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, band: Band, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the compute dtype from the final ``out``/``lse``, as ``kernels.attention_backward``.
    Padded rows get zero ``dout``/``out`` and ``lse = BIG_LSE``: their gradients are exactly 0."""
    s, b, n, d = q.shape
    g, w, dtype = k.shape[2], band.window, compute_dtype(q.dtype)
    qc, kc, vc, dc, oc = (_chunks(x.to(q.dtype), w) for x in (q, k, v, dout, out))
    lc = _chunks(lse.to(dtype).permute(2, 0, 1), w, BIG_LSE)
    dq, dk, dv = _flash_backward(dc, qc, kc, vc, oc, lc, scale)
    if w > 1:
        rq, rk = (x.flip(1)[1:, 1:] for x in (dc, qc, oc, lc)), (x.flip(1)[:-1, :-1] for x in (kc, vc))
        (dout_r, q_r, out_r, lse_r), (k_r, v_r) = rq, rk
        gq, gk, gv = _flash_backward(dout_r, q_r, k_r, v_r, out_r, lse_r, scale)
        dq[1:, :-1] += gq.flip(1)
        dk[:-1, 1:] += gk.flip(1)
        dv[:-1, 1:] += gv.flip(1)
    return (dq.reshape(-1, b, n, d)[:s].contiguous(), dk.reshape(-1, b, g, d)[:s].contiguous(),
            dv.reshape(-1, b, g, d)[:s].contiguous())
