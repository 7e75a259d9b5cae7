"""Document-aligned attention (``attention.documents``) against the fp64 explicit-scores oracle.

Blocks are cut the way context parallelism cuts them (one rank's whole sequence, chunk pairs, zigzag
halves, the llama3 all-gathered keys) out of packed samples with every awkward document shape:
length-1 documents, one document per token, a single document, many tiny ones, documents spanning
chunk borders. out, lse, dq, dk and dv must match; no tensor of ``s·s`` elements may appear.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_sp.model.attention import documents, kernels
from megatron_sp.model.attention.kernels import attention_backward, attention_forward, visible
from megatron_sp.model.gpt import GPTModel

from test_attention_kernels import lse_err, make_qkv, oracle
from test_model import make_cfg

S = 32


def err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max|Δ| relative to max|ref|, floored at 1 (the inputs' scale): a one-token document's dq is 0."""
    return float((x.to(torch.float64) - ref).abs().max() / max(float(ref.abs().max()), 1.0))


def docs_from_lengths(lengths: list[int]) -> list[int]:
    ids = [d for d, n in enumerate(lengths) for _ in range(n)]
    assert len(ids) == S
    return ids


def random_lengths(seed: int, mean: float) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < S:
        n = min(S - total, 1 + int(torch.empty(1).exponential_(1 / mean, generator=gen)))
        lengths.append(n)
        total += n
    return lengths


SAMPLES = {
    "single_document": [S],
    "one_per_token": [1] * S,
    "length_one_docs": [1, 5, 1, 1, 9, 1, 6, 1, 7],
    "tiny": random_lengths(0, 2.0),
    "spanning_chunks": [3, 14, 2, 9, 4],  # crosses the borders at 8, 16, 24
    "random": random_lengths(1, 6.0),
}


def zigzag_rank(r: int, cp: int) -> list[int]:
    c = S // (2 * cp)
    return list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))


def cuts() -> dict[str, tuple[list[int], list[int]]]:
    """(query indices, key indices) of the blocks CP algorithms hand to the kernel."""
    everything = list(range(S))
    c = S // 4
    chunk = [list(range(i * c, (i + 1) * c)) for i in range(4)]
    return {
        "local": (everything, everything),
        "ring_diagonal": (chunk[2], chunk[2]),
        "ring_earlier": (chunk[3], chunk[1]),
        "zigzag_diagonal": (zigzag_rank(1, 2), zigzag_rank(1, 2)),
        "zigzag_pair": (zigzag_rank(0, 2), zigzag_rank(1, 2)),
        "llama3_all_keys": (chunk[2], everything),
        "llama3_zigzag": (zigzag_rank(1, 2), everything),
    }


def packed_block(sample: str, cut: str, b: int = 2):
    """q_pos, k_pos, q_doc, k_doc ``[b, ·]``; the second row's documents are shifted by one token."""
    rows = [docs_from_lengths(SAMPLES[sample]), ([0] + docs_from_lengths(SAMPLES[sample])[:-1])]
    qi, ki = cuts()[cut]
    doc = torch.tensor(rows[:b])
    q_pos, k_pos = torch.tensor([qi] * b), torch.tensor([ki] * b)
    return q_pos, k_pos, doc.gather(1, q_pos), doc.gather(1, k_pos)


