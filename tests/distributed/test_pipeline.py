"""Pipeline parallelism (1F1B over gloo) against the single-process full model.

Each launch runs several cases on pp = world ranks (tp = dp = 1): every stage builds its part of a
tiny GPT with ``build_stage``, runs the step's micro-batches through ``forward_backward`` and
returns its ``.grad`` by (global) parameter name, the summed loss, the schedule's event trace and
its peak live activations. The oracle, in the test process, is the full ``GPTModel`` from the same
seed accumulating the same micro-batches with the same loss (Σ masked token losses / global
tokens). Checked: every parameter's gradient (max|Δ|/max|ref| ≤ 1e-6, fp32), the summed loss,
the tied llama embedding (first-stage embedding + last-stage copy summed over the embedding group),
the sync callback just before the last backward, the 1F1B order, and the memory property: stage 0
holds at most pp micro-batches at once and its peak saved-tensor bytes (``saved_tensors_hooks``)
are the same for 4 and 8 micro-batches.
"""
from __future__ import annotations

import time
import weakref
from typing import Any

import pytest
import torch

from megatron_sp.config import ModelConfig
from megatron_sp.model import GPTModel
from megatron_sp.mpu import ParallelDims, initialize
from megatron_sp.pipeline.executor import ScheduleStats, forward_backward
from megatron_sp.pipeline.partition import (PipelineConfigError, build_stage, check_micro_batches, layer_split,
                                            tied_embedding_params)
from megatron_sp.pipeline.schedules import build_schedule, simulate
from megatron_sp.testing import run_distributed

VOCAB, PADDED = 50, 64
SEQ, MICRO = 16, 2
SEED = 7
RTOL = 1e-6


def _cfg(arch: str, layers: int = 4) -> ModelConfig:
    base: dict[str, Any] = {"arch": arch, "num_layers": layers, "hidden_size": 32, "num_heads": 4, "seq_length": SEQ,
                            "vocab_size": VOCAB, "padded_vocab_size": PADDED, "norm_eps": 1e-5}
    if arch == "neox":
        base.update(num_kv_heads=4, ffn_hidden_size=64, rotary_pct=0.25)
    else:
        base.update(num_kv_heads=2, ffn_hidden_size=48, rotary_pct=1.0, tie_embeddings=True)
    return ModelConfig(**base)


def _micro_batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + n)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        mask = (torch.rand(MICRO, SEQ, generator=g) > 0.25).float()
        pos = torch.arange(SEQ).unsqueeze(0).repeat(MICRO, 1)
        out.append({"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": pos})
    return out


def _loss_fn(n: int):
    denom = sum(float(mb["loss_mask"].sum()) for mb in _micro_batches(n))
    return lambda token_losses, mb: (token_losses.float() * mb["loss_mask"]).sum() / denom


