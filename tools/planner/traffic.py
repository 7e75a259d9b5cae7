"""Bytes each rank sends per step, per parallel dimension and op, as ``mpu.comm`` counts them (docs/planner.md)."""
from __future__ import annotations

from megatron_sp.config.schema import Config

from .activations import cp_algo_of, ulysses_kv
from .dims import DEFAULT_BUCKET_BYTES, GRAD_BYTES, PlanDims, dims_of, moe_layers_of, stage_layers
from .state import state_bytes
from .zero import gathered_per_micro_batch


def _add(book: dict[str, dict[str, float]], dim: str, op: str, nbytes: float) -> None:
    if nbytes > 0:
        ops = book.setdefault(dim, {})
        ops[op] = ops.get(op, 0.0) + nbytes


def _ar(n: int) -> float:
    """Bytes an all-reduce over ``n`` ranks sends per byte (0 for one rank)."""
    return 2 * (n - 1) / n


def _forwards(D: PlanDims) -> int:
    """How often each layer's forward runs per micro-batch: twice under full recompute (again in backward)."""
    return 2 if D.recompute == "full" else 1


def moe_all_to_all_bytes(cfg: Config, pp_rank: int = 0) -> int:
    """Bytes of the rows stage ``pp_rank``'s rank passes to the MoE all-to-alls per optimizer step: the sum of the
    send splits times the row bytes, its own block included (``comm.count`` counts the rows to the other ranks only)

        micro_batches · moe_layers · (2·forwards + 2) · T·k · h · e

    T = ``shard_tokens`` (the tokens this rank routes: b·s/cp, /tp under sequence parallelism), k = ``moe_top_k``,
    e = the activation element's bytes, ``forwards`` = 2 under full recompute (each forward runs again in backward)
    else 1. Per MoE layer and forward: dispatch (this rank's T·k sorted rows out) and combine (the rows its experts
    computed back); per backward the same two exchanges with the splits swapped. The counts exchange (int64 [E])
    is not included; 0 at ep 1 (no all-to-all). Dropless: the dispatch forward and the combine backward pass
    exactly T·k rows on every rank; the other two pass the rows this rank's experts received, T·k on the mean over
    the ep group (exact for the group's sum), more or fewer on one rank as the router skews; a capacity factor
    passes only the kept rows (fewer)."""
    D = dims_of(cfg)
    if D.ep == 1 or not D.experts:
        return 0
    layers = sum(moe_layers_of(cfg, c) for c in stage_layers(cfg, pp_rank))
    return D.micro_batches * layers * (2 * _forwards(D) + 2) * D.shard_tokens * D.top_k * D.h * D.e


