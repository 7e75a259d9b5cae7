"""The planner at ZeRO-2 and ZeRO-3 (``tools/planner/zero.py``): persistent bytes per parameter, the staging buffers and
gathered units in the peak, the all-gather / reduce-scatter bytes per step by hand, the search and the pre-flight
reaching for ZeRO-3 when only it fits, and ``--verify`` at dp2 ZeRO-3 on two gloo ranks (every row measured exactly).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_sp import config, device

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plan_cli_zero", ROOT / "tools" / "plan.py")
assert _spec is not None and _spec.loader is not None
plan_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_cli)  # puts tools/ on sys.path
plan = plan_cli.plan
from planner import preflight, zero  # noqa: E402

TINY = ["data.paths=[unused]", "tokenizer.type=byte", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
        "model.seq_length=32", "train.micro_batch_size=2", "train.precision=bf16", "model.tie_embeddings=true"]
GATHERED = "ZeRO-3 gathered params (prefetch {})"


def make_config(*overrides: str):
    cfg = config.load(overrides=[*TINY, *overrides])
    config.set_vocab(cfg, 250)  # padded to 256
    return cfg


def test_zero3_bytes_gathered_units_and_traffic_by_hand() -> None:
    # units: embedding 256·64 = 16384, each layer 49984, the head (tied at pp 1: the final norm) 128; Φ = 116480
    emb, layer, head = 16384, 49984, 128
    n = emb + 2 * layer + head
    dp2 = [f"parallel.dp={2}", "train.global_batch_size=8"]  # 2 micro-batches per rank
    st = plan.state_bytes(make_config(*dp2, "parallel.zero=3"))
    assert st.units == {"embedding": (emb, 0), "layers.0": (layer, 0), "layers.1": (layer, 0), "head": (head, 0)}
    assert (st.params, st.grads, st.optim) == (2 * n // 2, 4 * n // 2, 12 * n // 2)  # 2Φ/d + 4Φ/d + 12Φ/d
    odd = plan.state_bytes(make_config("parallel.dp=3", "train.global_batch_size=12", "parallel.zero=3"))
    assert abs(odd.total / (18 * n / 3) - 1) < 0.05  # each unit's bucket padded to a multiple of 3
    # in the peak, prefetch 1: backward of layer 1 holds layers 0 and 1 with the tied embedding (gathered for the
    # head, its gradient complete only after the lookup's backward); prefetch 0: one layer and the embedding
    for prefetch, held in ((1, 2 * layer + emb), (0, layer + emb)):
        buffers = plan.plan_layout(make_config(*dp2, "parallel.zero=3", f"parallel.zero3_prefetch={prefetch}")).stages[0].buffers
        assert buffers[GATHERED.format(prefetch)] == 2 * held
        assert buffers["ZeRO-3 grad staging (fp32, ≤ 3 buckets)"] == 4 * (2 * layer + emb)  # the 3 largest buckets
    zero2 = plan.plan_layout(make_config(*dp2, "parallel.zero=2")).stages[0].buffers  # one bucket of everything
    assert zero2["ZeRO-2 grad staging (fp32, ≤ 3 buckets)"] == 4 * n and not any("gathered" in k for k in zero2)
    # zero-bubble: a unit stays gathered from a micro-batch's input-gradient action to its weight-gradient action
    zb = make_config("model.num_layers=4", "parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.dp=2",
                     "train.global_batch_size=16", "parallel.zero=3")
    assert zero.gathered_bytes(zb, 1) == 2 * sum(a + b for a, b in plan.state_bytes(zb, 1).units.values())

    # per step, m = 2, over 2 ranks (half of each gathered buffer / staged gradient is the others'): ZeRO-3 gathers
    # every forward entry's units (embedding, layer 0, layer 1, head + embedding) and, for backward, each unit once
    book = {z: plan.comm_per_step(make_config(*dp2, f"parallel.zero={z}"))["dp"] for z in (1, 2, 3)}
    assert book[3] == {"all_gather": 2 * (1 / 2) * 2 * ((2 * emb + 2 * layer + head) + n), "reduce_scatter": 2 * (1 / 2) * 4 * n}
    assert book[2] == {"all_gather": (1 / 2) * 2 * n, "reduce_scatter": 2 * (1 / 2) * 4 * n}  # the step's end gather
    assert book[1] == {"all_gather": (1 / 2) * 2 * n, "reduce_scatter": (1 / 2) * 4 * n}


GiB = 2**30
ONLY_ZERO3 = ["data.paths=[unused]", "tokenizer.type=byte", "model.num_layers=7", "model.hidden_size=240",
              "model.num_heads=3", "model.seq_length=16", "train.micro_batch_size=1", "train.global_batch_size=2",
              "train.precision=bf16", "parallel.dp=2", "parallel.device=cuda", "parallel.backend=nccl"]


def test_the_search_and_the_preflight_reach_for_zero3_when_only_it_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """7 layers (no pp 2), 3 heads (no tp 2): of 2 GPUs only dp 2 and cp 2 remain, and only ZeRO-3 fits the budget
    (ZeRO-2's staging buffer is its one bucket of every gradient: more than ZeRO-1 here)."""
    def build(extra: list[str]):
        cfg = config.load(overrides=[*ONLY_ZERO3, *extra])
        config.set_vocab(cfg, 258)
        return cfg

    lean = {z: min(plan.plan_layout(build([f"parallel.{d}=2", "parallel.dp=1" if d == "cp" else "parallel.cp=1",
                                           "model.recompute=full", f"parallel.zero={z}"])).peak_bytes for d in ("dp", "cp"))
            for z in (1, 2, 3)}
    assert lean[3] < lean[1] < lean[2]
    budget = (lean[3] + lean[1]) // 2
    cands = plan.search(build, build([]), 2, budget, 312, 100, knobs=True)
    fits = [c for c in cands if c.fits]
    assert fits and all(c.plan.dims.zero == 3 and c.layout in ((1, 1, 1, 2), (1, 1, 2, 1)) for c in fits)
    monkeypatch.setattr(device, "accelerator_memory_bytes", lambda local_rank=0: budget + preflight.PROCESS_BYTES)
    with pytest.raises(preflight.PreflightError, match=r"on these GPUs try `.*parallel\.zero=3.*`"):
        preflight.check(build([]), build, 2)


def test_verify_zero3_on_two_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from test_plan_moe import tiny_byte_conf

    conf = tiny_byte_conf(tmp_path, 8)

    # dp 2, 2 micro-batches, tied embeddings (gathered with the head too), bf16 with fp32 masters, prefetch 1
    assert plan_cli.main(["--conf", str(conf), "--verify", "--steps", "1", "parallel.dp=2", "parallel.zero=3",
                          "model.tie_embeddings=true", "train.precision=bf16", "--json"]) == 0
    rows = {r["quantity"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["verify"]}
    for exact in ("parameters", "gradients", "optimizer state", "ZeRO-3 gathered params at peak",
                  "sent per step: all_gather", "sent per step: reduce_scatter", "activations at peak (schedule)"):
        assert rows[exact]["measured"] == rows[exact]["predicted"] > 0, rows[exact]


def test_muon_keeps_one_state_buffer_per_muon_element() -> None:
    from megatron_sp.model import GPTModel
    from megatron_sp.optim.muon import is_muon_param

    cfg = make_config("train.optimizer=muon")
    named = list(GPTModel(cfg.model, 1).named_parameters())
    muon = sum(p.numel() for n, p in named if is_muon_param(n, p))
    adam = sum(p.numel() for _, p in named) - muon
    st, ref = plan.state_bytes(cfg), plan.state_bytes(make_config())
    assert muon > 0 and st.optim == 4 * (muon + 2 * adam) + 4 * (muon + adam)  # momentum / m, v; fp32 masters (bf16)
    assert ref.optim == 12 * (muon + adam)
    # dp2 ZeRO-1: the Muon matrices gathered for their owners and their results reduce-scattered back, fp32, beside the
    # gradients' reduce-scatter and the bf16 parameters' all-gather (measured equal by tools/plan.py --verify)
    dp2 = make_config("train.optimizer=muon", "parallel.dp=2", "parallel.zero=1", "train.global_batch_size=4")
    n = plan.state_bytes(dp2).padded_elements
    book = plan.comm_per_step(dp2)["dp"]
    assert book["all_gather"] == n / 2 * 2 + muon / 2 * 4 and book["reduce_scatter"] == (n + muon) / 2 * 4