class _SavedBytes:
    """Live bytes saved for backward inside the context (freed when autograd drops them) and their peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def _drop(self, nbytes: int) -> None:
        self.live -= nbytes

    def context(self) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> Any:
            holder = [t]
            nbytes = t.numel() * t.element_size()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            box = _Box(holder)
            weakref.finalize(box, self._drop, nbytes)
            return box

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.held[0])


class _Box:
    __slots__ = ("held", "__weakref__")

    def __init__(self, held: list[torch.Tensor]) -> None:
        self.held = held


def _reference(arch: str, n: int, layers: int = 4) -> tuple[dict[str, torch.Tensor], float]:
    model = GPTModel(_cfg(arch, layers), seed=SEED)
    loss_fn, total = _loss_fn(n), 0.0
    for mb in _micro_batches(n):
        loss = loss_fn(model(mb["tokens"], position_ids=mb["position_ids"], labels=mb["labels"]), mb)
        loss.backward()
        total += float(loss.detach())
    return {k: p.grad.clone() for k, p in model.named_parameters()}, total


Case = tuple[str, int, str]  # (arch, micro-batches, schedule): 4 layers, one chunk per rank
VCase = tuple[str, int, str, int, int, str]  # ... + (virtual stages, layers, partition)


def _full(case: Case | VCase) -> VCase:
    return case if len(case) == 6 else (*case, 1, 4, "uniform")  # type: ignore[return-value]


def _run_cases(rank: int, world: int, cases: list[Case | VCase]) -> list[dict[str, Any]]:
    state = initialize(ParallelDims(pp=world))
    results = []
    for case in cases:
        arch, n, schedule, v, layers, partition = _full(case)
        stage = build_stage(_cfg(arch, layers), SEED, state, virtual_stages=v, partition=partition)
        calls: list[bool] = []
        stats = ScheduleStats()
        saved = _SavedBytes()
        loss = forward_backward(stage, _micro_batches(n), state, _loss_fn(n), schedule, calls.append,
                                forward_context=saved.context, stats=stats)
        tied = tied_embedding_params(stage, state)
        for p in tied:  # what DistributedOptimizer.sync_grads_over does with main grads
            torch.distributed.all_reduce(p.grad, group=state.embedding_group)
        results.append({"grads": {k: p.grad.clone() for k, p in stage.named_parameters()}, "loss": float(loss),
                        "calls": calls, "events": stats.events, "peak": stats.peak_in_flight,
                        "peak_bytes": saved.peak, "live_after": saved.live, "tied": len(tied),
                        "chunks": [list(r) for r in stage.layer_chunks], "deferred": stats.deferred_weight_grads})
    return results


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def _check(results: list[dict[str, Any]], case: Case | VCase, pp: int) -> None:
    arch, n, schedule, v, layers, _ = _full(case)
    ref, ref_loss = _reference(arch, n, layers)
    got: dict[str, torch.Tensor] = {}
    for r in results:
        for k, g in r["grads"].items():
            if k == "output_layer.weight" and "output_layer.weight" not in ref:  # tied copy on the last stage
                assert _rel(g, ref["embedding.weight"]) <= RTOL, (case, pp, "tied copy")
                continue
            assert k not in got, f"{k} on two stages"
            got[k] = g
    assert got.keys() == ref.keys(), sorted(set(ref) ^ set(got))
    worst = {k: _rel(got[k], ref[k]) for k in ref}
    bad = {k: v for k, v in worst.items() if v > RTOL}
    assert not bad, (case, pp, bad)
    losses = [r["loss"] for r in results]
    assert losses[:-1] == [0.0] * (pp - 1)
    assert abs(losses[-1] - ref_loss) <= 1e-6 * abs(ref_loss), (losses[-1], ref_loss)
    table = build_schedule(schedule if pp > 1 or schedule == "zero_bubble" else "none", pp, n, v)
    sim = simulate(table, n, v)
    for rank, r in enumerate(results):
        ev = r["events"]
        assert r["calls"] == [False, True], r["calls"]
        assert ev.count(("sync",)) == 1
        actions = [e for e in ev if e != ("sync",)]
        assert actions == [(a.kind, a.chunk, a.micro_batch) for a in table[rank]]  # ran its table, in order
        assert ev.index(("sync",)) == max(k for k, e in enumerate(actions) if e[0] in "BIW")  # before the last grad
        assert r["peak"] == sim.peak_in_flight[rank]
        assert r["live_after"] == 0  # every saved activation was freed by backward
        if schedule == "1f1b" and pp > 1:
            assert ev.index(("B", 0, 0)) == min(pp - rank, n), (rank, ev)  # 1F1B warm-up depth
            assert r["peak"] == min(pp - rank, n) and r["peak"] <= pp
        if schedule == "zero_bubble":
            assert r["peak"] <= pp
            assert r["deferred"] > 0 and r["deferred"] % n == 0  # W ran the linears' weight gradients
        if schedule == "none":
            assert r["peak"] == 1
    assert results[0]["tied"] == (1 if arch == "llama" and pp > 1 else 0)


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_1f1b_matches_full_model(pp: int) -> None:
    cases: list[Case | VCase] = [("neox", 4, "1f1b"), ("neox", 8, "1f1b")] + ([("llama", 4, "1f1b")] if pp == 2 else [])
    results = run_distributed(_run_cases, pp, cases=cases, timeout_s=120)
    for c, case in enumerate(cases):
        _check([r[c] for r in results], case, pp)
    # memory: stage 0's peak saved bytes do not grow with the number of micro-batches
    assert results[0][1]["peak_bytes"] == results[0][0]["peak_bytes"] > 0


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_schedules_match_full_model(pp: int) -> None:
    """Interleaved (v = 2), zero-bubble, no pipelining and an uneven split give the full model's gradients."""
    cases: list[Case | VCase] = [
        ("neox", 2 * pp, "interleaved", 2, 2 * pp, "uniform"),
        ("neox", 4, "zero_bubble"),
        ("neox", 8, "zero_bubble"),
        ("neox", 4, "none"),
    ]
    if pp == 2:
        cases += [("llama", 4, "interleaved", 2, 4, "uniform"),  # tied embeddings, chunk 0 and the last chunk
                  ("llama", 4, "zero_bubble"),
                  ("neox", 4, "1f1b", 1, 4, "1,3")]
    results = run_distributed(_run_cases, pp, cases=cases, timeout_s=180)
    for c, case in enumerate(cases):
        _check([r[c] for r in results], case, pp)
    first = results[0]
    if pp == 2:
        assert results[0][0]["chunks"] == [[0], [2]] and results[1][0]["chunks"] == [[1], [3]]
        assert results[0][6]["chunks"] == [[0]] and results[1][6]["chunks"] == [[1, 2, 3]]
    # memory: zero-bubble's stage 0 holds at most pp micro-batches whatever m, and no more saved bytes
    # than 1F1B's bound allows (its deferred W keeps only the linears' inputs and output grads)
    assert first[2]["peak_bytes"] == first[1]["peak_bytes"] > 0
    # no pipelining holds one micro-batch: less than any pipelined schedule
    assert first[3]["peak_bytes"] < first[1]["peak_bytes"]


