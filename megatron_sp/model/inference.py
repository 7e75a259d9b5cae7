"""Inference on a GPTModel: the KV cache, token sampling and autoregressive ``generate``.

``KVCache`` holds every layer's keys/values for incremental decoding; ``GPTModel.forward(...,
kv_cache=cache)`` uses it through its interface (``length``, ``layer(i).append``, ``advance``),
so the model does not import this module. ``sample_next`` picks one token (greedy, temperature,
top-k, top-p); ``check_sampling`` validates those settings; ``generate`` decodes with or without
the cache.
"""
from __future__ import annotations

import torch

from megatron_sp.model.gpt import GPTModel


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for incremental decoding (inference only).

    Each layer keeps ``[max_length, b, g, d]`` key and value buffers (after rotary), allocated at
    its first ``append``; ``length`` tokens of them are filled. ``GPTModel.forward(...,
    kv_cache=cache)`` runs the new tokens, appends their keys/values in every layer, then calls
    ``advance``. Invariant: all layers hold the same ``length`` tokens, at rotary positions
    ``0..length-1`` unless the caller passed other ``position_ids``. Only for the plain model (tp 1,
    no sequence or context parallelism) in eval mode; ``GPTModel.forward`` checks that.

    Trade-off: preallocating ``max_length`` rows costs ``2 · layers · max_length · b · g · d``
    elements up front but makes each step a slice write instead of a concatenation of the history.
    """

    def __init__(self, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"KVCache max_length must be positive, got {max_length}")
        self.max_length = max_length
        self.length = 0
        self._layers: dict[int, LayerKVCache] = {}

    def layer(self, index: int) -> LayerKVCache:
        """The cache of layer ``index`` (global layer number), created on first use."""
        if index not in self._layers:
            self._layers[index] = LayerKVCache(self)
        return self._layers[index]

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
    """One token id from ``logits`` ``[V]`` (already cut to the real vocabulary).

    ``greedy``: the argmax. Otherwise sample from ``softmax(logits / temperature)`` restricted to
    the ``top_k`` most likely ids (0: all) and then to the smallest set of most likely ids whose
    probability reaches ``top_p`` (nucleus; 1.0: all). The draw runs on the CPU with ``generator``
    (default: torch's global generator), so a seeded generator gives the same ids on any device.
    """
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
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens; returns prompt + new tokens.

    Each token is the argmax (``greedy``, the default) or a sample with ``temperature``,
    ``top_k`` and ``top_p`` drawn with ``generator`` (see ``sample_next``). Generation stops early
    when the model picks ``eod`` (which is not appended). Padded vocab rows beyond
    ``cfg.vocab_size`` (when known) are never chosen. Runs in ``no_grad`` and eval mode; the
    model's train/eval mode is restored afterwards. ``model`` must hold the embedding and the
    output layer. The new tokens are ``result[len(prompt_ids):]``.

    Context: the model sees the last ``seq_length`` tokens (positions from 0), as in training.
    With ``use_cache`` (and a model that supports it: tp 1, no context parallelism, one stage)
    the prompt is run once and each new token reuses the keys/values of the earlier ones
    (``KVCache``). The logits are the same as without the cache while the whole context fits in
    ``seq_length``; past that, cropping shifts every position, so each further token re-runs the
    cropped window without the cache, exactly like ``use_cache=False``. A model that cannot use
    the cache (e.g. tensor parallel during training) silently decodes without it.
    """
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
                    multiple = model.tp.size if model.tp.sequence_parallel else 1
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
