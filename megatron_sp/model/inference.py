"""Inference on a GPTModel: the KV cache, token sampling (``sample_next``, ``check_sampling``) and
autoregressive decoding of a batch of prompts under any layout (``generate_batch``). The model uses the cache
through its Protocols (``length``, ``layer(i).append``, ``advance``), so it does not import this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_sp.model.gpt import GPTModel
from megatron_sp.mpu import comm
from megatron_sp.mpu.cp_layout import required_divisor, sequence_layout, shard_batch

if TYPE_CHECKING:
    from megatron_sp.model.attention.context_parallel import AttentionMeta
    from megatron_sp.mpu import ParallelState


class KVCache:
    """Keys and values (after rotary) of the tokens seen so far, per layer, for incremental decoding. Invariant:
    every layer holds the same ``length`` tokens (``GPTModel.forward`` appends in every layer, then ``advance``).
    Trade-off: each layer preallocates ``[max_length, b, g, d]`` at its first ``append``: a step is a slice write."""

    def __init__(self, max_length: int, pad: torch.Tensor | None = None) -> None:
        if max_length < 1:
            raise ValueError(f"KVCache max_length must be positive, got {max_length}")
        self.max_length = max_length
        self.pad = pad  # [b]: left padding of each sequence (a batch of prompts of different lengths)
        self.length = 0
        self._layers: dict[int, LayerKVCache] = {}

    def layer(self, index: int) -> LayerKVCache:
        """The cache of layer ``index`` (global layer number), created on first use."""
        return self._layers.setdefault(index, LayerKVCache(self))

    def check_room(self, new_tokens: int) -> None:
        """Raise ValueError if ``new_tokens`` more tokens do not fit."""
        if self.length + new_tokens > self.max_length:
            raise ValueError(f"KV cache full: {self.length} cached + {new_tokens} new tokens exceed max_length "
                             f"{self.max_length}; start a new cache")

    def advance(self, new_tokens: int) -> None:
        """Mark ``new_tokens`` more tokens as filled (after every layer appended them)."""
        self.check_room(new_tokens)
        self.length += new_tokens


class LayerKVCache:
    """One layer's key/value buffers inside a ``KVCache`` (which owns the filled length)."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.k: torch.Tensor | None = None  # [max_length, b, g, d]
        self.v: torch.Tensor | None = None

    @property
    def pad(self) -> torch.Tensor | None:
        return self.owner.pad

    def fill(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> None:
        """A CP prefill (nothing cached yet): this rank's ``k``/``v`` ``[s/cp, b, g, d]`` all-gathered over
        ``meta.group`` and stored in position order (``meta.positions``: each gathered row's global index), so
        every cp rank then decodes with the whole cache; ``GPTModel.forward`` advances the length by ``s``."""
        order = torch.cat(meta.positions, dim=1).t()  # [s, b]

        def placed(t: torch.Tensor) -> torch.Tensor:
            full = comm.all_gather(t.contiguous(), meta.group, dim=0)  # [s, b, g, d], by cp rank
            return torch.empty_like(full).scatter_(0, order[..., None, None].expand_as(full), full)
        self.append(placed(k), placed(v))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new ``k``/``v`` ``[s, b, g, d]`` after the cached ones; return all ``[past + s, b, g, d]``."""
        start, s = self.owner.length, k.shape[0]
        self.owner.check_room(s)
        if self.k is None or self.v is None:
            self.k = k.new_empty((self.owner.max_length, *k.shape[1:]))
            self.v = v.new_empty((self.owner.max_length, *v.shape[1:]))
        elif self.k.shape[1:] != k.shape[1:] or self.k.dtype != k.dtype:
            raise ValueError(f"KV cache holds {tuple(self.k.shape[1:])} {self.k.dtype} per token, got "
                             f"{tuple(k.shape[1:])} {k.dtype}: use one cache per batch and dtype")
        self.k[start:start + s] = k
        self.v[start:start + s] = v
        return self.k[:start + s], self.v[:start + s]


def sample_next(logits: torch.Tensor, greedy: bool = True, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, generator: torch.Generator | None = None) -> int:
    """One token id from ``logits [V]`` (real vocabulary): the argmax (``greedy``), or a sample of
    ``softmax(logits / temperature)`` within the ``top_k`` (0: all) and the nucleus ``top_p``.
    The draw runs on the CPU, so a seeded ``generator`` gives the same ids on any device. Any temperature > 0 and
    top_p > 0 work: the scores are shifted to a maximum of 0 in float64 (a tiny temperature samples among the top
    logits, not NaN) and the nucleus keeps the most likely id."""
    if greedy:
        return int(logits.argmax())
    scores = logits.detach().double().cpu()  # [V]
    scores = ((scores - scores.max()) / temperature).float()  # the top id(s) 0, the others finite or -inf
    if 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely ids
        drop = before >= top_p
        drop[0] = False  # the most likely id is always kept (top_p may round to 0 in float32)
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def check_sampling(greedy: bool, temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError naming the bad sampling setting."""
    if greedy:
        return
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature} (use greedy for argmax)")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: no limit), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