def test_pipeline_pp1_is_grad_accumulation() -> None:
    cases: list[Case | VCase] = [("neox", 4, "none"), ("neox", 4, "1f1b"), ("llama", 4, "none"), ("neox", 4, "zero_bubble")]
    results = run_distributed(_run_cases, 1, cases=cases, timeout_s=120)
    for c, case in enumerate(cases):
        _check([results[0][c]], case, 1)


def _bad_schedule(rank: int, world: int) -> str:
    state = initialize(ParallelDims(pp=world))
    stage = build_stage(_cfg("neox"), SEED, state)
    try:
        forward_backward(stage, _micro_batches(4), state, _loss_fn(4), "interleaved")  # one chunk per rank
    except ValueError as e:
        return str(e)
    return "no error"


def _failing_last_stage(rank: int, world: int) -> tuple[str, float]:
    state = initialize(ParallelDims(pp=world), timeout_s=5.0)
    stage = build_stage(_cfg("neox"), SEED, state)

    def loss_fn(token_losses: torch.Tensor, mb: Any) -> torch.Tensor:
        raise RuntimeError("boom in the loss")

    start = time.monotonic()
    try:
        forward_backward(stage, _micro_batches(4), state, loss_fn, "1f1b")
    except Exception as e:  # the test wants to see every rank's error
        return type(e).__name__ + ": " + str(e)[:200], time.monotonic() - start
    return "no error", time.monotonic() - start


def test_pipeline_errors_surface_on_every_rank() -> None:
    msgs = run_distributed(_bad_schedule, 2, timeout_s=60)
    assert all("virtual_stages >= 2" in m for m in msgs), msgs
    out = run_distributed(_failing_last_stage, 2, timeout_s=5.0)
    assert "boom in the loss" in out[1][0]
    assert out[0][0] != "no error" and out[0][1] < 30, out[0]  # the first stage raised instead of hanging


