"""The CUDA attention paths (``attention.fused``) on CPU, against stand-ins for the CUDA ops.

flash-attn's low-level functions (dense and varlen, three 2.x generations: padded or packed varlen lse, 8 or 4
return values, window/softcap arguments) and torch's ``_efficient_attention_forward``/``_backward`` are
replaced by fp64 CPU implementations of their documented contracts, which assert the layouts, dtypes and
arguments they are given. Our wrappers, the packed-document plan and the efficient kernel's self-check must
then match the fp64 oracle. The real kernels run in the ``gpu``-marked tests.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from megatron_sp.model.attention import documents, fused, kernels
from megatron_sp.model.attention.kernels import attention_backward, attention_forward, visible

from test_attention_documents import SAMPLES, cuts, err, packed_block
from test_attention_kernels import D, HEADS, block, lse_err, make_qkv, oracle, rel_err

ALIGN = 32


# ---------------------------------------------------------------------------------- fp64 attention on one piece

def _scores(q, k, scale, causal, top_left):
    """fp64 scores ``[n, Lq, Lk]`` of q ``[Lq, n, d]`` over k ``[Lk, g, d]`` (kv heads repeated), masked."""
    n, g = q.shape[1], k.shape[1]
    assert n % g == 0
    s = torch.einsum("qnd,knd->nqk", q.double(), k.double().repeat_interleave(n // g, 1)) * scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        shift = 0 if top_left else lk - lq
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + shift
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def attend(q, k, v, scale, causal, top_left=False):
    """out ``[Lq, n, d]`` in q's dtype and lse ``[n, Lq]`` fp32."""
    s = _scores(q, k, scale, causal, top_left)
    lse = torch.logsumexp(s, -1)
    n, g = q.shape[1], k.shape[1]
    out = torch.einsum("nqk,knd->qnd", torch.exp(s - lse[..., None]), v.double().repeat_interleave(n // g, 1))
    return out.to(q.dtype), lse.float()


def attend_grad(dout, q, k, v, out, lse, scale, causal, top_left=False):
    """dq, dk, dv (kv gradients summed over the repeated heads) from the given final out/lse ``[n, Lq]``."""
    n, g = q.shape[1], k.shape[1]
    kr, vr = (x.double().repeat_interleave(n // g, 1) for x in (k, v))
    p = torch.exp(_scores(q, k, scale, causal, top_left) - lse.double()[..., None])
    do = dout.double()
    delta = (do * out.double()).sum(-1).t()[..., None]  # [n, Lq, 1]
    ds = p * (torch.einsum("qnd,knd->nqk", do, vr) - delta)
    dq = torch.einsum("nqk,knd->qnd", ds, kr) * scale
    dk = torch.einsum("nqk,qnd->knd", ds, q.double()) * scale
    dv = torch.einsum("nqk,qnd->knd", p, do)
    lk = k.shape[0]
    return (dq.to(q.dtype), dk.reshape(lk, g, n // g, -1).sum(2).to(k.dtype),
            dv.reshape(lk, g, n // g, -1).sum(2).to(v.dtype))


def _spans(cu_q, cu_k):
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.shape == cu_k.shape
    return list(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()))


# ---------------------------------------------------------------------------------- flash-attn stand-ins

def fake_flash_attn(generation: str) -> SimpleNamespace:
    """flash-attn's ``_flash_attn_(varlen_)forward/backward`` with the signatures of three 2.x generations:
    2.2 (8 return values, padded varlen lse ``[P, n, max_q]``), 2.6 (window_size tuple, softcap, alibi,
    deterministic; packed lse ``[n, Tq]`` since 2.5.9), 2.7 (torch custom ops: split windows, 4 return values)."""
    padded = generation == "2.2"

    def dense_fwd(q, k, v, dropout_p, softmax_scale, causal, **extra):
        assert dropout_p == 0.0 and all(x.is_contiguous() for x in (q, k, v))
        outs, lses = zip(*(attend(q[i], k[i], v[i], softmax_scale, causal) for i in range(q.shape[0])))
        return torch.stack(outs), torch.stack(lses)  # [b, s, n, d], [b, n, sq]

    def dense_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, **extra):
        assert softmax_lse.dtype == torch.float32 and out.dtype == q.dtype
        for i in range(q.shape[0]):
            for buf, grad in zip((dq, dk, dv), attend_grad(dout[i], q[i], k[i], v[i], out[i], softmax_lse[i],
                                                           softmax_scale, causal)):
                buf[i] = grad

    def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, **extra):
        assert dropout_p == 0.0 and q.dim() == 3 and all(x.is_contiguous() for x in (q, k, v))
        spans = _spans(cu_seqlens_q, cu_seqlens_k)
        assert max_seqlen_q == max(b - a for a, b, _, _ in spans) and max_seqlen_k == max(d - c for _, _, c, d in spans)
        out = torch.empty_like(q)
        lse = torch.full((len(spans), q.shape[1], max_seqlen_q) if padded else (q.shape[1], q.shape[0]), float("inf"))
        for p, (q0, q1, k0, k1) in enumerate(spans):
            out[q0:q1], piece_lse = attend(q[q0:q1], k[k0:k1], v[k0:k1], softmax_scale, causal)
            if padded:
                lse[p, :, :q1 - q0] = piece_lse
            else:
                lse[:, q0:q1] = piece_lse
        return out, lse

    def varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, **extra):
        spans = _spans(cu_seqlens_q, cu_seqlens_k)
        want = (len(spans), q.shape[1], max_seqlen_q) if padded else (q.shape[1], q.shape[0])
        assert tuple(softmax_lse.shape) == want and softmax_lse.dtype == torch.float32, softmax_lse.shape
        for p, (q0, q1, k0, k1) in enumerate(spans):
            lse = softmax_lse[p, :, :q1 - q0] if padded else softmax_lse[:, q0:q1]
            grads = attend_grad(dout[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1], lse, softmax_scale, causal)
            for buf, grad, (a, b) in zip((dq, dk, dv), grads, ((q0, q1), (k0, k1), (k0, k1))):
                buf[a:b] = grad

    def returns(fn):  # 8 values before 2.7: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
        def wrapped(*args, **kwargs):
            out, lse = fn(*args, **kwargs)
            return (out, lse, None, None) if generation == "2.7" else (out, None, None, None, out, lse, None, None)
        return wrapped

    if generation == "2.2":  # no window, no softcap
        def fwd(q, k, v, dropout_p, softmax_scale, causal, return_softmax):
            return returns(dense_fwd)(q, k, v, dropout_p, softmax_scale, causal)

        def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, rng_state=None):
            dense_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal)

        def vfwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                 return_softmax, zero_tensors=False):
            return returns(varlen_fwd)(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                       softmax_scale, causal)

        def vbwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 dropout_p, softmax_scale, causal, rng_state=None, zero_tensors=False):
            varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, dropout_p, softmax_scale, causal)
        return SimpleNamespace(forward=fwd, backward=bwd, varlen_forward=vfwd, varlen_backward=vbwd)

    def check(extra):
        windows = (extra.pop("window_size_left"), extra.pop("window_size_right")) if generation == "2.7" \
            else tuple(extra.pop("window_size"))
        assert windows == (-1, -1) and extra.pop("softcap") == 0.0 and extra.pop("alibi_slopes") is None
        extra.pop("deterministic", None)
        extra.pop("return_softmax", None)
        assert not extra, extra

    class Op:  # 2.7+: torch.library custom ops, the Python signature on _init_fn; 2.6: plain functions
        def __init__(self, fn, signature):
            self.fn = fn
            self._init_fn = signature

        def __call__(self, **kwargs):
            extra = {name: kwargs.pop(name) for name in list(kwargs) if name in EXTRA}
            check(extra)
            return self.fn(**kwargs)

    EXTRA = {"window_size", "window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic",
             "return_softmax"}
    window = "window_size_left, window_size_right" if generation == "2.7" else "window_size"
    common = f"{window}, softcap, alibi_slopes"
    signatures = {
        "forward": f"q, k, v, dropout_p, softmax_scale, causal, {common}, return_softmax",
        "backward": f"dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, {common}, "
                    "deterministic, rng_state=None",
        "varlen_forward": "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, "
                          f"softmax_scale, causal, {common}, return_softmax, block_table=None",
        "varlen_backward": "dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
                           f"max_seqlen_k, dropout_p, softmax_scale, causal, {common}, deterministic, rng_state=None",
    }
    impls = {"forward": returns(dense_fwd), "backward": dense_bwd, "varlen_forward": returns(varlen_fwd),
             "varlen_backward": varlen_bwd}
    ops = {}
    for name, params in signatures.items():
        namespace: dict = {}
        exec(f"def signature({params}): pass", namespace)  # only inspect.signature reads it
        ops[name] = Op(impls[name], namespace["signature"])
    return SimpleNamespace(**ops)