@pytest.mark.parametrize("cut", list(cuts()))
@pytest.mark.parametrize("sample", list(SAMPLES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_document_aligned_matches_oracle(sample: str, cut: str, dtype: torch.dtype) -> None:
    q_pos, k_pos, q_doc, k_doc = packed_block(sample, cut)
    mask = visible(q_pos, k_pos, q_doc, k_doc)
    for heads in ((4, 4), (4, 2)):
        q, k, v, dout = make_qkv(q_pos.shape[1], k_pos.shape[1], heads, dtype, seed=len(sample))
        ref_out, ref_lse, ref_dq, ref_dk, ref_dv = oracle(q, k, v, dout, mask)
        kind = kernels.classify(q_pos, k_pos, q_doc, k_doc)
        out, lse = attention_forward(q, k, v, q_pos, k_pos, q_doc, k_doc, kind=kind)
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, q_pos, k_pos, q_doc, k_doc, kind=kind)
        if kind == "empty":
            continue
        # The final out/lse of a query row come from all key blocks; for a single block they are this block's.
        bound = 1e-10 if dtype == torch.float64 else 2e-5
        errors = (err(out, ref_out), lse_err(lse, ref_lse), err(dq, ref_dq), err(dk, ref_dk), err(dv, ref_dv))
        assert max(errors) < bound, (sample, cut, heads, kind, errors)
        assert all(x.is_contiguous() or x.dim() == 4 for x in (out, lse))


def test_blocks_with_documents_take_the_document_path() -> None:
    q_pos, k_pos, q_doc, k_doc = packed_block("random", "local")
    q = torch.zeros(S, 2, 4, 8)
    assert kernels.classify(q_pos, k_pos, q_doc, k_doc) == "masked"
    assert kernels.kernel_for("masked", q) == "documents"


def test_pieces_cover_exactly_the_visible_pairs() -> None:
    """Every visible (query, key) pair is in exactly one piece, no invisible pair is in any."""
    for sample in SAMPLES:
        for cut in cuts():
            q_pos, k_pos, q_doc, k_doc = packed_block(sample, cut)
            b, sq = q_pos.shape
            sk = k_pos.shape[1]
            covered = torch.zeros(b, sq, sk, dtype=torch.int64)
            for group in documents.plan(q_pos, k_pos, q_doc, k_doc):
                lq, lk = group.q_rows.shape[0], group.k_rows.shape[0]
                for gi in range(group.q_rows.shape[1]):
                    for i in range(lq):
                        for j in range(lk):
                            qr, kr = int(group.q_rows[i, gi]), int(group.k_rows[j, gi])
                            if qr == sq * b or kr == sk * b or (group.causal and j > i):
                                continue
                            assert qr % b == kr % b
                            covered[qr % b, qr // b, kr // b] += 1
                # a batch never holds a query row twice
                real = group.q_rows[group.q_rows < sq * b]
                assert real.unique().numel() == real.numel()
            assert torch.equal(covered, visible(q_pos, k_pos, q_doc, k_doc).long()), (sample, cut)


def test_bucket_pads_at_most_one_eighth() -> None:
    for n in range(1, 5000):
        width = documents.bucket(n)
        assert n <= width <= max(n, n + n // 8 + 1)
    assert len({documents.bucket(n) for n in range(1, 4097)}) <= 80  # kernel calls per block, at most


class _LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("sample", ["single_document", "random", "one_per_token"])
def test_no_tensor_of_s_by_s_elements(sample: str) -> None:
    """Forward and backward at s = 2048 (one head of dim 8): no op produces s·s/8 elements or more."""
    s = 2048
    lengths = [n * (s // S) for n in SAMPLES[sample]] if sample != "one_per_token" else [1] * s
    doc = torch.tensor([[d for d, n in enumerate(lengths) for _ in range(n)]])
    pos = torch.arange(s)[None]
    q, k, v, dout = make_qkv(s, s, (1, 1), torch.float32, b=1)
    with _LargestTensor() as mode:
        out, lse = attention_forward(q, k, v, pos, pos, doc, doc)
        attention_backward(dout, q, k, v, out, lse, pos, pos, doc, doc)
    assert mode.largest < s * s // 8, mode.largest


# --------------------------------------------------------------------------- through the model


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_packed_documents_attend_within_their_document(arch: str) -> None:
    """document_ids (data.reset_attention_mask) + restarted positions: each document's logits equal
    the model run on that document alone; without document ids they differ."""
    cfg = make_cfg(arch)
    model = GPTModel(cfg, seed=3).double()
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 2]
    tokens = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), generator=g)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = model(tokens, position_ids=pos, document_ids=docs)  # [1, s, V]
    start = 0
    for n in lengths:
        alone = model(tokens[:, start:start + n])
        assert torch.allclose(packed[:, start:start + n], alone, rtol=0, atol=1e-12), n
        start += n
    plain = model(tokens, position_ids=pos)
    assert (plain[:, lengths[0]:] - packed[:, lengths[0]:]).abs().max() > 1e-3


def test_document_plan_is_made_once_per_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's forward and backward attend over the same blocks: the block is classified and its
    document plan made once per micro-batch (kept on the AttentionMeta), not once per layer and pass."""
    from megatron_sp.model.attention import documents

    calls = {"plan": 0, "classify": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(documents, "plan", counted("plan", documents.plan))
    monkeypatch.setattr(kernels, "classify", counted("classify", kernels.classify))
    cfg = make_cfg("llama")
    assert cfg.num_layers >= 2
    model = GPTModel(cfg, seed=3)
    lengths = [5, 9, 2]
    tokens = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    model(tokens, position_ids=pos, document_ids=docs).sum().backward()
    assert calls == {"plan": 1, "classify": 1}
    model(tokens, position_ids=pos, document_ids=docs).sum().backward()  # the next micro-batch: a new meta
    assert calls == {"plan": 2, "classify": 2}
