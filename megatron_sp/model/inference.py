"""Inference on a GPTModel: the KV cache, token sampling (``sample_next``, ``check_sampling``) and
autoregressive ``generate``. The model uses the cache through its Protocols (``length``,
``layer(i).append``, ``advance``), so it does not import this module.
"""
from __future__ import annotations

import torch

from megatron_sp.model.gpt import GPTModel


class KVCache:
    """Keys and values (after rotary) of the tokens seen so far, per layer, for incremental decoding. Invariant:
    every layer holds the same ``length`` tokens (``GPTModel.forward`` appends in every layer, then ``advance``).
    Trade-off: each layer preallocates ``[max_length, b, g, d]`` at its first ``append``: a step is a slice write."""

    def __init__(self, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"KVCache max_length must be positive, got {max_length}")
        self.max_length = max_length
        self.length = 0
        self._layers: dict[int, LayerKVCache] = {}

    def layer(self, index: int) -> LayerKVCache:
        """The cache of layer ``index`` (global layer number), created on first use."""
        return self._layers.setdefault(index, LayerKVCache(self))

    def check_room(self, new_tokens: int) -> None:
        """Raise ValueError if ``new_tokens`` more tokens do not fit."""
        if self.length + new_tokens > self.max_length:
            raise ValueError(f"KV cache full: {self.length} cached + {new_tokens} new tokens exceed max_length "
                             f"{self.max_length}; start a new cache (generate crops the context and re-runs it)")

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
    The draw runs on the CPU, so a seeded ``generator`` gives the same ids on any device."""
    if greedy:
        return int(logits.argmax())
    scores = logits.detach().float().cpu() / temperature  # [V]
    if 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely ids
        drop = before >= top_p  # the first id is always kept (before = 0)
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


def generate(model: GPTModel, prompt_ids: list[int], max_new_tokens: int, eod: int | None, *,
             greedy: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             generator: torch.Generator | None = None, use_cache: bool = True) -> list[int]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens (see ``sample_next``); returns prompt + new
    tokens, stopping before ``eod``. Eval mode and ``no_grad`` (the model's mode is restored). The model sees the
    last ``seq_length`` tokens (positions from 0). With ``use_cache`` (if ``model.kv_cache_unsupported()`` is
    None) each new token reuses the earlier keys/values; past ``seq_length`` the cropped window re-runs uncached."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token")
    if model.embedding is None or not model.post_process:
        raise ValueError("generate needs a model with both the embedding and the output layer")
    check_sampling(greedy, temperature, top_k, top_p)
    dev = next(model.parameters()).device
    limit = model.cfg.vocab_size or model.padded_vocab_size
    seq_length = model.cfg.seq_length
    tokens = list(prompt_ids)
    cache = KVCache(seq_length) if use_cache and model.kv_cache_unsupported() is None else None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                if cache is not None and len(tokens) <= seq_length:
                    new = torch.tensor([tokens[cache.length:]], dtype=torch.long, device=dev)  # [1, s_new]
                    last_logits = model(new, kv_cache=cache)[0, -1]  # [V]
                else:
                    window = tokens[-seq_length:]
                    # Sequence parallelism splits s over TP: pad on the right (causal: earlier logits unchanged).
                    multiple = model.parallel.tp_size if model.parallel.sp else 1
                    padded = window + [0] * (-len(window) % multiple)
                    context = torch.tensor([padded], dtype=torch.long, device=dev)  # [1, s]
                    last_logits = model(context)[0, len(window) - 1]  # [V]
                next_id = sample_next(last_logits[:limit], greedy, temperature, top_k, top_p, generator)
                if eod is not None and next_id == eod:
                    break
                tokens.append(next_id)
    finally:
        model.train(was_training)
    return tokens
