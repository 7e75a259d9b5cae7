"""Attention kernels with LSE (``megatron_sp.model.attention.kernels``) against an fp64 autograd oracle.

The oracle is plain masked softmax attention on the full q/k/v, with kv heads repeated for GQA
and gradients from ``torch.autograd``: it shares no code with the kernels.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from megatron_sp.model.attention import fused, kernels
from megatron_sp.model.attention.kernels import attention_backward, attention_forward, classify, merge, visible

NEG_INF = float("-inf")
D = 8
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}  # (query heads n, kv heads g)

# bf16 inputs through cpu_flash vs the fp64 oracle on the same bf16 values, error / max|ref|, worst
# over the full/causal blocks below x MHA/GQA/MQA x 5 seeds (torch 2.13, this CPU): out 3.7e-3 (one
# bf16 ulp: the op returns out in bf16), lse 7.5e-8 (fp32 inside the op), dq/dk/dv 8.0e-3 (bf16
# gradients, D from a bf16-rounded out). Bounds are ~2.5x those. The lse depends on the host's kernel:
# on an AMD EPYC host the full (unmasked) blocks give 1.5e-5 (causal ones 6e-8): still 250x below a
# bf16 ulp, so its bound covers both hosts.
BF16_OUT_BOUND = 8e-3
BF16_LSE_BOUND = 4e-5
BF16_GRAD_BOUND = 2e-2


def t(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def block(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(q_pos, k_pos, q_doc, k_doc) of a named test block, b = 2."""
    if name == "full":  # queries 8..11 after keys 0..7
        return t([list(range(8, 12))] * 2), t([list(range(8))] * 2), None, None
    if name == "causal":  # the diagonal block, positions as in zigzag (not contiguous)
        return t([[0, 1, 6, 7, 8, 13]] * 2), t([[0, 1, 6, 7, 8, 13]] * 2), None, None
    if name == "empty":
        return t([[0, 1, 2, 3]] * 2), t([[4, 5, 6, 7]] * 2), None, None
    if name == "masked":  # packed documents, global positions
        pos = t([list(range(8))] * 2)
        docs = t([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
        return pos, pos, docs, docs
    if name == "empty_rows":  # zigzag queries against a middle key chunk: rows 0, 1 see nothing
        return t([[0, 1, 6, 7]] * 2), t([[2, 3, 4, 5]] * 2), None, None
    if name == "empty_rows_docs":  # query 3 starts a document that has no key here; row 1 sees nothing at all
        return t([[4, 5, 6, 7], [0, 1, 2, 3]]), t([[0, 1, 2, 3], [2, 3, 4, 5]]), t([[0, 0, 1, 2], [0, 0, 0, 0]]), \
            t([[0, 0, 0, 1], [0, 0, 0, 0]])
    raise KeyError(name)


BLOCKS = ("full", "causal", "empty", "masked", "empty_rows", "empty_rows_docs")
KIND_OF = {"full": "full", "causal": "causal", "empty": "empty", "masked": "masked", "empty_rows": "masked",
           "empty_rows_docs": "masked"}


def make_qkv(sq: int, sk: int, heads: tuple[int, int], dtype: torch.dtype, seed: int = 0,
             b: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, g = heads
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(sq, b, n, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(sk, b, g, D, generator=gen, dtype=torch.float64) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


def oracle(q, k, v, dout, mask, scale=None):
    """fp64 masked softmax attention and its autograd gradients: (out, lse, dq, dk, dv)."""
    q, k, v, dout = (x.detach().to(torch.float64) for x in (q, k, v, dout))
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    n, g = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_rep, v_rep = (x.repeat_interleave(n // g, dim=2) for x in (k, v))  # [sk, b, n, d]
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k_rep) * scale
    mask4 = mask[:, None]  # [b, 1, sq, sk]
    sees_any = mask4.any(-1, keepdim=True)
    masked = scores.masked_fill(~mask4, NEG_INF)
    lse = torch.logsumexp(masked, -1)
    probs = torch.softmax(masked.masked_fill(~sees_any, 0.0), -1) * sees_any  # empty rows: 0, no NaN
    out = torch.einsum("bnqk,kbnd->qbnd", probs, v_rep)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), lse.detach(), dq, dk, dv


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.to(torch.float64) - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of the finite entries; the −inf pattern must match exactly."""
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    assert not lse.isnan().any()
    finite = torch.isfinite(ref)
    return rel_err(lse[finite], ref[finite]) if finite.any() else 0.0


def kernels_for(name: str) -> list[str | None]:
    """Every kernel that can run this block on CPU, plus auto selection."""
    return [None, "reference", "cpu_flash"] if KIND_OF[name] in ("full", "causal") else [None, "reference"]


def check(name: str, heads: tuple[int, int], dtype: torch.dtype, kernel: str | None) -> tuple[float, ...]:
    q_pos, k_pos, q_doc, k_doc = block(name)
    q, k, v, dout = make_qkv(q_pos.shape[1], k_pos.shape[1], heads, dtype)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = oracle(q, k, v, dout, visible(q_pos, k_pos, q_doc, k_doc))
    with torch.no_grad():
        out, lse = attention_forward(q, k, v, q_pos, k_pos, q_doc, k_doc, kernel=kernel)
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, q_pos, k_pos, q_doc, k_doc, kernel=kernel)
    want = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.dtype == lse.dtype == dq.dtype == dk.dtype == dv.dtype == want
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[2], q.shape[0])
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert all(x.is_contiguous() for x in (out, lse, dq, dk, dv))
    for x in (out, dq, dk, dv):
        assert not x.isnan().any()
    if name == "empty":
        assert not out.any() and not dq.any() and not dk.any() and not dv.any()
        assert torch.isneginf(lse).all()
        return (0.0,) * 5
    empty_rows = ~visible(q_pos, k_pos, q_doc, k_doc).any(-1)  # [b, sq]
    assert not out.permute(1, 0, 2, 3)[empty_rows].any()
    return (rel_err(out, ref_out), lse_err(lse, ref_lse), rel_err(dq, ref_dq), rel_err(dk, ref_dk), rel_err(dv, ref_dv))


@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("name", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_kernels_match_oracle(name: str, heads: tuple[int, int], dtype: torch.dtype) -> None:
    bound = 1e-10 if dtype == torch.float64 else 1e-5
    for kernel in kernels_for(name):
        errors = check(name, heads, dtype, kernel)
        assert max(errors) <= bound, (kernel, errors)


@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("name", ["full", "causal"])
def test_cpu_flash_bf16_within_bound(name: str, heads: tuple[int, int]) -> None:
    assert kernels.kernel_for(KIND_OF[name], torch.zeros(1, 1, 1, D, dtype=torch.bfloat16)) == "cpu_flash"
    out_err, lse_e, *grad_errs = check(name, heads, torch.bfloat16, "cpu_flash")
    assert out_err <= BF16_OUT_BOUND and lse_e <= BF16_LSE_BOUND and max(grad_errs) <= BF16_GRAD_BOUND, \
        (out_err, lse_e, grad_errs)


def test_cpu_flash_repeated_kv_heads_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path for torch < 2.9 (CPU flash op without GQA): kv heads repeated, dk/dv summed back."""
    monkeypatch.setattr(fused, "_cpu_flash_native_gqa", lambda: False)
    for name in ("full", "causal"):
        for heads in (HEADS["gqa"], HEADS["mqa"]):
            assert max(check(name, heads, torch.float64, "cpu_flash")) <= 1e-10


def test_auto_kernel_choice_on_cpu() -> None:
    q = torch.zeros(2, 1, 4, D)
    assert kernels.kernel_for("full", q) == kernels.kernel_for("causal", q) == "cpu_flash"
    assert kernels.kernel_for("masked", q) == "documents"
    assert kernels.kernel_for("full", q, "reference") == "reference"
    with pytest.raises(ValueError, match="cannot apply"):
        kernels.kernel_for("masked", q, "cpu_flash")
    with pytest.raises(ValueError, match="unknown kernel"):
        kernels.kernel_for("full", q, "triton")
    q_pos, k_pos, q_doc, k_doc = block("masked")
    with pytest.raises(ValueError, match="cannot apply"):
        attention_forward(*make_qkv(8, 8, HEADS["mha"], torch.float32)[:3], q_pos, k_pos, q_doc, k_doc, kernel="cpu_flash")


def test_given_kind_and_scale_are_used() -> None:
    q_pos, k_pos, _, _ = block("causal")
    q, k, v, dout = make_qkv(6, 6, HEADS["gqa"], torch.float64)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = oracle(q, k, v, dout, visible(q_pos, k_pos), scale=0.7)
    for kernel in ("reference", "cpu_flash"):
        out, lse = attention_forward(q, k, v, q_pos, k_pos, scale=0.7, kind="causal", kernel=kernel)
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, q_pos, k_pos, scale=0.7, kind="causal", kernel=kernel)
        errors = (rel_err(out, ref_out), lse_err(lse, ref_lse), rel_err(dq, ref_dq), rel_err(dk, ref_dk), rel_err(dv, ref_dv))
        assert max(errors) <= 1e-10, (kernel, errors)
    with pytest.raises(ValueError, match="unknown block kind"):
        attention_forward(q, k, v, q_pos, k_pos, kind="diagonal")


def _split(x: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor | None, chunks: int, dim: int = 0):
    """Cut the sequence dim (0 of x, 1 of pos/doc) into ``chunks`` contiguous blocks."""
    docs = [None] * chunks if doc is None else list(doc.chunk(chunks, 1))
    return list(zip(x.chunk(chunks, dim), pos.chunk(chunks, 1), docs))


@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("docs", [False, True], ids=["one_doc", "packed"])
@pytest.mark.parametrize("kernel", [None, "reference"], ids=["auto", "reference"])
def test_per_block_backward_sums_to_full_gradients(heads: tuple[int, int], docs: bool, kernel: str | None) -> None:
    """Ring-style: q and kv in 3 chunks; per q chunk, forward per kv chunk, merge (shuffled order),
    then every block's backward with the FINAL out/lse. dq summed over kv chunks, dk/dv over q chunks."""
    s, chunks = 12, 3
    pos = torch.arange(s).expand(2, s)
    doc = t([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]]) if docs else None
    q, k, v, dout = make_qkv(s, s, heads, torch.float64, seed=3)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = oracle(q, k, v, dout, visible(pos, pos, doc, doc))

    q_blocks = _split(q, pos, doc, chunks)
    kv_blocks = [(kb, vb, p, dc) for (kb, p, dc), (vb, _, _) in zip(_split(k, pos, doc, chunks), _split(v, pos, doc, chunks))]
    dout_blocks = dout.chunk(chunks, 0)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dk_blocks, dv_blocks = list(dk.chunk(chunks, 0)), list(dv.chunk(chunks, 0))
    kinds_seen = set()
    for i, (qb, q_pos, q_doc) in enumerate(q_blocks):
        order = [(i + j) % chunks for j in range(chunks)]  # ring order: own block first
        kinds = [classify(q_pos, kv_blocks[j][2], q_doc, kv_blocks[j][3]) for j in range(chunks)]
        kinds_seen.update(kinds)
        out = lse = None
        for j in order:
            kb, vb, k_pos, k_doc = kv_blocks[j]
            o, l_ = attention_forward(qb, kb, vb, q_pos, k_pos, q_doc, k_doc, kind=kinds[j], kernel=kernel)
            out, lse = (o, l_) if out is None else merge(out, lse, o, l_)
        assert rel_err(out, ref_out[i * 4:(i + 1) * 4]) <= 1e-10
        assert lse_err(lse, ref_lse[:, :, i * 4:(i + 1) * 4]) <= 1e-10
        dq = torch.zeros_like(qb)
        for j in order:
            kb, vb, k_pos, k_doc = kv_blocks[j]
            gq, gk, gv = attention_backward(dout_blocks[i], qb, kb, vb, out, lse, q_pos, k_pos, q_doc, k_doc,
                                            kind=kinds[j], kernel=kernel)
            dq += gq
            dk_blocks[j] += gk
            dv_blocks[j] += gv
        assert rel_err(dq, ref_dq[i * 4:(i + 1) * 4]) <= 1e-10
    assert rel_err(dk, ref_dk) <= 1e-10 and rel_err(dv, ref_dv) <= 1e-10
    # packed: the first diagonal block holds one document per row (causal), the others cross a boundary
    assert kinds_seen == ({"causal", "masked", "empty"} if docs else {"causal", "full", "empty"})


def test_per_block_backward_with_zigzag_masked_blocks() -> None:
    """Zigzag-like queries (tokens 0, 1, 10, 11 of 12) against 3 uneven key blocks, merged in every order.

    Every block is 'masked': rows 0, 1 see part of block 0 and nothing of blocks 1, 2 (-inf partial lse)."""
    heads = HEADS["gqa"]
    q_pos = t([[0, 1, 10, 11]] * 2)
    k_pos_all = torch.arange(12).expand(2, 12)
    q_full, k, v, dout_full = make_qkv(12, 12, heads, torch.float64, seed=5)
    q, dout = q_full[[0, 1, 10, 11]], dout_full[[0, 1, 10, 11]]
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = oracle(q, k, v, dout, visible(q_pos, k_pos_all))
    splits = [(0, 2), (2, 10), (10, 12)]
    parts = [attention_forward(q, k[a:b_], v[a:b_], q_pos, k_pos_all[:, a:b_]) for a, b_ in splits]
    for order in itertools.permutations(range(3)):
        out, lse = parts[order[0]]
        for j in order[1:]:
            out, lse = merge(out, lse, *parts[j])
        assert rel_err(out, ref_out) <= 1e-10 and lse_err(lse, ref_lse) <= 1e-10
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for a, b_ in splits:
        gq, gk, gv = attention_backward(dout, q, k[a:b_], v[a:b_], out, lse, q_pos, k_pos_all[:, a:b_])
        dq += gq
        dks.append(gk)
        dvs.append(gv)
    assert rel_err(dq, ref_dq) <= 1e-10
    assert rel_err(torch.cat(dks), ref_dk) <= 1e-10 and rel_err(torch.cat(dvs), ref_dv) <= 1e-10


def _partial(seed: int, dtype: torch.dtype = torch.float32, sq: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(sq, 2, 3, D, generator=gen).to(dtype)
    lse = (torch.randn(2, 3, sq, generator=gen) * 3).to(dtype)
    return out, lse


def test_merge_is_order_independent() -> None:
    a, b, c = _partial(1), _partial(2), _partial(3)
    ab, ba = merge(*a, *b), merge(*b, *a)
    assert torch.equal(ab[0], ba[0]) and torch.equal(ab[1], ba[1])
    results = []
    for x, y, z in itertools.permutations([a, b, c]):
        results.append(merge(*merge(*x, *y), *z))
    results.append(merge(*a, *merge(*b, *c)))
    for out, lse in results[1:]:
        assert rel_err(out, results[0][0].double()) <= 1e-6 and rel_err(lse, results[0][1].double()) <= 1e-6
    # exactness: merging equals the softmax-weighted sum computed directly in fp64
    lses = torch.stack([x[1].double() for x in (a, b, c)])
    weights = torch.softmax(lses, 0).permute(0, 3, 1, 2).unsqueeze(-1)  # [3, sq, b, n, 1]
    direct = (weights * torch.stack([x[0].double() for x in (a, b, c)])).sum(0)
    assert rel_err(results[0][0], direct) <= 1e-6 and rel_err(results[0][1], torch.logsumexp(lses, 0)) <= 1e-6


def test_merge_handles_neg_inf_rows_and_dtypes() -> None:
    a, b = _partial(1), _partial(2)
    a[1][0, 1, 2] = NEG_INF  # row of a that saw nothing
    a[0][2, 0, 1] = 0.0
    b[1][0, 1, 2] = NEG_INF  # ... and of b: stays empty
    b[0][2, 0, 1] = 0.0
    a[1][1, 0, 0] = NEG_INF  # only a is empty: the result is b's row exactly
    a[0][0, 1, 0] = 0.0
    out, lse = merge(*a, *b)
    assert not out.isnan().any() and not lse.isnan().any()
    assert lse[0, 1, 2] == NEG_INF and not out[2, 0, 1].any()
    assert lse[1, 0, 0] == b[1][1, 0, 0] and torch.equal(out[0, 1, 0], b[0][0, 1, 0])
    empty = (torch.zeros(5, 2, 3, D), torch.full((2, 3, 5), NEG_INF))
    out, lse = merge(*empty, *empty)
    assert not out.any() and torch.isneginf(lse).all()
    out, lse = merge(*_partial(1, torch.bfloat16), *_partial(2, torch.bfloat16))
    assert out.dtype == lse.dtype == torch.float32
    out, lse = merge(*_partial(1, torch.float64), *_partial(2))
    assert out.dtype == lse.dtype == torch.float64


@pytest.mark.parametrize(("q_pos", "k_pos", "q_doc", "k_doc", "kind"), [
    ([[0, 1, 6, 7]], [[2, 3, 4, 5]], None, None, "masked"),  # zigzag: some pairs visible, some not
    ([[6, 7]], [[2, 3]], None, None, "full"),
    ([[2, 3]], [[6, 7]], None, None, "empty"),
    ([[0, 1, 6, 7]], [[0, 1, 6, 7]], None, None, "causal"),  # non-contiguous but increasing
    ([[6, 7, 0, 1]], [[6, 7, 0, 1]], None, None, "masked"),  # same positions, not increasing: not a triangle
    ([[0, 1, 2]], [[0, 1]], None, None, "masked"),  # not square
    ([[0, 1, 2]], [[0, 1, 2]], [[0, 0, 1]], [[0, 0, 1]], "masked"),  # document boundary inside
    ([[0, 1, 2]], [[0, 1, 2]], [[4, 4, 4]], [[4, 4, 4]], "causal"),
    ([[5, 6]], [[0, 1]], [[1, 1]], [[1, 1]], "full"),
    ([[5, 6]], [[0, 1]], [[1, 1]], [[0, 0]], "empty"),  # different documents
    ([[5, 6]], [[0, 1]], [[1, 2]], [[1, 1]], "masked"),  # query 6 starts a new document
    ([[5, 6]], [[0, 1]], [[2, 3]], [[0, 1]], "empty"),  # docs vary but never match: needs the mask
    ([[6, 7], [0, 1]], [[2, 3], [2, 3]], None, None, "masked"),  # row 0 full, row 1 empty
    ([[0, 1], [0, 1]], [[2, 3], [4, 5]], None, None, "empty"),
])
def test_classify(q_pos, k_pos, q_doc, k_doc, kind) -> None:
    docs = (t(q_doc), t(k_doc)) if q_doc is not None else (None, None)
    assert classify(t(q_pos), t(k_pos), *docs) == kind


def test_classify_agrees_with_visible_on_random_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for trial in range(300):
        b, sq, sk = 2, int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        if trial % 3 == 0:  # square blocks with equal sorted positions
            sk = sq
            q_pos = torch.sort(torch.randperm(10, generator=gen)[:sq]).values.expand(b, sq).contiguous()
            k_pos = q_pos.clone()
        else:
            q_pos = torch.randint(0, 10, (b, sq), generator=gen)
            k_pos = torch.randint(0, 10, (b, sk), generator=gen)
        docs = (None, None)
        if trial % 2:
            q_doc = torch.randint(0, 2, (b, sq), generator=gen)
            docs = (q_doc, q_doc.clone()) if trial % 3 == 0 else (q_doc, torch.randint(0, 2, (b, sk), generator=gen))
        kind = classify(q_pos, k_pos, *docs)
        vis = visible(q_pos, k_pos, *docs)
        seen.add(kind)
        assert (kind == "empty") == (not vis.any())
        assert (kind == "full") == bool(vis.all())
        if kind == "causal":
            assert torch.equal(vis, torch.ones(sq, sq, dtype=torch.bool).tril().expand(b, sq, sq))
    assert seen == set(kernels.KINDS)


def test_zero_size_blocks_are_empty() -> None:
    q, k, v, dout = make_qkv(4, 0, HEADS["gqa"], torch.float32)
    q_pos, k_pos = torch.arange(4).expand(2, 4), torch.zeros(2, 0, dtype=torch.int64)
    assert classify(q_pos, k_pos) == "empty"
    out, lse = attention_forward(q, k, v, q_pos, k_pos)  # must not reach the CPU op (SIGFPE on length 0)
    assert not out.any() and torch.isneginf(lse).all()
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, q_pos, k_pos)
    assert not dq.any() and dk.shape == k.shape


def test_bad_inputs_are_rejected() -> None:
    q, k, v, _ = make_qkv(4, 4, (4, 3), torch.float32)
    pos = torch.arange(4).expand(2, 4)
    with pytest.raises(ValueError, match="kv heads dividing"):
        attention_forward(q, k, v, pos, pos)
    with pytest.raises(ValueError, match="together"):
        classify(pos, pos, pos, None)
    q, k, v, _ = make_qkv(4, 4, HEADS["gqa"], torch.float32)
    with pytest.raises(ValueError, match="q_pos"):
        attention_forward(q, k, v, pos[:, :3], pos)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["full", "causal"])
def test_flash_attn_matches_reference_on_gpu(name: str) -> None:
    if fused._flash_attn_ops() is None:
        pytest.skip("flash-attn is not installed")
    q_pos, k_pos, _, _ = block(name)
    q, k, v, dout = (x.cuda() for x in make_qkv(q_pos.shape[1], k_pos.shape[1], HEADS["gqa"], torch.bfloat16))
    q_pos, k_pos = q_pos.cuda(), k_pos.cuda()
    assert kernels.kernel_for(name, q) == "flash_attn"
    ref = attention_forward(q, k, v, q_pos, k_pos, kernel="reference")
    ref_grads = attention_backward(dout, q, k, v, *ref, q_pos, k_pos, kernel="reference")
    out, lse = attention_forward(q, k, v, q_pos, k_pos, kernel="flash_attn")
    grads = attention_backward(dout, q, k, v, out, lse, q_pos, k_pos, kernel="flash_attn")
    assert rel_err(out, ref[0].double()) <= BF16_OUT_BOUND and rel_err(lse, ref[1].double()) <= BF16_LSE_BOUND
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want.double()) <= BF16_GRAD_BOUND


def test_contract_holds_inside_autocast() -> None:
    """Under bf16 autocast (as in training) the masked path still returns fp32 out/lse and fp32 grads."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(6, 1, 2, 8, generator=g) for _ in range(3))
    pos = torch.arange(6).unsqueeze(0)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]])
    out_ref, lse_ref = kernels.attention_forward(q, k, v, pos, pos, doc, doc)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = kernels.attention_forward(q, k, v, pos, pos, doc, doc)
        grads = kernels.attention_backward(torch.ones_like(q), q, k, v, out, lse, pos, pos, doc, doc)
    assert out.dtype == lse.dtype == torch.float32 and all(t.dtype == torch.float32 for t in grads)
    assert torch.allclose(out, out_ref) and torch.allclose(lse, lse_ref)
