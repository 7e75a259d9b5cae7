"""The layout planner (``tools/planner``, ``tools/plan.py``) against hand numbers and the real model.

* formulas: a small neox config's parameters, state bytes, per-layer activations, Table 2 and
  tensor-parallel communication, computed by hand in the comments;
* parameters, gradients and optimizer state: the planner's meta-device stages and optimizer give
  EXACTLY the bytes of a real ``GPTModel`` + ``DistributedOptimizer`` built here on CPU (one process;
  pipeline stages built directly; dp > 1 with a stand-in state object, which the optimizer only reads
  at construction; TP shapes from the model's sharding attributes);
* activations: within 10% (in fact equal) of the bytes autograd saves for one micro-batch, with and
  without recompute;
* the layout search: every factorisation considered, refusals are the config loader's, sorted;
* step time: model FLOPs with causal attention (``model.flops_per_token``), MFU never above 1;
* the CLI: one-line errors, the JSON line only with ``--json``, and ``--verify`` on two gloo ranks.
"""
from __future__ import annotations

import importlib.util
import json
import math
import types
from pathlib import Path

import pytest
import torch

from megatron_sp import config
from megatron_sp.errors import ConfigError
from megatron_sp.model.gpt import GPTModel, parameter_parts
from megatron_sp.mpu import ParallelContext
from megatron_sp.optim import DistributedOptimizer, named_trainable

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plan_cli", ROOT / "tools" / "plan.py")
assert _spec is not None and _spec.loader is not None
plan_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_cli)  # puts tools/ on sys.path: the planner package is importable from here on
plan = plan_cli.plan

TINY = ["data.paths=[unused]", "tokenizer.type=byte", "model.num_layers=2", "model.hidden_size=64",
        "model.num_heads=4", "model.seq_length=32", "train.micro_batch_size=2"]


def make_config(*overrides: str, vocab: int = 250):
    cfg = config.load(overrides=[*TINY, *overrides])
    config.set_vocab(cfg, vocab)
    return cfg


# ------------------------------------------------------------------------------------------ hand numbers


