"""The layout planner's expert tensor parallelism (``parallel.expert_tp`` = tp, no SP; docs/planner.md, "Mixture of
experts"): each TP rank holds moe_ffn/tp of every expert, the expert output rows and the tokens' gradient are
all-reduced over tp, no expert FLOP is repeated on the TP ranks; the search and the pre-flight's suggestion keep
expert_tp at the candidate's tp. By hand, then ``--verify`` on two gloo ranks (every row equal to its prediction up
to the grouped GEMM's int32 offsets the activation model leaves out)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_sp import config

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plan_cli_moe", ROOT / "tools" / "plan.py")
assert _spec is not None and _spec.loader is not None
plan_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_cli)  # puts tools/ on sys.path: the planner package is importable from here on
plan = plan_cli.plan

# llama, h 64, 2 MoE layers of 4 experts of width f 32, top-2; s 32, b 2, 2 micro-batches; tp 2
ETP = ["data.paths=[unused]", "tokenizer.type=byte", "model.arch=llama", "model.num_layers=2", "model.hidden_size=64",
       "model.num_heads=4", "model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4",
       "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "parallel.tp=2"]


def make_config(*overrides: str):
    cfg = config.load(overrides=[*ETP, *overrides])
    config.set_vocab(cfg, 250)
    return cfg


def test_expert_tp_by_hand() -> None:
    split, whole = make_config("parallel.expert_tp=2"), make_config()
    shapes = {n.split("experts.")[1]: (tuple(q.shape), q.tensor_model_parallel, q.partition_dim, q.sequence_parallel)
              for n, q in plan.stage_parameters(make_config("parallel.expert_tp=2", "model.arch=neox"))
              if n.startswith("layers.0.mlp.experts.")}
    assert shapes == {"fc1.weight": ((4, 16, 64), True, 1, False), "fc1.bias": ((4, 16), True, 1, False),
                      "fc2.weight": ((4, 64, 16), True, 2, False),
                      "fc2.bias": ((4, 64), False, -1, True)}  # whole on every TP rank, its gradient summed over tp
    # llama: gate, up, down = 3·64·32 per expert, 4 experts, 2 layers: half of them per TP rank
    st, st1 = plan.state_bytes(split), plan.state_bytes(whole)
    assert st1.param_elements - st.param_elements == 2 * 4 * 3 * 64 * 32 // 2
    assert (st.params, st.grads, st.optim) == (4 * st.param_elements, 4 * st.param_elements, 8 * st.param_elements)

    # the experts' inner activations are f/2 wide; the router, rows and combine do not change
    D, D1 = plan.dims_of(split), plan.dims_of(whole)
    assert (D.etp, D.expert_local_ffn, D1.etp) == (2, 16, 1)
    terms, terms1 = plan.moe_terms(D), plan.moe_terms(D1)
    T, R = 64, 128  # b·s tokens on every TP rank, T·k rows
    assert terms["expert gate/up output"] == R * 2 * 16 * 4 and terms["expert down input"] == R * 16 * 4
    assert terms["expert gate/up weight copy"] == 4 * 2 * 16 * 64 * 4
    assert {k: v for k, v in terms.items() if "expert " not in k} == {k: v for k, v in terms1.items() if "expert " not in k}

    # TP: per MoE layer and micro-batch the rows [R, h] forward (twice under full recompute), the tokens' gradient
    # [T, h] backward; an all-reduce over 2 ranks sends 2·(1/2) of its bytes; bf16 rows under bf16
    def tp_all_reduce(*extra: str) -> float:
        return plan.comm_per_step(make_config(*extra))["tp"]["all_reduce"]
    assert tp_all_reduce("parallel.expert_tp=2") - tp_all_reduce() == 2 * 2 * (R + T) * 64 * 4
    full = ("model.recompute=full", "train.precision=bf16")
    assert tp_all_reduce("parallel.expert_tp=2", *full) - tp_all_reduce(*full) == 2 * 2 * (2 * R + T) * 64 * 2

    # executed FLOPs: without expert TP every TP rank runs the router and 2 experts per token, with it the router only
    tokens, router, experts = 4 * 32, 4 * 64, 2 * 3 * 64 * 32
    assert plan.stage_flops(whole, 0, executed=True) - plan.stage_flops(whole, 0) == 6 * tokens * 2 * (router + experts) / 2
    assert plan.stage_flops(split, 0, executed=True) - plan.stage_flops(split, 0) == 6 * tokens * 2 * router / 2
    assert plan.stage_flops(split, 0) == plan.stage_flops(whole, 0)  # the model's FLOPs, as the MFU counts them
    assert "split over expert_tp 2 (ffn 16 per TP rank)" in "\n".join(plan_cli.describe(split, ""))


def test_expert_tp_follows_the_candidate_tp() -> None:
    def build(extra: list[str]):
        return make_config("model.num_heads=8", "train.global_batch_size=8", *extra)

    def expert_tp(base, tp: int) -> str:
        return next(o for o in plan.layout_overrides(base, tp, 1, 1, 8 // tp) if o.startswith("parallel.expert_tp="))

    split = build(["parallel.expert_tp=2", "parallel.dp=2"])
    assert [expert_tp(split, tp) for tp in (1, 2, 4)] == [f"parallel.expert_tp={tp}" for tp in (1, 2, 4)]
    assert expert_tp(build(["parallel.dp=2"]), 4) == "parallel.expert_tp=1"  # experts whole: they stay whole
    cands = plan.search(build, split, 8, 10**12, 100.0, 100.0)
    valid = [c for c in cands if c.plan is not None]
    assert {c.layout[0] for c in valid} == {1, 2, 4, 8} and all(c.plan.dims.etp == c.layout[0] for c in valid)
    from planner.preflight import _layout_args
    assert _layout_args(split, (4, 1, 1, 2)) == ["parallel.tp=4", "parallel.expert_tp=4"]
    assert _layout_args(split, (1, 1, 1, 8)) == ["parallel.tp=1", "parallel.dp=8", "parallel.expert_tp=1"]


def tiny_byte_conf(tmp_path: Path, global_batch: int) -> Path:
    """A 2-layer neox config file over a 60 kB byte-tokenized demo corpus in ``tmp_path`` (for ``--verify`` runs)."""
    from megatron_sp.config import TokenizerConfig
    from megatron_sp.data import build_tokenizer
    from megatron_sp.data.corpus import make_demo_corpus
    from megatron_sp.data.preprocess import preprocess_jsonl

    corpus = make_demo_corpus(tmp_path / "corpus.jsonl", max_bytes=60_000)
    preprocess_jsonl([corpus], str(tmp_path / "byte"), build_tokenizer(TokenizerConfig(type="byte")))
    conf = tmp_path / "tiny.yml"
    conf.write_text(f"""
