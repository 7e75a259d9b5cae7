"""Bytes each rank sends per step, per parallel dimension and op, as ``mpu.comm`` counts them (docs/planner.md)."""
from __future__ import annotations

from megatron_sp.config.schema import Config

from .activations import cp_algo_of, ulysses_kv
from .dims import DEFAULT_BUCKET_BYTES, GRAD_BYTES, dims_of, stage_layers
from .state import state_bytes


def _add(book: dict[str, dict[str, float]], dim: str, op: str, nbytes: float) -> None:
    if nbytes > 0:
        ops = book.setdefault(dim, {})
        ops[op] = ops.get(op, 0.0) + nbytes


def _ar(n: int) -> float:
    """Bytes an all-reduce over ``n`` ranks sends per byte (0 for one rank)."""
    return 2 * (n - 1) / n


def comm_per_step(cfg: Config, pp_rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, dict[str, float]]:
    """``{dimension: {op: bytes}}`` this rank sends per step (``tp | cp | pp | dp | other``, ops named as
    ``mpu.comm`` counts them, ``send`` for pipeline p2p, ``other`` the step's scalars); start-up and
    first-step-only collectives are not included."""
    D = dims_of(cfg)
    book: dict[str, dict[str, float]] = {}
    m, t, e = D.micro_batches, D.tp, D.e
    chunks = stage_layers(cfg, pp_rank)
    n_layers = sum(len(c) for c in chunks)
    first, last = pp_rank == 0, pp_rank == D.pp - 1
    forwards = 2 if D.recompute == "full" else 1  # full recompute repeats each layer's forward in backward

    if t > 1:
        act = D.tokens * D.h * e  # a gathered [s, b, h] activation
        ag = rs = (t - 1) / t * act
        ar = 2 * (t - 1) / t * act
        if D.sp:
            regather = (2 - (not D.kv_split)) if D.recompute_allgather else 0
            _add(book, "tp", "all_gather", m * n_layers * ag * (2 * forwards + 2 + regather))
            _add(book, "tp", "reduce_scatter", m * n_layers * rs * (2 * forwards + 2))
        else:
            _add(book, "tp", "all_reduce", m * n_layers * ar * (2 * forwards + 2))
        if first:
            _add(book, "tp", "reduce_scatter" if D.sp else "all_reduce", m * (rs if D.sp else ar))
            _add(book, "tp", "all_gather", m * ag if D.sp else 0)
        if last:
            if D.sp:
                _add(book, "tp", "all_gather", m * ag * (1 + D.recompute_allgather))
                _add(book, "tp", "reduce_scatter", m * rs)
            else:
                _add(book, "tp", "all_reduce", m * ar)
            _add(book, "tp", "all_reduce", m * 2 * (t - 1) / t * D.tokens * 3 * 4)  # CE max and sums, fp32
        _add(book, "tp", "all_reduce", 2 * (t - 1) / t * state_bytes(cfg, pp_rank, bucket_bytes).tp_synced * GRAD_BYTES)

    if D.cp > 1 and n_layers:
        algo, N = cp_algo_of(D), D.cp
        d, g, tok = D.head_dim, D.local_kv, D.tokens
        kv = 2 * tok * g * d  # this rank's K and V elements
        repeats = 2 if D.recompute in ("full", "selective") else 1  # the core's forward runs again in backward
        per_layer: dict[str, float] = {}

        def ring(n: int, block: int) -> None:
            if n > 1:
                per_layer["p2p"] = per_layer.get("p2p", 0) + (n - 1) * block * e * (repeats + 1) + n * block * 4

        def ulysses(n: int) -> None:
            each = (n - 1) / n * (2 * tok * D.local_heads * d + 2 * tok * ulysses_kv(D, n) * d) * e
            per_layer["all_to_all"] = per_layer.get("all_to_all", 0) + each * (repeats + 1)

        if algo in ("ring", "zigzag"):
            ring(N, kv)
        elif algo == "llama3":
            per_layer["all_gather"] = (N - 1) * kv * e * (repeats + 1)
            per_layer["reduce_scatter"] = (N - 1) * kv * 4
        elif algo == "ulysses":
            ulysses(N)  # + backward's all-to-all of the saved output back to the local layout:
            per_layer["all_to_all"] += (N - 1) / N * tok * D.local_heads * d * e
        else:  # usp: Ulysses of degree u inside a ring over cp / u
            u = D.cp_ulysses
            ulysses(u)  # + the saved output moved back in backward, as for Ulysses
            per_layer["all_to_all"] += (u - 1) / u * tok * D.local_heads * d * e
            ring(N // u, 2 * tok * ulysses_kv(D, u) * d)
        for op, nbytes in per_layer.items():
            _add(book, "cp", op, m * n_layers * nbytes)
        ids = 3 if D.documents else 1  # token indices (and document ids), int64, per chunk forward
        _add(book, "cp", "all_gather", m * len(chunks) * (N - 1) * D.micro_batch * D.s_local * 8 * ids)

    if D.pp > 1:
        last_stage = D.pp * D.virtual_stages - 1
        stages = [c * D.pp + pp_rank for c in range(D.virtual_stages)]
        sends = sum(s < last_stage for s in stages) + sum(s > 0 for s in stages)
        _add(book, "pp", "send", m * sends * D.shard_tokens * D.h * e)

    if D.dp_cp > 1:
        numel, n = state_bytes(cfg, pp_rank, bucket_bytes).padded_elements, D.dp_cp
        if D.zero:
            _add(book, "dp", "reduce_scatter", (n - 1) / n * numel * GRAD_BYTES)
            _add(book, "dp", "all_gather", (n - 1) / n * numel * e)
        else:
            _add(book, "dp", "all_reduce", 2 * (n - 1) / n * numel * GRAD_BYTES)
    # the scalars (fp64): the loss over the pipeline, the squared grad norm over the ZeRO shards and over tp·pp,
    # the step's token count and loss over dp·cp (training._global_sum); zero-bubble's agree_costs: 8 sums, broadcast
    scalars = _ar(D.pp) * 8 + (_ar(D.dp_cp) * 8 if D.zero else 0) + _ar(D.tp * D.pp) * 8 + 2 * _ar(D.dp_cp) * 8
    if D.schedule == "zero_bubble" and D.pp > 1:
        scalars += _ar(D.world) * 8 * 8
        _add(book, "other", "broadcast", (D.world - 1) / D.world * 8 * 8)
    _add(book, "other", "all_reduce", scalars)
    if D.tie and D.pp > 1 and (first or last):
        emb = D.padded_vocab // t * D.h * GRAD_BYTES
        if D.zero and D.dp_cp > 1:  # the two stages own different parts: assembled over dp·cp first
            _add(book, "dp", "all_reduce", 2 * (D.dp_cp - 1) / D.dp_cp * emb)
        _add(book, "dp", "all_reduce", emb)  # the embedding group (2 ranks): 2·(1/2)·bytes
    return book