# ----------------------------------------------------------------------------- batches under any layout

@dataclass(frozen=True)
class Sampling:
    """How each next token is picked (``sample_next``); a sampled sequence draws from its own generator, seeded by
    ``seed`` and its prompt's index only, so its tokens do not depend on the layout or the other prompts."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234

    def generator(self, index: int) -> torch.Generator | None:
        return None if self.greedy else torch.Generator().manual_seed((self.seed * 1_000_003 + index) % 2**63)


@dataclass
class Completion:
    """One prompt's result: its new tokens and why they stopped (``eod``, ``max_new_tokens``, or ``context``: the
    model's ``seq_length`` is full)."""

    index: int
    prompt_ids: list[int]
    new_ids: list[int] = field(default_factory=list)
    stop: str = "max_new_tokens"
    generator: torch.Generator | None = field(default=None, repr=False, compare=False)

    def going(self, step: int) -> bool:
        """Whether this sequence takes a token at decode step ``step``."""
        return self.stop == "max_new_tokens" and len(self.new_ids) == step


class _MicroBatch:
    """Prompts decoded together: left-padded to the longest, one KV cache of this stage's layers; each sequence may
    fill ``seq_length`` positions of its own, whatever the others' lengths."""

    def __init__(self, items: list[Completion], seq_length: int, max_new_tokens: int, device: torch.device,
                 room: int = 0) -> None:
        self.items = items
        width = max(len(c.prompt_ids) for c in items)
        self.pad = torch.tensor([width - len(c.prompt_ids) for c in items], device=device)
        self.prompt = torch.tensor([[0] * (width - len(c.prompt_ids)) + c.prompt_ids for c in items], device=device)
        # each sequence may fill the model's seq_length positions after its own padding
        # (``room``: the right padding a CP prefill writes before the decode overwrites it)
        self.cache = KVCache(seq_length + int(self.pad.max()) + room, self.pad if bool(self.pad.any()) else None)
        self.max_new_tokens = max_new_tokens
        self.limits = [min(max_new_tokens, seq_length - len(c.prompt_ids) + 1) for c in items]  # new tokens each
        self.active = True

    def input_ids(self, step: int) -> torch.Tensor:
        """The tokens of decode step ``step``: the prompts, then each sequence's last token ``[b, 1]``."""
        if step == 0:
            return self.prompt
        last = [c.new_ids[-1] if c.new_ids else 0 for c in self.items]
        return torch.tensor(last, device=self.prompt.device).unsqueeze(1)

    def context(self, step: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Without a KV cache (SP): the whole context of step ``step`` ``[b, W + step]`` right-padded to a multiple
        of ``multiple``, its positions (from each prompt's first token) and documents (the left padding 0, the
        tokens 1, the right padding 2: attention stays inside each)."""
        b, width = self.prompt.shape
        new = [c.new_ids[:step] + [0] * (step - len(c.new_ids[:step])) for c in self.items]
        right = -(width + step) % multiple
        ids = torch.cat([self.prompt, torch.tensor(new, dtype=torch.long, device=self.prompt.device).view(b, step),
                         self.prompt.new_zeros(b, right)], dim=1)
        cols = torch.arange(ids.shape[1], device=ids.device)
        docs = (cols >= self.pad[:, None]).long() + (cols >= width + step).long()
        return ids, (cols - self.pad[:, None]).clamp_min(0), docs

    def take(self, ids: list[int], eod: int | None, step: int) -> None:
        """Record step ``step``'s sampled ids; a sequence stops at its eod, the token limit or a full context."""
        for c, new, limit in zip(self.items, ids, self.limits):
            if not c.going(step):
                continue  # stopped earlier
            if eod is not None and new == eod:
                c.stop = "eod"
                continue
            c.new_ids.append(new)
            if len(c.new_ids) == limit < self.max_new_tokens:
                c.stop = "context"
        self.active = any(c.going(step + 1) and len(c.new_ids) < limit for c, limit in zip(self.items, self.limits))


def generate_batch(model: GPTModel, prompts: list[list[int]], max_new_tokens: int, eod: int | None,
                   sampling: Sampling = Sampling(), micro_batch_size: int | None = None,
                   state: ParallelState | None = None, indices: list[int] | None = None,
                   use_cache: bool = True) -> list[Completion]:
    """Continue every prompt (a list of token ids, at most ``seq_length`` long) by up to ``max_new_tokens`` tokens
    with a KV cache, on this rank's part of the model; returns the completions in prompt order (every rank of the
    model's TP × PP group gets them all). Collective over the model's TP and PP groups (``state``). ``indices``: the
    prompts' numbers (default 0, 1, ...), which seed their sampling.

    Prompts go in micro-batches of ``micro_batch_size`` (default: all at once, ``pp`` micro-batches under pipeline
    parallelism), each left-padded (the padding masked, positions from each prompt's first token). Under PP each stage
    decodes every micro-batch in turn, sending its hidden states on (``isend``) and taking the next input as it comes,
    so ``pp`` micro-batches keep every stage busy; the last stage samples from the TP-gathered logits (of each
    sequence's last token only: ``GPTModel.forward(logit_rows=)``, the prefill's too) and broadcasts the new ids over
    the PP group, which every other stage reads just before it needs them. Under sequence parallelism (no KV cache),
    or without ``use_cache``, each step re-runs the whole contexts. Under context parallelism the prompts are
    prefilled split over the cp ranks (``model.cp_group``, the config's algorithm), each layer's cache filled with the
    whole keys/values, then every cp rank decodes the same tokens."""
    check_sampling(sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p)
    recompute = model.parallel.sp or not use_cache  # no KV cache under SP (one new token cannot be split over tp)
    cp_group = model.cp_group
    cp, cp_rank = comm.group_size(cp_group), comm.group_rank(cp_group)
    if cp > 1 and recompute:
        raise ValueError("context parallelism prefills into the KV cache: not with sequence parallelism or "
                         "use_cache=False")
    cfg, dev = model.cfg, next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    indices = list(range(len(prompts))) if indices is None else indices  # a prompt's index seeds its sampling
    items = [Completion(i, list(p), generator=sampling.generator(i)) for i, p in zip(indices, prompts)]
    for c in items:
        if not 0 < len(c.prompt_ids) <= cfg.seq_length:
            raise ValueError(f"prompt {c.index} has {len(c.prompt_ids)} tokens; it needs 1..seq_length "
                             f"({cfg.seq_length})")
    pp = state.pp_size if state is not None else 1
    size = micro_batch_size or max(1, -(-len(items) // pp))
    room = required_divisor(model.parallel.cp_algo, cp) - 1 if cp > 1 else 0
    batches = [_MicroBatch(items[i:i + size], cfg.seq_length, max_new_tokens, dev, room)
               for i in range(0, len(items), size)]
    first, last = model.pre_process, model.post_process
    pp_ranks = state.group_ranks["pp"] if state is not None else [0]
    me = pp_ranks.index(state.rank) if state is not None else 0
    limit = model.cfg.vocab_size or model.padded_vocab_size
    unread: list[tuple[int, int]] = []  # (step, micro-batch) whose new ids this stage has not read yet
    sends: list[comm.Pending] = []

    def exchange(step: int, j: int, ids: torch.Tensor) -> None:  # the new ids from the last stage to every stage
        if pp > 1:
            comm.broadcast(ids, pp_ranks[-1], state.pp_group)  # type: ignore[union-attr]
        batches[j].take(ids.tolist(), eod, step)

    def read_next() -> None:
        step, j = unread.pop(0)
        exchange(step, j, torch.zeros(len(batches[j].items), dtype=torch.long, device=dev))

    def inputs(mb: _MicroBatch, step: int) -> tuple[torch.Tensor, dict]:
        """This stage's token ids ``[b, s]`` and forward keywords; ``logit_rows``: each sequence's row whose logits
        give its next token (the last stage computes no other logits)."""
        b, width = mb.prompt.shape
        if recompute:
            ids, pos, docs = mb.context(step, model.parallel.tp_size)
            rows = torch.full((b,), width + step - 1, device=dev)
            return ids, {"position_ids": pos, "document_ids": docs, "logit_rows": rows}
        if cp > 1 and step == 0:  # CP prefill: this rank's part of the prompts (right-padded to the CP divisor)
            ids, pos, docs = mb.context(0, required_divisor(model.parallel.cp_algo, cp))
            part = shard_batch({"tokens": ids, "position_ids": pos, "document_ids": docs}, cp, cp_rank,
                               sequence_layout(model.parallel.cp_algo))
            rows = (part["token_index"] == width - 1).int().argmax(dim=1)  # [b]: 0 where another rank holds it
            return part["tokens"], {"position_ids": part["position_ids"], "document_ids": part["document_ids"],
                                    "token_index": part["token_index"], "kv_cache": mb.cache, "logit_rows": rows}
        ids = mb.input_ids(step)
        return ids, {"kv_cache": mb.cache, "logit_rows": torch.full((b,), ids.shape[1] - 1, device=dev)}

    was_training = model.training
    model.eval()
    model.cp_group = comm.LOCAL  # decoding: every cp rank the same tokens over the whole cache
    if not recompute and model.kv_cache_unsupported() is not None:
        model.check_kv_cache_usable()
    try:
        with torch.no_grad():
            for step in range(max_new_tokens):
                for j, mb in enumerate(batches):
                    if unread and unread[0] == (step - 1, j):
                        read_next()
                    if not mb.active:
                        continue
                    ids, kwargs = inputs(mb, step)
                    model.cp_group = cp_group if "token_index" in kwargs else comm.LOCAL
                    if first:
                        out = model(ids, **kwargs)
                    else:
                        rows = ids.shape[1] // (model.parallel.tp_size if recompute else 1)
                        hidden = torch.empty(rows, ids.shape[0], cfg.hidden_size, dtype=dtype, device=dev)
                        src = pp_ranks[me - 1]
                        hidden = comm.irecv(hidden, src, state.p2p_groups[(src, state.rank)]).wait()
                        out = model(None, hidden_states=hidden, **kwargs)
                    if "token_index" in kwargs:
                        mb.cache.length = mb.prompt.shape[1]  # the right padding's keys are overwritten from here on
                    if not last:
                        dst = pp_ranks[me + 1]
                        sends.append(comm.isend(out.contiguous(), dst, state.p2p_groups[(state.rank, dst)]))
                        unread.append((step, j))
                        continue
                    logits = out[:, 0, :limit].float()  # [b, V]
                    if "token_index" in kwargs:  # CP prefill: the last prompt token's logits, from the rank holding it
                        held = (kwargs["token_index"] == mb.prompt.shape[1] - 1).any(dim=1, keepdim=True)  # [b, 1]
                        logits = comm.all_reduce(logits * held, cp_group)
                    new = [sample_next(row, sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p,
                                       c.generator) if c.going(step) else 0 for row, c in zip(logits, mb.items)]
                    exchange(step, j, torch.tensor(new, dtype=torch.long, device=dev))
            while unread:
                read_next()
            for pending in sends:
                pending.wait()
    finally:
        model.train(was_training)
        model.cp_group = cp_group
    return items