def test_layer_split_and_validation() -> None:
    cfg8 = _cfg("neox", 8)
    assert layer_split(cfg8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert layer_split(cfg8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert layer_split(_cfg("neox", 3), 1) == [range(3)]
    assert layer_split(cfg8, 2, partition="3,5") == [range(0, 3), range(3, 8)]
    with pytest.raises(ValueError, match="not divisible by parallel.pp·virtual_stages = 4·1"):
        layer_split(_cfg("neox", 6), 4)
    for bad in ("3,4", "8,0", "x"):
        with pytest.raises(PipelineConfigError, match="pp_partition"):
            layer_split(cfg8, 2, partition=bad)
    with pytest.raises(PipelineConfigError, match="at least pp"):
        check_micro_batches(2, 4)
    with pytest.raises(PipelineConfigError, match="multiple of pp"):
        check_micro_batches(6, 4, "interleaved")
    check_micro_batches(4, 4)
    check_micro_batches(1, 4, "none")


def test_balanced_partition_evens_parameters() -> None:
    """balanced: the embedding counts on the first stage, the output layer (and multi-token prediction) on the last, a
    MoE layer with all its experts."""
    from megatron_sp.model.gpt import parameter_parts
    from megatron_sp.model.moe import is_moe_layer

    def stage_params(cfg: ModelConfig, split: list[range]) -> list[int]:
        parts = parameter_parts(cfg)
        out = [sum(parts["moe_layer" if is_moe_layer(cfg, i) else "layer"] for i in r) for r in split]
        out[0] += parts["embedding"]
        out[-1] += parts["final_norm"] + parts["output_layer"] + parts["mtp"]
        return out

    big_vocab = ModelConfig(**{**vars(_cfg("neox", 8)), "vocab_size": 6000, "padded_vocab_size": 6016})
    split = layer_split(big_vocab, 2, partition="balanced")
    assert [len(r) for r in split] == [4, 4]  # symmetric: embedding and output layer weigh the same
    split = layer_split(big_vocab, 4, partition="balanced")
    counts = [len(r) for r in split]
    assert counts[0] < 2 < counts[1] and counts[-1] < 2 < counts[2], counts  # the end stages get fewer layers
    uniform = layer_split(big_vocab, 4)
    assert max(stage_params(big_vocab, split)) < max(stage_params(big_vocab, uniform))
    # no split does better than the one chosen (exhaustive over 4 stages of 8 layers)
    import itertools
    best = min(max(stage_params(big_vocab, [range(a), range(b), range(c), range(8 - a - b - c)]))
               for a, b, c in itertools.product(range(1, 6), repeat=3) if a + b + c < 8)
    assert max(stage_params(big_vocab, split)) == best
    moe_mtp = ModelConfig(**{**vars(big_vocab), "num_experts": 4, "moe_first_dense_layers": 3, "mtp_layers": 1})
    split = layer_split(moe_mtp, 3, partition="balanced")
    assert [len(r) for r in split] == [1, 6, 1]  # the vocabulary tables weigh ~9 MoE layers here
    assert max(stage_params(moe_mtp, split)) == min(max(stage_params(moe_mtp, [range(a), range(a, a + b), range(a + b, 8)]))
                                                    for a in range(1, 7) for b in range(1, 8 - a))


def _stuck_last_stage(rank: int, world: int) -> tuple[str, float]:
    """The last stage raises and then stays alive (as if stuck elsewhere): the first must time out, not hang."""
    out = _failing_last_stage(rank, world)
    if rank == world - 1:
        time.sleep(4.0)
    return out


def test_pipeline_error_with_live_peer_times_out() -> None:
    out = run_distributed(_stuck_last_stage, 2, timeout_s=2.0)
    assert "boom in the loss" in out[1][0]
    assert out[0][0] != "no error" and 1.5 <= out[0][1] < 30, out[0]  # the process-group timeout (2 s) fired


def _bf16_stages(rank: int, world: int) -> dict[str, Any]:
    state = initialize(ParallelDims(pp=world))
    stage = build_stage(_cfg("neox"), SEED, state).to(torch.bfloat16)
    loss = forward_backward(stage, _micro_batches(4), state, _loss_fn(4), "1f1b")
    return {"grads": {k: p.grad.float() for k, p in stage.named_parameters()}, "loss": float(loss)}


def test_pipeline_bf16_activations() -> None:
    """bf16 stages send bf16 activations (receivers allocate bf16) and stay close to the fp32 reference."""
    results = run_distributed(_bf16_stages, 2, timeout_s=120)
    ref, ref_loss = _reference("neox", 4)
    got = {k: g for r in results for k, g in r["grads"].items()}
    assert got.keys() == ref.keys()
    assert max(_rel(got[k], ref[k]) for k in ref) < 0.05  # measured 0.023
    assert abs(results[-1]["loss"] - ref_loss) < 0.02 * ref_loss