def test_formulas_against_hand_numbers() -> None:
    cfg = make_config()  # neox, h 64, 4 heads, ffn 256, 2 layers, s 32, b 2, fp32, vocab 250 -> padded 256
    # parameters: embedding 256·64; per layer: 2 LayerNorms 2·(64+64), qkv 192·64+192, out 64·64+64,
    # fc1 256·64+256, fc2 64·256+64 = 256+12480+4160+16640+16448 = 49984; final norm 128; output 256·64
    assert parameter_parts(cfg.model)["layer"] == 49984
    n = 16384 + 2 * 49984 + 128 + 16384
    st = plan.state_bytes(cfg)
    assert (st.param_elements, st.padded_elements) == (n, n)  # dp 1: no bucket padding
    assert (st.params, st.grads, st.optim) == (4 * n, 4 * n, 8 * n)  # fp32 params are the masters: Adam m, v only
    bf16 = plan.state_bytes(make_config("train.precision=bf16", "parallel.dp=2", "parallel.zero=1",
                                        "train.global_batch_size=4"))
    assert (bf16.params, bf16.grads, bf16.optim) == (2 * n, 4 * n, 12 * n // 2)  # 6 + 12/d bytes per parameter
    zero2 = plan.state_bytes(make_config("train.precision=bf16", "parallel.dp=2", "parallel.zero=2",
                                         "train.global_batch_size=4"))
    assert (zero2.params, zero2.grads, zero2.optim) == (2 * n, 4 * n // 2, 12 * n // 2)  # 2 + 16/d bytes per parameter

    # one layer, fp32 (e = 4), x = s·b·h = 32·2·64 = 4096 elements
    x = 4096
    expected = {"norm inputs": 4 * x,  # one x read by both LayerNorms (parallel residual)
                "norm statistics": 4 * 2 * 2 * 64,  # mean and rstd [s, b, 1] of two norms
                "QKV input": 4 * x, "q,k (rotated)": 4 * 2 * x, "v": 4 * x, "attention output": 4 * x,
                "attention probs": 4 * 2 * 4 * 32 * 32,  # [b, n, s, s]: s = 32 is one causal block of the CPU kernel
                "MLP input": 4 * x, "GeLU input": 4 * 4 * x, "fc2 input": 4 * 4 * x}
    D = plan.dims_of(cfg)
    assert plan.layer_terms(D) == expected
    assert sum(expected.values()) == 279552
    assert plan.layer_terms(plan.dims_of(make_config("model.recompute=full"))) == {"layer input": 4 * x}
    flash = plan.layer_terms(plan.dims_of(make_config("model.cpu_attention_max_scores=0")))  # torch's flash kernel
    assert flash == {k: v for k, v in expected.items() if k != "attention probs"} | {"log-sum-exp": 4 * 2 * 4 * 32}
    # Table 2 as printed: sbh(34 + 5as/h), 16-bit bytes ×2 for fp32 = 4096·(34 + 5·4·32/64)·2
    assert plan.table2_layer_bytes(D) == 4096 * 44 * 2
    # decode KV cache per token of a sequence, 2 layers, bf16: GQA k and v of 2 kv heads · d 16; MLA latent 32 + rotary key 8
    mla = ("model.kv_lora_rank=32", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16")
    assert [plan.kv_cache_bytes_per_token(make_config("model.arch=llama", *o).model, 2) for o in (["model.num_kv_heads=2"], mla)] \
        == [2 * 2 * 2 * 16 * 2, 2 * (32 + 8) * 2]


def test_cross_entropy_transients_eager_and_compiled() -> None:
    """bf16: eager, the loss's gradient plus its fp32 chunk; compiled (train.compile), the gradient alone, and for a
    slice that is mostly padding also the real columns' gradient, made apart before it is padded."""
    buffer_terms = plan.activations.buffer_terms
    key = "logits + cross-entropy transients"
    for vocab, padding_heavy in ((250, False), (40, True)):
        eager = make_config("train.precision=bf16", "train.compile=false", vocab=vocab)
        compiled = make_config("train.precision=bf16", "train.compile=true", vocab=vocab)
        D = plan.dims_of(eager)
        tokens, v_local = D.tokens, D.padded_vocab
        assert 2 * vocab < v_local if padding_heavy else 2 * vocab >= v_local
        logits = tokens * v_local
        assert buffer_terms(eager, 0, 1)[key] == 2 * logits + 4 * logits  # chunk = all logits here (< 2^22)
        assert buffer_terms(compiled, 0, 1)[key] == 2 * logits + (2 * tokens * vocab if padding_heavy else 0)


def test_tensor_parallel_communication_by_hand() -> None:
    cfg = make_config("parallel.tp=2", "parallel.sequence_parallel=true", "train.global_batch_size=2")
    # one micro-batch; a gathered [s, b, h] fp32 activation is 32·2·64·4 = 16384 bytes; an all-gather or a
    # reduce-scatter over 2 ranks sends half of it: 8192
    half = 8192
    # per layer: forward AG (QKV, fc1) + RS (out, fc2); backward AG (of the RS grads) + RS (of the AG
    # grads) + the re-gather of the QKV and fc1 inputs (tp_recompute_allgather): 6 AG, 4 RS
    layers_ag, layers_rs = 2 * 6 * half, 2 * 4 * half
    # embedding: RS forward, AG backward; output layer: AG forward, AG (re-gather) + RS backward
    ag, rs = layers_ag + half + 2 * half, layers_rs + half + half
    # all-reduces: cross entropy max + 2 sums over [s, b] fp32 (3·64·4 bytes), then the TP sum of the
    # sequence-parallel grads: 4 norm vectors + 2 row biases per layer and the final norm (2·6 + 2)·64 fp32
    ar = (3 * 64 * 4) + (2 * 6 + 2) * 64 * 4  # each all-reduce over 2 ranks sends 2·(1/2)·bytes
    book = plan.comm_per_step(cfg)
    assert book["tp"] == {"all_gather": ag, "reduce_scatter": rs, "all_reduce": ar}
    assert book["other"] == {"all_reduce": 8}  # the squared grad norm over tp (fp64)
    assert "dp" not in book and "cp" not in book and "pp" not in book


def test_in_flight_follows_the_schedule() -> None:
    cfg = make_config("model.num_layers=4", "parallel.pp=4", "train.global_batch_size=16")  # 8 micro-batches
    lp = plan.plan_layout(cfg)
    assert [r.schedule.in_flight for r in lp.stages] == [4, 3, 2, 1]  # 1F1B: pp − stage
    inter = plan.plan_layout(make_config("model.num_layers=8", "parallel.pp=2", "parallel.pp_schedule=interleaved",
                                         "parallel.virtual_stages=2", "train.global_batch_size=16"))
    # Megatron: (pp − r − 1)·2 + (v − 1)·pp + 1 model chunks: 5 and 3
    assert [r.schedule.in_flight for r in inter.stages] == [5, 3]
    zb = plan.plan_layout(make_config("model.num_layers=4", "parallel.pp=4", "parallel.pp_schedule=zero_bubble",
                                      "train.global_batch_size=16"))
    assert all(r.schedule.in_flight <= 4 for r in zb.stages)
    one = plan.plan_layout(make_config("model.num_layers=4", "parallel.pp=4", "parallel.pp_schedule=none",
                                       "train.global_batch_size=16"))
    assert [r.schedule.in_flight for r in one.stages] == [1, 1, 1, 1]
    assert lp.stages[0].activations == 4 * lp.stages[0].chunks[0].per_micro_batch + sum(lp.stages[0].chunks[0].shared.values())


def test_parse_memory() -> None:
    assert plan.parse_memory("80GB") == 80 * 10**9
    assert plan.parse_memory("80GiB") == 80 * 2**30
    assert plan.parse_memory("512 MB") == 512 * 10**6
    assert plan.parse_memory("1.5TiB") == int(1.5 * 2**40)
    for bad in ("80XB", "GB", "-1GB", "0GB", "", "0.5B", "1000"):  # 0.5B was read as 0 bytes
        with pytest.raises(ConfigError):
            plan.parse_memory(bad)


# ------------------------------------------------------------------------------------------ exact state bytes


def _stage_model(cfg, pp_rank: int) -> GPTModel:
    return GPTModel(cfg.model, 1, layer_chunks=plan.stage_layers(cfg, pp_rank), pre_process=pp_rank == 0,
                    post_process=pp_rank == cfg.parallel.pp - 1)


def _stand_in_state(cfg, pp_rank: int, dp_rank: int = 0) -> types.SimpleNamespace:
    """What ``DistributedOptimizer`` reads at construction (no collective runs before backward)."""
    d = cfg.parallel.dp * cfg.parallel.cp
    return types.SimpleNamespace(dp_cp_group=None, dp_cp_size=d, dp_cp_rank=dp_rank, tp_rank=0, tp_size=1,
                                 pp_size=cfg.parallel.pp, is_first_stage=pp_rank == 0)


@pytest.mark.parametrize("overrides", [
    (),
    ("train.precision=bf16", "parallel.dp=3", "parallel.zero=1", "train.global_batch_size=6"),
    ("model.arch=llama", "model.num_kv_heads=2", "model.tie_embeddings=true", "train.precision=bf16",
     "model.num_layers=3", "parallel.pp=2", "parallel.pp_partition=balanced", "parallel.dp=2",
     "train.global_batch_size=8"),
    ("model.num_layers=4", "parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.virtual_stages=2",
     "parallel.dp=3", "train.global_batch_size=12", "model.tie_embeddings=true"),
])
def test_state_bytes_equal_the_real_optimizer(overrides: tuple[str, ...]) -> None:
    cfg = make_config(*overrides)
    bucket = 20_000  # several buckets, each padded to a multiple of dp
    for r in range(cfg.parallel.pp):
        model = _stage_model(cfg, r)
        named = named_trainable(model)
        planned = plan.stage_parameters(cfg, r)  # the same stage built on the meta device
        assert all(q.is_meta for _, q in planned)
        assert [(n, q.shape) for n, q in planned] == [(n, p.shape) for n, p in named]
        for dp_rank in {0, cfg.parallel.dp - 1}:
            opt = DistributedOptimizer(named, cfg.train, _stand_in_state(cfg, r, dp_rank), zero=cfg.parallel.zero,
                                       precision=cfg.train.precision, bucket_bytes=bucket)
            measured = plan.measure_state(opt, model)
            st = plan.state_bytes(cfg, r, bucket)
            assert (st.params, st.grads, st.optim) == (measured["params"], measured["grads"], measured["optim"])
            opt.remove_hooks()
            model = _stage_model(cfg, r)  # the optimizer took over the parameters' storage
            named = named_trainable(model)


@pytest.mark.parametrize("overrides", [
    ("parallel.tp=2", "parallel.sequence_parallel=true"),
    ("model.arch=llama", "model.num_heads=8", "model.num_kv_heads=4", "parallel.tp=4"),
])
def test_tensor_parallel_shapes_from_sharding_attributes(overrides: tuple[str, ...]) -> None:
    cfg = make_config(*overrides)
    t = cfg.parallel.tp
    model = GPTModel(cfg.model, 1)  # the full model (this config's padded vocabulary), no process group
    local = []
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if getattr(p, "tensor_model_parallel", False):
            shape[p.partition_dim] //= t
        local.append((name, tuple(shape)))
    assert [(n, tuple(q.shape)) for n, q in plan.stage_parameters(cfg)] == local
    sp = {n for n, q in plan.stage_parameters(cfg) if q.sequence_parallel}
    assert sp == ({n for n, _ in model.named_parameters() if "norm" in n or n.endswith(("out.bias", "fc2.bias"))}
                  if cfg.parallel.sequence_parallel else set())


def test_replicated_kv_heads_cost_under_tp() -> None:
    split = plan.stage_parameters(make_config("model.arch=llama", "model.num_kv_heads=2", "parallel.tp=2"))
    repl = plan.stage_parameters(make_config("model.arch=llama", "model.num_kv_heads=1", "parallel.tp=2"))
    qkv = {n: q for n, q in repl if "qkv.weight" in n}
    # one kv head, 4 query heads, head dim 16: the whole [1·(4+2)·16, 64] weight on both TP ranks, TP-summed grad
    assert all(q.shape == (96, 64) and q.sequence_parallel and not q.tensor_model_parallel for q in qkv.values())
    assert dict(split)["layers.0.attention.qkv.weight"].shape == (64, 64)


# ------------------------------------------------------------------------------------------ mixture of experts

MOE = ("model.arch=llama", "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "parallel.ep=2")


def test_moe_experts_edp_sharding_and_all_to_all_by_hand() -> None:
    # llama h 64, 2 MoE layers of 4 experts, f 32: an expert is gate, up, down = 3·64·32 = 6144 parameters
    per_rank = {}
    for ep in (1, 2):
        cfg = make_config(*MOE, f"parallel.ep={ep}", "parallel.dp=2", "train.global_batch_size=4", "parallel.zero=1")
        named = plan.stage_parameters(cfg)
        experts = [(n, q) for n, q in named if getattr(q, "expert_parallel", False)]
        assert all(q.shape[0] == 4 // ep and q.ep_size == ep for _, q in experts)
        assert dict(named)["layers.0.mlp.router.weight"].shape == (4, 64)  # the router is dense, on every rank
        per_rank[ep] = sum(q.numel() for _, q in experts)
        st = plan.state_bytes(cfg)
        dense = st.padded_elements - st.expert_elements
        if ep == 1:  # reduced and ZeRO-sharded with the rest over dp·cp = 2
            assert st.expert_elements == 0 and st.optim == 8 * st.padded_elements // 2
        else:  # edp = dp / ep = 1: the rank's own experts, unsharded; the rest sharded over dp = 2
            assert st.expert_elements == per_rank[2] and st.optim == 8 * (dense // 2 + per_rank[2])
    assert per_rank == {1: 2 * 4 * 6144, 2: 2 * 2 * 6144}

    # all-to-all: T = b·s = 64 tokens, k = 2: 128 rows of 64 fp32 = 32 KiB per exchange; dispatch + combine forward
    # and backward = 4 exchanges per MoE layer, 2 layers, 1 micro-batch
    cfg = make_config(*MOE, "parallel.dp=2", "train.global_batch_size=4")
    assert plan.moe_all_to_all_bytes(cfg) == 2 * 4 * 128 * 64 * 4
    assert plan.comm_per_step(cfg)["ep"] == {"all_to_all": 2 * 4 * 128 * 64 * 4 / 2 + 2 * 4 * 8 / 2}  # others' rows, counts
    full = make_config(*MOE, "parallel.dp=2", "train.global_batch_size=8", "model.recompute=full", "train.precision=bf16")
    assert plan.moe_all_to_all_bytes(full) == 2 * 2 * 6 * 128 * 64 * 2  # 2 micro-batches, forward twice, bf16
    assert plan.moe_all_to_all_bytes(make_config(*MOE[:-1], "parallel.dp=2", "train.global_batch_size=4")) == 0  # ep 1
    # expert gradients over edp = dp / ep = 2, the rest over dp = 4
    cfg = make_config(*MOE, "parallel.dp=4", "train.global_batch_size=8")
    st, comm = plan.state_bytes(cfg), plan.comm_per_step(cfg)
    assert st.expert_elements == 2 * 2 * 6144
    assert comm["edp"] == {"all_reduce": 2 * (1 / 2) * st.expert_elements * 4}
    assert comm["dp"] == {"all_reduce": 2 * (3 / 4) * (st.padded_elements - st.expert_elements) * 4}


def _moe_rank(rank: int, world_size: int, overrides: list[str], bucket: int) -> dict[str, object]:
    """A real stage and optimizer at ep 2: their state bytes, and the rows this rank passes to the all-to-alls."""
    from megatron_sp.mpu import ParallelDims, comm, initialize
    from megatron_sp.pipeline.partition import build_stage

    cfg = make_config(*overrides)
    p = cfg.parallel
    state = initialize(ParallelDims(tp=p.tp, dp=p.dp, ep=p.ep))
    model = build_stage(cfg.model, 1, state, ParallelContext.from_state(state, cfg))
    opt = DistributedOptimizer(named_trainable(model), cfg.train, state, zero=p.zero, precision=cfg.train.precision,
                               bucket_bytes=bucket)
    measured = plan.measure_state(opt, model)
    opt.remove_hooks()
    rows: list[int] = []
    tokens = torch.randint(0, 250, (cfg.train.micro_batch_size, cfg.model.seq_length),
                           generator=torch.Generator().manual_seed(rank))
    with comm.observe(lambda ev: rows.append(ev.tensor.numel() * ev.tensor.element_size())
                      if ev.op == "all_to_all" and ev.tensor.dtype != torch.int64 else None):
        model(tokens, labels=tokens).sum().backward()
    state.destroy()
    return {"state": measured, "a2a": sum(rows)}


def test_moe_state_and_all_to_all_equal_a_real_ep2_run() -> None:
    from megatron_sp.testing import run_distributed

    overrides = [*MOE, "parallel.dp=4", "parallel.zero=1", "train.global_batch_size=8", "model.moe_shared_experts=1"]
    results = run_distributed(_moe_rank, 4, overrides=overrides, bucket=20_000)
    cfg = make_config(*overrides)
    st = plan.state_bytes(cfg, 0, 20_000)  # ZeRO-1: experts sharded over edp = 2 (padded to it), the rest over 4
    assert all(r["state"] == {"params": st.params, "grads": st.grads, "optim": st.optim} for r in results)
    # dropless: the dispatch sends and the combine receives T·k rows on every rank, so the ranks' sum is exact
    assert sum(r["a2a"] for r in results) == 4 * plan.moe_all_to_all_bytes(cfg)


def test_moe_search_keeps_ep_and_refuses_layouts_it_does_not_divide() -> None:
    def build(extra: list[str]):
        return make_config(*MOE, "model.num_layers=4", "train.global_batch_size=16", *extra)

    base = build(["parallel.dp=2"])
    cands = plan.search(build, base, 8, 10**12, 100.0, 100.0)
    for c in cands:  # ep stays 2: a layout whose cp·dp it does not divide is refused
        tp, pp, cp, dp = c.layout
        assert (c.plan is None) >= (cp * dp % 2 == 1)
        assert c.plan is None or (c.plan.dims.ep, c.plan.dims.edp) == (2, cp * dp // 2)
    assert any(c.plan is not None for c in cands) and any("parallel.ep" in c.error for c in cands)
    from megatron_sp.model import flops_per_token  # active parameters: router E·h, top-2 of the 4 experts

    tp2 = build(["parallel.tp=2", "parallel.dp=2", "parallel.pp=2", "parallel.world_size=8"])
    assert sum(plan.stage_flops(tp2, r) for r in range(2)) * 2 == pytest.approx(8 * 32 * flops_per_token(tp2.model))
    router_and_experts = 6 * 8 * 32 * 4 * (4 * 64 + 2 * 6144)  # replicated over tp 2 without SP: half again per rank
    assert sum(plan.stage_flops(tp2, r, executed=True) - plan.stage_flops(tp2, r) for r in range(2)) == router_and_experts / 2
    assert "ep 2 (2 experts per rank) × edp 1" in "\n".join(plan_cli.describe(make_config(*MOE, "parallel.dp=2",
                                                                                       "train.global_batch_size=4"), ""))


@pytest.mark.parametrize("overrides", [
    ("train.precision=bf16", "model.moe_shared_experts=2", "model.moe_router_score=sigmoid"),
    ("model.arch=neox", "model.moe_top_k=1", "model.recompute=selective", "model.num_layers=3", "model.moe_layer_freq=2"),
])
def test_moe_activations_match_saved_tensors(overrides: tuple[str, ...]) -> None:
    cfg = make_config(*MOE[:-1], "train.global_batch_size=4", *overrides)
    chunk = plan.chunk_activations(cfg, 0, 0)
    assert chunk.moe_layers == 2 and chunk.layers == cfg.model.num_layers  # layers 0, 1 or 0, 2
    predicted = chunk.per_micro_batch + sum(chunk.shared.values())
    measured = plan.micro_batch_saved_bytes(cfg)
    assert abs(measured / predicted - 1) <= 0.01, (measured, predicted)  # the grouped GEMM's offsets are left out


# ------------------------------------------------------------------------------------------ activations


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_activations_match_saved_tensors(arch: str, recompute: str) -> None:
    extra = ("model.num_kv_heads=2", "train.precision=bf16") if arch == "llama" else ()
    cfg = make_config(f"model.arch={arch}", f"model.recompute={recompute}", "train.global_batch_size=4", *extra)
    chunk = plan.chunk_activations(cfg, 0, 0)
    predicted = chunk.per_micro_batch + sum(chunk.shared.values())
    measured = plan.micro_batch_saved_bytes(cfg)
    assert abs(measured / predicted - 1) <= 0.10, (measured, predicted)


@pytest.mark.parametrize("extra", [(), ("model.q_lora_rank=0",), ("train.precision=bf16", "model.recompute=selective")])
def test_latent_attention_activations_match_saved_tensors(extra: tuple[str, ...]) -> None:
    """MLA's latents, their norms and rotary inputs (``mla_terms``): measured 1.000 without a query latent, 1.019
    with one (fp32), 1.07 in bf16 (the latent norms' fp32 copies under autocast are not modelled)."""
    cfg = make_config("model.arch=llama", "train.global_batch_size=4", "model.kv_lora_rank=32", "model.q_lora_rank=48",
                      "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16", *extra)
    chunk = plan.chunk_activations(cfg, 0, 0)
    predicted = chunk.per_micro_batch + sum(chunk.shared.values())
    assert abs(plan.micro_batch_saved_bytes(cfg) / predicted - 1) <= 0.08


# ------------------------------------------------------------------------------------------ layouts


def test_layout_search_is_sorted_and_respects_the_config_checks() -> None:
    base = make_config("model.num_layers=4", "train.global_batch_size=16")
    cands = plan.search(lambda extra: make_config("model.num_layers=4", "train.global_batch_size=16", *extra),
                        base, 8, 10**12, 100.0, 100.0)
    assert sorted(c.layout for c in cands) == sorted(plan.factorizations(8)) and len(cands) == 20
    for c in cands:
        assert math.prod(c.layout) == 8
        tp, pp, cp, dp = c.layout
        if c.plan is None:  # refused by the loader itself, with its message
            assert c.error
            with pytest.raises(ConfigError):
                make_config("model.num_layers=4", "train.global_batch_size=16", *plan.layout_overrides(base, *c.layout))
        else:
            p = c.plan.cfg.parallel
            assert (p.tp, p.pp, p.cp, p.dp) == c.layout and 4 % tp == 0 and 4 % pp == 0
    assert next(c for c in cands if c.layout == (8, 1, 1, 1)).plan is None  # 4 heads do not split over 8
    valid = [c for c in cands if c.plan is not None]
    assert all(c.plan is not None for c in cands[:len(valid)]) and all(c.fits for c in valid)
    times = [c.plan.time["step_s"] for c in valid]
    assert times == sorted(times)
    # a budget between the smallest and the largest per-rank peak: those that fit come first
    peaks = sorted(c.plan.peak_bytes for c in valid)
    budget = peaks[len(peaks) // 2]
    ranked = plan.search(lambda extra: make_config("model.num_layers=4", "train.global_batch_size=16", *extra),
                         base, 8, budget, 100.0, 100.0)
    fits = [c.fits for c in ranked if c.plan is not None]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    assert all(c.plan.peak_bytes <= budget for c in ranked if c.fits)


def test_step_flops_count_causal_attention_and_mfu_stays_below_one() -> None:
    from megatron_sp.model import count_parameters, flops_per_token

    cfg = make_config("model.num_layers=4", "train.global_batch_size=16", "parallel.pp=2", "parallel.tp=2",
                      "parallel.world_size=4")
    # per token: 6N + 6·L·h·s with L=4, h=64, s=32 (the causal half of PaLM's 12·L·h·s)
    per_token = 6 * count_parameters(cfg.model) + 6 * 4 * 64 * 32
    assert flops_per_token(cfg.model) == per_token
    tokens = 16 * 32
    total = sum(plan.stage_flops(cfg, r) for r in range(2)) * 2  # each stage's rank holds 1/tp of it
    assert total == pytest.approx(tokens * per_token, rel=1e-12)
    selective = make_config("model.num_layers=4", "train.global_batch_size=16", "model.recompute=selective")
    assert plan.stage_flops(selective, 0) - plan.stage_flops(selective, 0, "none") == pytest.approx(tokens * 2 * 4 * 64 * 32)
    # MFU = model FLOPs / (step × peak × devices) ≤ 1 whatever the layout, recompute, bubble and peak
    for recompute in ("none", "full"):
        base = make_config("model.num_layers=4", "train.global_batch_size=16", f"model.recompute={recompute}")
        for peak, bandwidth in ((1e-6, 1e6), (100.0, 100.0)):
            cands = plan.search(lambda extra, r=recompute: make_config("model.num_layers=4", "train.global_batch_size=16",
                                                                       f"model.recompute={r}", *extra),
                                base, 8, 10**12, peak, bandwidth)
            mfus = [c.plan.time["mfu"] for c in cands if c.plan is not None]
            assert mfus and all(0 < m <= 1 for m in mfus)
            if recompute == "none" and peak < 1:  # compute-bound, no bubble: MFU is the whole peak
                assert max(mfus) == pytest.approx(1.0, rel=1e-9)


# ------------------------------------------------------------------------------------------ command line


def _write_conf(path: Path, data: str = "unused") -> Path:
    path.write_text(f"""
model: {{arch: neox, num_layers: 2, hidden_size: 64, num_heads: 4, seq_length: 64, make_vocab_size_divisible_by: 32}}
train: {{micro_batch_size: 2, global_batch_size: 4}}
tokenizer: {{type: byte}}
data: {{paths: [{data}], cache_dir: {path.parent / 'cache'}}}
""")
    return path


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = str(_write_conf(tmp_path / "tiny.yml"))
    with pytest.raises(SystemExit) as exc:
        plan_cli.main(["--conf", conf, "--memory", "80GB"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error:") and err.count("\n") == 1 and "--devices" in err
    assert plan_cli.main(["--conf", conf, "--devices", "4", "--memory", "80XB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --memory '80XB'") and err.count("\n") == 1
    assert plan_cli.main(["--conf", conf, "--devices", "4", "--memory", "1GB", "--set", "model.num_layres=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "did you mean" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exc:  # searched for minutes, silently
        plan_cli.main(["--conf", conf, "--devices", "1000000000000", "--memory", "80GB"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: --devices must be in 1..1048576") and err.count("\n") == 1
    assert plan.factorizations(2**40)[:2] == [(1, 1, 1, 2**40), (1, 1, 2, 2**39)]  # no O(n) divisor scan


@pytest.fixture(autouse=True)
def cpu_peak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> float:
    """The CLI ranks CPU plans by this host's measured peak: a fixed 50 GFLOP/s here (no 1 s measurement), cached
    in a temporary directory (not the user's)."""
    from megatron_sp import device

    monkeypatch.setenv(device.PEAK_CACHE_ENV, str(tmp_path / "peak_cache"))
    monkeypatch.setattr(device, "measured_peak_flops", lambda dtype: 5e10)
    return 5e10


def _json_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("{")]


def test_cli_prints_no_json_without_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = str(_write_conf(tmp_path / "tiny.yml"))
    args = ["--conf", conf, "--devices", "4", "--memory", "1GiB", "--set", "train.global_batch_size=8"]
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and not _json_lines(out) and max(len(line) for line in out.splitlines()) < 400
    assert plan_cli.main([*args, "--json", str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    assert not _json_lines(out) and "report.json" in out.splitlines()[-1]
    assert json.loads((tmp_path / "report.json").read_text())["vocab"] == 258
    assert plan_cli.main([*args, "--json", str(tmp_path / "missing" / "report.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --json") and err.count("\n") == 1


def test_cli_prints_the_breakdown_and_a_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = str(_write_conf(tmp_path / "tiny.yml"))
    assert plan_cli.main(["--conf", conf, "--devices", "4", "--memory", "1GiB", "--set", "parallel.tp=2",
                          "train.global_batch_size=8", "--json"]) == 0
    out = capsys.readouterr().out
    assert len(_json_lines(out)) == 1
    assert "memory per rank" in out and "activations at peak" in out and "Table 2" in out and "decode KV cache" in out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["memory_bytes"] == 2**30 and report["vocab"] == 258
    assert report["config_layout"]["layout"] == {"tp": 2, "pp": 1, "cp": 1, "dp": 1}
    fits = [row["fits"] for row in report["layouts"]]
    assert fits == sorted(fits, reverse=True)
    layouts = {(r["tp"], r["pp"], r["cp"], r["dp"]) for r in report["layouts"]}
    assert (1, 1, 1, 4) in layouts and all(math.prod(k) == 4 for k in layouts)


def _table(out: str) -> list[list[str]]:
    """The rows of the ranking table, split into columns."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "tp"])
    return [line.split() for line in lines[start + 1:] if line.split() and line.split()[0].isdigit()]


def test_cli_breakdown_is_of_a_layout_at_devices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The breakdown is the config's layout only when its world size is --devices; else the best-ranked layout
    that fits, named. The config's layout is marked in the table (* exact, + its tp·pp·cp at another dp)."""
    conf = str(_write_conf(tmp_path / "tiny.yml"))
    base = ["--conf", conf, "--memory", "1GiB", "--json", "--set", "parallel.pp=2", "train.global_batch_size=8"]
    assert plan_cli.main([*base, "--devices", "2"]) == 0  # the config's world: pp 2 · dp 1
    out = capsys.readouterr().out
    report = json.loads(_json_lines(out)[0])
    assert "breakdown of the config's layout (tp 1, pp 2, cp 1, dp 1 = 2 devices)" in out
    assert report["breakdown_layout"]["tp"] == 1 and report["breakdown_layout"]["pp"] == 2
    marked = [row for row in _table(out) if row[-1] in ("*", "+")]
    assert [row[1:5] for row in marked] == [["1", "2", "1", "1"]] and marked[0][-1] == "*"
    assert "(* = the config's layout)" in out

    assert plan_cli.main([*base, "--devices", "1"]) == 0  # pp 2 cannot run on one device
    out = capsys.readouterr().out
    report = json.loads(_json_lines(out)[0])
    assert "stage 1" not in out.split("ranking:")[0]  # not the config's two-stage breakdown
    assert "breakdown of tp 1, pp 1, cp 1, dp 1: the best-ranked layout that fits at --devices 1" in out
    assert "has 2 ranks, not 1" in out and "tp·pp·cp = 2 does not divide 1 devices" in out
    assert {k: report["breakdown_layout"][k] for k in ("tp", "pp", "cp", "dp")} == {"tp": 1, "pp": 1, "cp": 1, "dp": 1}
    assert report["config_layout"]["layout"]["pp"] == 2  # the JSON keeps the config's own plan

    assert plan_cli.main([*base, "--devices", "4"]) == 0  # pp 2 at dp 2: marked +
    out = capsys.readouterr().out
    assert [row[1:5] + row[-1:] for row in _table(out) if row[-1] == "+"] == [["1", "2", "1", "2", "+"]]
    assert "(+ = the config's tp 1, pp 2, cp 1 at dp 2 (the config: dp 1, world 2))" in out
    assert plan_cli.main([*base, "--devices", "4", "--top", "1"]) == 0  # ranked lower: shown below the table
    table = _table(capsys.readouterr().out)
    assert table[-1][1:5] == ["1", "2", "1", "2"] and table[-1][-1] == "+" and int(table[-1][0]) > 1


def test_cli_peak_follows_the_device(tmp_path: Path, capsys: pytest.CaptureFixture[str], cpu_peak: float) -> None:
    """--device cpu ranks by this host's measured CPU peak (the MFU denominator train.py uses), --device cuda by
    312 TFLOP/s unless --peak-tflops; the header names the peak and its source; without --device one line says
    which device was modelled."""
    conf = str(_write_conf(tmp_path / "tiny.yml"))
    base = ["--conf", conf, "--devices", "2", "--memory", "1GiB", "--json"]

    def run(*extra: str) -> tuple[str, dict]:
        assert plan_cli.main([*base, *extra]) == 0
        out = capsys.readouterr().out
        return out, json.loads(_json_lines(out)[0])

    out, report = run("--device", "cpu")
    header = next(line for line in out.splitlines() if line.startswith("peak per device:"))
    # the 2 ranks share this host: each has half its peak
    assert report["peak_tflops"] == pytest.approx(cpu_peak / 2e12) and "peak per device: 0.025 TFLOP/s" in header
    assert "this host's CPU fp32 matmul peak" in header and str(tmp_path / "peak_cache") in header
    assert "device modelled: cpu (--device cpu)" in out
    slow = {(r["tp"], r["pp"], r["cp"], r["dp"]): r["step_s"] for r in report["layouts"]}
    out, report = run("--device", "cpu", "--peak-tflops", "5")
    assert report["peak_tflops"] == 5 and report["peak_source"] == "--peak-tflops"
    fast = {(r["tp"], r["pp"], r["cp"], r["dp"]): r["step_s"] for r in report["layouts"]}
    assert all(fast[k] < slow[k] for k in slow)
    out, report = run("--device", "cuda")
    assert report["peak_tflops"] == plan.DEFAULT_PEAK_TFLOPS and "an A100's" in report["peak_source"]
    out, report = run()
    line = next(line for line in out.splitlines() if line.startswith("device modelled:"))
    assert "parallel.device unset" in line and "--device" in line


def test_verify_on_two_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_sp.config import TokenizerConfig
    from megatron_sp.data import build_tokenizer
    from megatron_sp.data.corpus import make_demo_corpus
    from megatron_sp.data.preprocess import preprocess_jsonl

    corpus = make_demo_corpus(tmp_path / "corpus.jsonl", max_bytes=60_000)
    preprocess_jsonl([corpus], str(tmp_path / "byte"), build_tokenizer(TokenizerConfig(type="byte")))
    conf = str(_write_conf(tmp_path / "tiny.yml", str(tmp_path / "byte_text_document")))
    # tp 2 > 1 kv head: replicated QKV; SwiGLU, RMSNorm, bf16, sequence parallel with its gather buffer
    assert plan_cli.main(["--conf", conf, "--verify", "--steps", "1", "--json", "--set", "model.arch=llama",
                          "model.num_kv_heads=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                          "train.precision=bf16"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["verify"]
    by = {r["quantity"]: r for r in rows}
    for exact in ("parameters", "gradients", "optimizer state", "SP gather buffer"):
        assert by[exact]["measured"] == by[exact]["predicted"], by[exact]
    for r in rows:
        assert abs(r["ratio"] - 1) <= 0.10, r