@pytest.fixture
def flash(monkeypatch: pytest.MonkeyPatch):
    def install(generation: str) -> None:
        monkeypatch.setattr(fused, "_flash_attn_ops", lambda: fake_flash_attn(generation))
        fused._flash_attn_varlen_lse_padded.cache_clear()
    yield install
    fused._flash_attn_varlen_lse_padded.cache_clear()


# ---------------------------------------------------------------------------------- torch efficient stand-ins

def fake_efficient_ops(lse_scale: float = 1.0):
    """``_efficient_attention_forward``/``_backward`` as documented in torch's meta registrations: [B, M, H, K]
    inputs with equal heads, cu_seqlens only with B = 1, lse fp32 ``[B or P, H, ceil32(max_q)]``, mask type 0
    (none) or 1 (causal from the top left). ``lse_scale`` != 1 makes a broken kernel."""
    def spans(query, key, cu_q, cu_k):
        if cu_q is None:
            return [(b, 0, query.shape[1], 0, key.shape[1]) for b in range(query.shape[0])]
        assert query.shape[0] == 1
        return [(0, *span) for span in _spans(cu_q, cu_k)]

    def forward(query, key, value, bias, cu_q, cu_k, max_q, max_k, dropout_p, custom_mask_type,
                compute_log_sumexp=False, *, scale=None):
        assert bias is None and dropout_p == 0.0 and compute_log_sumexp and custom_mask_type in (0, 1)
        assert query.shape[2] == key.shape[2] == value.shape[2], "no GQA in the efficient kernel"
        assert all(x.is_contiguous() for x in (query, key, value))
        pieces = spans(query, key, cu_q, cu_k)
        width = max_q if cu_q is not None else query.shape[1]
        out = torch.empty_like(query)
        lse = torch.full((len(pieces), query.shape[2], -(-width // ALIGN) * ALIGN), float("inf"))
        for p, (b, q0, q1, k0, k1) in enumerate(pieces):
            out[b, q0:q1], piece_lse = attend(query[b, q0:q1], key[b, k0:k1], value[b, k0:k1], scale,
                                              custom_mask_type == 1, top_left=True)
            lse[p, :, :q1 - q0] = piece_lse * lse_scale
        return out, lse, torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long), max_q, max_k

    def backward(grad_out, query, key, value, bias, out, cu_q, cu_k, max_q, max_k, logsumexp, dropout_p, seed, offset,
                 custom_mask_type, bias_requires_grad, *, scale=None):
        assert bias is None and not bias_requires_grad and dropout_p == 0.0 and custom_mask_type in (0, 1)
        pieces = spans(query, key, cu_q, cu_k)
        assert tuple(logsumexp.shape) == (len(pieces), query.shape[2], -(-max_q // ALIGN) * ALIGN)
        assert logsumexp.dtype == torch.float32 and grad_out.dtype == out.dtype == query.dtype
        grads = [torch.zeros_like(x) for x in (query, key, value)]
        for p, (b, q0, q1, k0, k1) in enumerate(pieces):
            piece = attend_grad(grad_out[b, q0:q1], query[b, q0:q1], key[b, k0:k1], value[b, k0:k1], out[b, q0:q1],
                                logsumexp[p, :, :q1 - q0], scale, custom_mask_type == 1, top_left=True)
            for buf, grad, (a, z) in zip(grads, piece, ((q0, q1), (k0, k1), (k0, k1))):
                buf[b, a:z] = grad
        return (*grads, torch.empty(()))
    return lambda: (forward, backward)


# ---------------------------------------------------------------------------------- tests

def _dense_errors(forward, backward, name: str, heads=HEADS["gqa"]) -> tuple[float, ...]:
    q_pos, k_pos, _, _ = block(name)
    q, k, v, dout = make_qkv(q_pos.shape[1], k_pos.shape[1], heads, torch.float32)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = oracle(q, k, v, dout, visible(q_pos, k_pos))
    out, lse = forward(q, k, v, D ** -0.5, name == "causal")
    dq, dk, dv = backward(dout, q, k, v, out, lse, D ** -0.5, name == "causal")
    assert out.shape == q.shape and lse.shape == (2, q.shape[2], q.shape[0]) and dk.shape == k.shape
    assert all(x.dtype == torch.float32 and x.is_contiguous() for x in (out, lse, dq, dk, dv))
    return rel_err(out, ref_out), lse_err(lse, ref_lse), rel_err(dq, ref_dq), rel_err(dk, ref_dk), rel_err(dv, ref_dv)


def _document_errors(kernel: str, sample: str, cut: str, heads=HEADS["gqa"]) -> tuple[float, ...] | None:
    """The document path with ``kernel``'s varlen runners on one packed block, against the oracle."""
    q_pos, k_pos, q_doc, k_doc = packed_block(sample, cut)
    if kernels.classify(q_pos, k_pos, q_doc, k_doc) != "masked":
        return None
    q, k, v, dout = make_qkv(q_pos.shape[1], k_pos.shape[1], heads, torch.float32, seed=len(cut))
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = oracle(q, k, v, dout, visible(q_pos, k_pos, q_doc, k_doc))
    groups = documents.plan(q_pos, k_pos, q_doc, k_doc, packed=True)
    assert all(isinstance(group, documents.Packed) for group in groups)
    run_forward, run_backward = kernels._document_runners(kernel, D ** -0.5)
    out, lse = documents.forward(q, k, v, groups, torch.float32, run_forward)
    dq, dk, dv = documents.backward(dout, q, k, v, out, lse, groups, torch.float32, run_backward)
    return err(out, ref_out), lse_err(lse, ref_lse), err(dq, ref_dq), err(dk, ref_dk), err(dv, ref_dv)


@pytest.mark.parametrize("generation", ["2.2", "2.6", "2.7"])
def test_flash_attn_calling_conventions(flash, generation: str) -> None:
    """Dense and varlen flash-attn: argument filling, result unpacking, lse layouts (probed), against the oracle."""
    flash(generation)
    for name in ("full", "causal"):
        assert max(_dense_errors(fused.flash_attn_forward, fused.flash_attn_backward, name)) <= 1e-5
    assert fused._flash_attn_varlen_lse_padded(torch.device("cpu")) == (generation == "2.2")
    for sample in ("random", "length_one_docs", "one_per_token"):
        for cut in ("local", "zigzag_pair", "llama3_zigzag"):
            errors = _document_errors("flash_attn", sample, cut)
            assert errors is None or max(errors) <= 1e-5, (sample, cut, errors)


@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_efficient_kernel_dense_and_packed(monkeypatch: pytest.MonkeyPatch, heads: tuple[int, int]) -> None:
    """torch's memory-efficient kernel: dense blocks (lse padded to 32 and cut back) and packed documents
    (cu_seqlens, lse ``[P, n, ceil32(max_q)]`` gathered per row and scattered back for backward)."""
    monkeypatch.setattr(fused, "_efficient_ops", fake_efficient_ops())
    for name in ("full", "causal"):
        assert max(_dense_errors(fused.efficient_forward, fused.efficient_backward, name, heads)) <= 1e-5
    checked = 0
    for sample in SAMPLES:
        for cut in cuts():
            errors = _document_errors("efficient", sample, cut, heads)
            assert errors is None or max(errors) <= 2e-5, (sample, cut, errors)
            checked += errors is not None
    assert checked >= 30


def test_efficient_self_check_accepts_a_correct_kernel_and_rejects_a_wrong_one(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    check = kernels._efficient_check  # uncached: the check itself, on CPU stand-ins
    monkeypatch.setattr(fused, "_efficient_ops", fake_efficient_ops())
    with caplog.at_level(logging.INFO, logger="megatron_sp"):
        assert check(torch.device("cpu"), torch.float32)
    assert "memory-efficient kernel" in caplog.text
    caplog.clear()
    monkeypatch.setattr(fused, "_efficient_ops", fake_efficient_ops(lse_scale=1 / 0.6931471805599453))  # log2 lse
    with caplog.at_level(logging.INFO, logger="megatron_sp"):
        assert not check(torch.device("cpu"), torch.float32)
    assert "failed its check" in caplog.text and "explicit scores" in caplog.text

    def missing(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::_efficient_attention_forward' with arguments from the 'CPU' "
                                  "backend")
    monkeypatch.setattr(fused, "_efficient_ops", lambda: (missing, missing))
    assert not check(torch.device("cpu"), torch.float32)


def test_packed_plan_covers_exactly_the_visible_pairs() -> None:
    """Every visible (query, key) pair is in exactly one packed piece; cu_seqlens, max lengths and each row's
    piece/offset agree with the rows; a group never holds a query row twice."""
    for sample in SAMPLES:
        for cut in cuts():
            q_pos, k_pos, q_doc, k_doc = packed_block(sample, cut)
            b, sq = q_pos.shape
            covered = torch.zeros(b, sq, k_pos.shape[1], dtype=torch.int64)
            for group in documents.plan(q_pos, k_pos, q_doc, k_doc, packed=True):
                assert group.q_index.unique().numel() == group.q_index.numel()
                lengths_q, lengths_k = torch.diff(group.cu_q), torch.diff(group.cu_k)
                assert group.max_q == int(lengths_q.max()) and group.max_k == int(lengths_k.max())
                assert group.cu_q[-1] == group.q_index.numel() and group.cu_k[-1] == group.k_index.numel()
                assert torch.equal(group.cu_q[group.q_seq].long() + group.q_offset, torch.arange(group.q_index.numel()))
                for q0, q1, k0, k1 in _spans(group.cu_q, group.cu_k):
                    for i, qr in enumerate(group.q_index[q0:q1].tolist()):
                        for j, kr in enumerate(group.k_index[k0:k1].tolist()):
                            if group.causal and j > i:
                                continue
                            assert qr % b == kr % b
                            covered[qr % b, qr // b, kr // b] += 1
            assert torch.equal(covered, visible(q_pos, k_pos, q_doc, k_doc).long()), (sample, cut)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("sample", ["random", "one_per_token"])
def test_gpu_document_blocks_match_reference(sample: str, dtype: torch.dtype) -> None:
    """On a GPU: packed-document blocks on the auto kernel (flash-attn varlen or torch's efficient kernel) equal
    the explicit-scores kernel on the same inputs."""
    for cut in ("local", "zigzag_pair", "llama3_zigzag"):
        q_pos, k_pos, q_doc, k_doc = (x.cuda() for x in packed_block(sample, cut))
        q, k, v, dout = (x.cuda() for x in make_qkv(q_pos.shape[1], k_pos.shape[1], HEADS["gqa"], dtype))
        args = (q_pos, k_pos, q_doc, k_doc)
        assert kernels.piece_kernel(q) in ("flash_attn", "efficient"), "no fused kernel passed its check"
        ref = attention_forward(q, k, v, *args, kernel="reference")
        ref_grads = attention_backward(dout, q, k, v, *ref, *args, kernel="reference")
        out, lse = attention_forward(q, k, v, *args)
        grads = attention_backward(dout, q, k, v, out, lse, *args)
        bound = 3e-2 if dtype == torch.bfloat16 else 1e-4
        for got, want in zip((out, lse, *grads), (*ref, *ref_grads)):
            assert err(got.cpu(), want.double().cpu()) <= bound


def test_efficient_self_check_ignores_the_callers_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first block may arrive inside bf16 autocast (training): the check must still compare in fp32."""
    monkeypatch.setattr(fused, "_efficient_ops", fake_efficient_ops())
    kernels._efficient_checked.cache_clear()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert kernels._efficient_checked(torch.device("cpu"), torch.float32)
    finally:
        kernels._efficient_checked.cache_clear()
