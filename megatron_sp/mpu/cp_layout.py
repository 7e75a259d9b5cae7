"""Sequence layouts for context parallelism (``contiguous``, ``zigzag``): which tokens of the full sequence each
CP rank holds. ``shard_indices`` is the single definition; ``shard`` / ``unshard`` / ``shard_batch`` apply it,
``token_index`` records each held token's global index. With packed documents ``shard_batch`` zigzags each
long document on its own (``document_shard_indices``), so the work stays balanced. Theory: docs/attention.md.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from megatron_sp.config.registry import check, choice
from megatron_sp.errors import ConfigError

if TYPE_CHECKING:
    from megatron_sp.config.schema import Config

LAYOUTS = {"ring": "contiguous", "zigzag": "zigzag", "llama3": "contiguous", "ulysses": "contiguous", "usp": "zigzag"}
"""The sequence layout each ``parallel.cp_algo`` expects its input in."""

_LAYOUT_NAMES = ("contiguous", "zigzag")


def sequence_layout(algo: str) -> str:
    """The layout (``contiguous`` | ``zigzag``) of context-parallel algorithm ``algo``."""
    try:
        return LAYOUTS[algo]
    except KeyError:
        raise ValueError(f"parallel.cp_algo: unknown context-parallel algorithm {algo!r}; "
                         f"choose one of {' | '.join(LAYOUTS)}") from None


def _chunks_per_rank(layout: str, cp: int) -> int:
    """How many equal chunks of the sequence each rank holds (1 when cp == 1: the identity)."""
    return 2 if layout == "zigzag" and cp > 1 else 1


def shard_indices(seq_len: int, cp: int, rank: int, layout: str) -> torch.Tensor:
    """Global token indices rank ``rank`` of ``cp`` holds, in the order it holds them: int64 ``[seq_len // cp]``.
    ``zigzag``: chunk ``r`` then chunk ``2·cp − 1 − r`` of ``2·cp``."""
    if layout not in _LAYOUT_NAMES:
        raise ValueError(f"unknown sequence layout {layout!r}; expected one of {' | '.join(_LAYOUT_NAMES)} "
                         f"(sequence_layout(parallel.cp_algo) gives it)")
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank {rank} out of range for cp size {cp}")
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    n_chunks = cp * _chunks_per_rank(layout, cp)
    if seq_len % n_chunks:
        raise ValueError(f"sequence length {seq_len} is not divisible by {n_chunks} "
                         f"({'2·cp' if n_chunks != cp else 'cp'} for the {layout} layout with cp={cp}); "
                         f"choose model.seq_length as a multiple of {n_chunks}")
    chunk = seq_len // n_chunks
    held = [rank] if n_chunks == cp else [rank, n_chunks - 1 - rank]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, dtype=torch.int64) for c in held])


DOCUMENT_CHUNK = 128
"""Documents of at least ``2·cp·DOCUMENT_CHUNK`` tokens are zigzagged on their own (``document_shard_indices``;
``parallel.cp_document_chunk``)."""


def document_shard_indices(document_ids: torch.Tensor, cp: int, min_chunk: int = DOCUMENT_CHUNK) -> torch.Tensor:
    """Every rank's global token indices under the zigzag layout for packed documents: int64 ``[cp, b, s/cp]``
    from ``[b, s]`` document ids (a document: a run of equal ids). A unit is cut into ``2·cp`` chunks whose sizes
    differ by at most one and rank r holds chunk r and chunk ``2·cp − 1 − r`` of every unit, the front chunks
    first, each part in sequence order. The units: every document of at least ``2·cp·min_chunk`` tokens on its
    own (its causal work is balanced), and the shorter ones together as one stream (their work per token is small,
    so splitting their tokens evenly balances it; they are not cut into tiny pieces). One-token remainders go to
    chunks in turn, so every rank holds exactly ``s/cp`` tokens. No long document: the plain ``zigzag`` layout."""
    b, s = document_ids.shape
    n = 2 * cp
    if s % n:
        raise ValueError(f"sequence length {s} is not divisible by {n} (2·cp for the zigzag layout with cp={cp}); "
                         f"choose model.seq_length as a multiple of {n}")
    tokens = torch.arange(s)
    rows = []
    for doc in document_ids.cpu():
        starts = torch.ones(s, dtype=torch.bool)
        starts[1:] = doc[1:] != doc[:-1]
        first = starts.nonzero().flatten()  # [D]
        length = torch.diff(first, append=first.new_tensor([s]))
        which = torch.cumsum(starts.long(), 0) - 1  # document of each token
        alone = length >= n * min_chunk
        stream = ~alone[which]  # tokens of the short documents
        unit = torch.where(stream, first.numel(), which)  # [s]; the stream is unit D
        offset = torch.where(stream, torch.cumsum(stream.long(), 0) - 1, tokens - first[which])  # inside the unit
        size = torch.cat([torch.where(alone, length, 0), stream.sum().view(1)])  # [D + 1]
        base, extra = size // n, size % n
        turn = (torch.cumsum(extra, 0) - extra) % n  # the chunk that gets the unit's first extra token
        sizes = base[:, None] + ((torch.arange(n)[None, :] - turn[:, None]) % n < extra[:, None])  # [D + 1, n]
        chunk = torch.searchsorted(sizes.cumsum(1)[unit], offset[:, None], right=True).flatten()  # [s]
        back = chunk >= cp
        rank = torch.where(back, n - 1 - chunk, chunk)
        rows.append(torch.argsort(rank * 2 * s + back * s + tokens).view(cp, s // cp))
    return torch.stack(rows, 1).to(document_ids.device)


def shard(t: torch.Tensor, cp: int, rank: int, layout: str, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``t`` along ``dim`` (the sequence dimension): a new contiguous tensor, differentiable
    (``index_select``)."""
    index = shard_indices(t.shape[dim], cp, rank, layout).to(t.device)
    return t.index_select(dim, index).contiguous()


def unshard(parts: Sequence[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's equal-size part, in rank order: the inverse of ``shard`` over all ranks."""
    if not parts:
        raise ValueError("unshard needs at least one part")
    sizes = {p.shape[dim] for p in parts}
    if len(sizes) != 1:
        raise ValueError(f"unshard: parts differ in size along dim {dim}: {[p.shape[dim] for p in parts]}")
    cp = len(parts)
    seq_len = sizes.pop() * cp
    held = torch.cat([shard_indices(seq_len, cp, r, layout) for r in range(cp)])  # held[j] = global index of row j
    inverse = torch.argsort(held).to(parts[0].device)  # row of the concatenation holding global index i
    return torch.cat(list(parts), dim=dim).index_select(dim, inverse).contiguous()


def shard_batch(batch: Mapping[str, torch.Tensor], cp: int, rank: int, layout: str,
                min_chunk: int = DOCUMENT_CHUNK) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of a ``[b, s]`` batch, plus ``token_index`` (int64 ``[b, s/cp]``, the global index of
    each held token, which masks use; ``position_ids`` are rotary positions). Every tensor must be ``[b, s, ...]``
    and gets the same permutation along dim 1 (per row when ``document_ids`` make the zigzag layout per
    document, ``min_chunk``: ``document_shard_indices``). Labels must be shifted before sharding (docs/attention.md)."""
    if "token_index" in batch:
        raise ValueError("shard_batch: the batch already has 'token_index' (is it sharded already?)")
    if not batch:
        raise ValueError("shard_batch: empty batch")
    first = batch["tokens"] if "tokens" in batch else next(iter(batch.values()))
    if first.dim() < 2:
        raise ValueError(f"shard_batch: expected [b, s] tensors, got shape {tuple(first.shape)}")
    b, s = first.shape[:2]
    for name, t in batch.items():
        if t.dim() < 2 or tuple(t.shape[:2]) != (b, s):
            raise ValueError(f"shard_batch: {name!r} has shape {tuple(t.shape)}, expected [{b}, {s}, ...]")
    if layout == "zigzag" and cp > 1 and "document_ids" in batch:
        index = document_shard_indices(batch["document_ids"], cp, min_chunk)[rank]  # [b, s/cp]
    else:
        index = shard_indices(s, cp, rank, layout).to(first.device).unsqueeze(0).expand(b, -1)
    out = {name: t.gather(1, index.to(t.device).view(b, -1, *[1] * (t.dim() - 2)).expand(-1, -1, *t.shape[2:]))
           for name, t in batch.items()}
    out["token_index"] = index.to(first.device).contiguous()  # [b, s/cp]
    return out


def required_divisor(algo: str, cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """What ``model.seq_length`` must be divisible by for ``parallel.cp_algo = algo``: ``cp`` (contiguous) or
    ``2·cp`` (zigzag), 1 when ``cp == 1``; times ``tp`` under sequence parallelism."""
    if cp < 1 or tp < 1:
        raise ValueError(f"cp and tp must be >= 1, got cp={cp}, tp={tp}")
    divisor = cp * _chunks_per_rank(sequence_layout(algo), cp)
    return divisor * tp if sequence_parallel else divisor


@check
def check_context_parallel_config(cfg: Config) -> None:
    """The context-parallel keys of a config: the algorithm, its sequence divisor, the Ulysses head split."""
    m, p = cfg.model, cfg.parallel
    choice("parallel.cp_algo", p.cp_algo, tuple(LAYOUTS))
    if p.cp > 1:
        need = required_divisor(p.cp_algo, p.cp, p.tp, p.sequence_parallel)
        if m.seq_length % need:
            raise ConfigError(f"model.seq_length {m.seq_length} must be divisible by {need} for parallel.cp={p.cp} "
                              f"with cp_algo={p.cp_algo}" + (f" (× tp {p.tp} under sequence parallelism)"
                                                             if p.sequence_parallel else ""))
        if m.attention_dropout > 0:
            raise ConfigError("model.attention_dropout > 0 with parallel.cp > 1 is not available; set "
                              "model.attention_dropout=0")
        if p.cp_algo == "usp" and (p.cp_ulysses < 1 or p.cp % p.cp_ulysses):
            raise ConfigError(f"parallel.cp_ulysses={p.cp_ulysses} must divide parallel.cp={p.cp}")
        degree = {"ulysses": p.cp, "usp": p.cp_ulysses}.get(p.cp_algo, 1)
        local_heads, local_kv = m.num_heads // p.tp, max(1, m.num_kv_heads // p.tp)
        if degree > 1 and (local_heads % degree or (local_kv % degree and degree % local_kv)):
            key = "parallel.cp" if p.cp_algo == "ulysses" else "parallel.cp_ulysses"
            raise ConfigError(f"parallel.cp_algo={p.cp_algo}: the {local_heads} query heads per TP rank must be "
                              f"divisible by {key}={degree}, and the {local_kv} kv heads per TP rank must "
                              "divide it or be divisible by it; use ring, zigzag or llama3")
    if p.cp_ulysses != 1 and (p.cp_algo != "usp" or p.cp == 1):
        raise ConfigError(f"parallel.cp_ulysses={p.cp_ulysses} needs parallel.cp_algo=usp and parallel.cp > 1")
    if cfg.data.reset_attention_mask and m.attention_dropout > 0:
        raise ConfigError("data.reset_attention_mask with model.attention_dropout > 0 is not available; set "
                          "model.attention_dropout=0")
    if p.cp_heads_k_stride < 1:
        raise ConfigError(f"parallel.cp_heads_k_stride: {p.cp_heads_k_stride} must be >= 1")
    if p.cp_document_chunk < 1:
        raise ConfigError(f"parallel.cp_document_chunk: {p.cp_document_chunk} must be >= 1 (1 zigzags every document "
                          "on its own)")