def comm_per_step(cfg: Config, pp_rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, dict[str, float]]:
    """``{dimension: {op: bytes}}`` this rank sends per step (``tp | cp | pp | ep | dp | edp | other``, ops named as
    ``mpu.comm`` counts them, ``send`` for pipeline p2p, ``ep`` the MoE dispatch, ``edp`` the expert gradients,
    ``other`` the step's scalars); start-up and first-step-only collectives are not included."""
    D = dims_of(cfg)
    book: dict[str, dict[str, float]] = {}
    m, t, e = D.micro_batches, D.tp, D.e
    chunks = stage_layers(cfg, pp_rank)
    n_layers = sum(len(c) for c in chunks)
    moe_layers = sum(moe_layers_of(cfg, c) for c in chunks)
    mlp_layers = n_layers - (moe_layers if not D.shared_ffn else 0)  # a MoE MLP's shared experts (routed experts: below)
    first, last = pp_rank == 0, pp_rank == D.pp - 1
    forwards = _forwards(D)

    if t > 1:
        act = D.tokens * D.h * e  # a gathered [s, b, h] activation
        ag = rs = (t - 1) / t * act
        ar = 2 * (t - 1) / t * act
        blocks = n_layers + mlp_layers  # attention, then the MLPs' column + row linears: forwards + 1 collectives each
        if D.sp:  # backward gathers the column linears' inputs again (replicated QKV: no gather)
            regather = (n_layers * D.kv_split + mlp_layers) if D.recompute_allgather else 0
            _add(book, "tp", "all_gather", m * ag * (blocks * (forwards + 1) + regather))
            _add(book, "tp", "reduce_scatter", m * rs * blocks * (forwards + 1))
        else:
            _add(book, "tp", "all_reduce", m * ar * blocks * (forwards + 1))
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

    if moe_layers:  # per forward: the micro-batch's expert counts [E] (int64) over the ranks sharing its tokens (tp
        # under SP, cp) for the balancing losses; with a capacity factor under SP the selections [s, b, k] gathered over tp
        for dim, n in (("tp", t if D.sp else 1), ("cp", D.cp)):
            _add(book, dim, "all_reduce", m * moe_layers * forwards * _ar(n) * D.experts * 8)
        if D.capacity and D.sp:
            _add(book, "tp", "all_gather", m * moe_layers * forwards * (t - 1) / t * D.tokens * D.top_k * (8 + 4))
    if D.etp > 1 and moe_layers:  # expert TP: per forward the expert output rows [T·k, h] (what this rank's experts
        # received; balanced) summed over tp before the combine, per backward the tokens' gradient [T, h] (copy_to_tp)
        rows = forwards * D.tokens * D.top_k + D.tokens
        _add(book, "tp", "all_reduce", m * moe_layers * _ar(t) * rows * D.h * e)
    if D.ep > 1 and moe_layers:  # per forward the counts [E] (int64) and the rows both ways; backward the rows again
        rows = moe_all_to_all_bytes(cfg, pp_rank) * (D.ep - 1) / D.ep  # comm counts the rows to the other ranks
        _add(book, "ep", "all_to_all", rows + m * moe_layers * forwards * (D.ep - 1) / D.ep * D.experts * 8)

    st = state_bytes(cfg, pp_rank, bucket_bytes)
    gathered = gathered_per_micro_batch(cfg, pp_rank, bucket_bytes)  # ZeRO-3: (dense, expert) elements
    for dim, numel, n, unit_gathers in (("dp", st.padded_elements - st.expert_elements, D.dp_cp, gathered[0]),
                                        ("edp", st.expert_elements, D.edp, gathered[1])):
        if n > 1:  # expert buckets (ep > 1) are reduced and ZeRO-sharded over edp, the rest over dp·cp
            if D.zero:  # ZeRO-2/3 reduce-scatter every micro-batch's gradients, ZeRO-1 the step's once; ZeRO-1/2
                # all-gather the updated parameters at the step's end, ZeRO-3 its units per forward entry and backward
                _add(book, dim, "reduce_scatter", (m if D.zero >= 2 else 1) * (n - 1) / n * numel * GRAD_BYTES)
                _add(book, dim, "all_gather", (n - 1) / n * (m * unit_gathers if D.zero == 3 else numel) * e)
            else:
                _add(book, dim, "all_reduce", 2 * (n - 1) / n * numel * GRAD_BYTES)
            muon = st.muon[dim == "edp"]  # Muon: the momentum-updated matrices gathered for their owners (ZeRO), the
            if muon:  # owners' orthogonalised results reduce-scattered back (ZeRO) or all-reduced (fp32)
                if D.zero:
                    _add(book, dim, "all_gather", (n - 1) / n * muon * GRAD_BYTES)
                    _add(book, dim, "reduce_scatter", (n - 1) / n * muon * GRAD_BYTES)
                else:
                    _add(book, dim, "all_reduce", 2 * (n - 1) / n * muon * GRAD_BYTES)
    if st.muon_tp_split and t > 1:  # an owner gathers each TP-split Muon weight over TP: this rank's share of them
        _add(book, "tp", "all_gather", (t - 1) * st.muon_tp_split * GRAD_BYTES / D.dp_cp)
    # the scalars (fp64): the loss over the pipeline, the squared grad norm over the ZeRO shards and over tp·pp,
    # the step's token count and loss over dp·cp (training._global_sum); zero-bubble's agree_costs: 8 sums, broadcast
    scalars = _ar(D.pp) * 8 + (_ar(D.dp_cp) * 8 if D.zero else 0) + _ar(D.tp * D.pp) * 8 + 2 * _ar(D.dp_cp) * 8
    if D.experts:  # moe.end_step: [num_layers, E + 4] fp64 stats over dp·cp, tp under SP, and pp; ep > 1: the experts'
        stats = (_ar(D.dp_cp) + _ar(t if D.sp else 1) + _ar(D.pp)) * cfg.model.num_layers * (D.experts + 4) * 8
        scalars += stats + (((_ar(D.edp) * 8 if D.zero else 0) + _ar(D.ep) * 8) if D.ep > 1 else 0)  # norm: edp, ep
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