model: {{arch: neox, num_layers: 2, hidden_size: 64, num_heads: 4, seq_length: 64, make_vocab_size_divisible_by: 32}}
train: {{micro_batch_size: 2, global_batch_size: {global_batch}}}
tokenizer: {{type: byte}}
data: {{paths: [{tmp_path / 'byte_text_document'}], cache_dir: {tmp_path / 'cache'}}}
""")
    return conf


def test_expert_tp_verify_on_two_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tiny_byte_conf(tmp_path, 4)
    # neox (expert biases), a shared expert, bf16 under full recompute: the rows all-reduced twice per forward
    assert plan_cli.main(["--conf", str(conf), "--verify", "--steps", "1", "--json", "--set", "model.num_experts=4",
                          "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "model.moe_shared_experts=1",
                          "parallel.tp=2", "parallel.expert_tp=2", "model.recompute=full", "train.precision=bf16"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["config_layout"]["layout"] == {"tp": 2, "pp": 1, "cp": 1, "dp": 1, "ep": 1, "expert_tp": 2}
    by = {r["quantity"]: r for r in report["verify"]}
    for exact in ("parameters", "gradients", "optimizer state", "activations / micro-batch", "sent per step: all_reduce"):
        assert by[exact]["measured"] == by[exact]["predicted"], by[exact]
    for r in report["verify"]:
        assert abs(r["ratio"] - 1) <= 0.01, r
