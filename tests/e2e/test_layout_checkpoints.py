"""Checkpoints across layouts end to end: same-layout resume is bitwise, other layouts continue."""
from __future__ import annotations

import json
from pathlib import Path

from .runs import metrics, train

LLAMA = ["model.arch=llama", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_multiple_of=32"]


def test_tp_checkpoint_resumes_bitwise_and_at_another_layout(tmp_path, byte_data):
    """tp2 with hidden dropout: 5 steps + resume + 5 steps is bitwise the 10-step run; the same checkpoint resumes
    at tp1 on the same trajectory (reduction order only): the TP-same stream that hidden dropout draws from maps
    to any tp and is restored, the tp-different one is reseeded, in one log line."""
    tp2 = ["parallel.tp=2", "model.hidden_dropout=0.1"]
    full, first, again, other = (tmp_path / n for n in ("full", "first", "again", "tp1"))
    train(full, byte_data, "train.iters=10", *tp2)
    train(first, byte_data, "train.iters=5", f"checkpoint.save={first}/ckpt", *tp2)
    train(again, byte_data, "train.iters=10", f"checkpoint.load={first}/ckpt", *tp2)
    out = train(other, byte_data, "train.iters=10", f"checkpoint.load={first}/ckpt", "model.hidden_dropout=0.1")
    ref, same, moved = metrics(full), metrics(again), metrics(other)
    assert sorted(same) == sorted(moved) == [6, 7, 8, 9, 10]
    for s in same:
        assert same[s]["loss"] == ref[s]["loss"], s                                 # same layout: bitwise
        assert abs(moved[s]["loss"] - ref[s]["loss"]) <= 5e-6 * ref[s]["loss"], s   # tp2 → tp1: reduction order only
    reseeded = [line for line in (out.stdout + out.stderr).splitlines() if "reseeded" in line]
    assert len(reseeded) == 1 and "RNG streams tracker/tp-different reseeded" in reseeded[0], reseeded
    assert reseeded[0].endswith("restored: cpu"), reseeded


def test_pipeline_checkpoint_resumes_without_pipeline(tmp_path, byte_data):
    """A pp2 checkpoint of a tied llama (the embedding stored once) resumes at pp1 on the same trajectory."""
    tied = LLAMA + ["model.tie_embeddings=true"]
    full, first, other = tmp_path / "full", tmp_path / "first", tmp_path / "pp1"
    train(full, byte_data, "train.iters=8", "parallel.pp=2", *tied)
    train(first, byte_data, "train.iters=4", "parallel.pp=2", f"checkpoint.save={first}/ckpt", *tied)
    train(other, byte_data, "train.iters=8", f"checkpoint.load={first}/ckpt", *tied)
    ref, got = metrics(full), metrics(other)
    assert sorted(got) == [5, 6, 7, 8]
    for s in got:
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= 5e-6 * ref[s]["loss"], s


def test_zero_bubble_checkpoint_resumes_bitwise_and_interleaved(tmp_path, byte_data):
    """Zero-bubble pp2: resume is bitwise although each step's table follows the measured costs (the
    gradients are summed in micro-batch order whatever the table); the checkpoint continues at
    interleaved pp2·v2 within the parity tolerance."""
    model = ["model.num_layers=4", "parallel.pp=2"]
    zb = ["parallel.pp_schedule=zero_bubble"]
    interleaved = ["parallel.pp_schedule=interleaved", "parallel.virtual_stages=2"]
    full, first, again, other = (tmp_path / n for n in ("full", "first", "again", "interleaved"))
    train(full, byte_data, "train.iters=8", *model, *zb)
    train(first, byte_data, "train.iters=4", f"checkpoint.save={first}/ckpt", *model, *zb)
    train(again, byte_data, "train.iters=8", f"checkpoint.load={first}/ckpt", *model, *zb)
    train(other, byte_data, "train.iters=8", f"checkpoint.load={first}/ckpt", *model, *interleaved)
    ref, same, moved = metrics(full), metrics(again), metrics(other)
    assert sorted(same) == sorted(moved) == [5, 6, 7, 8]
    for s in same:
        assert same[s]["loss"] == ref[s]["loss"] and same[s]["grad_norm"] == ref[s]["grad_norm"], s
        assert abs(moved[s]["loss"] - ref[s]["loss"]) <= 5e-6 * ref[s]["loss"], s


def test_checkpoints_move_between_layouts(tmp_path, byte_data):
    """Save under A, load under B, continue within 1e-5 of the uninterrupted 1-rank run:
    tp2·pp2 → 1 rank, 1 rank → tp4, cp2 (zigzag) → cp1 (dp2 + ZeRO-1 → dp1/dp4: test_train.py).
    Every saving rank wrote its own shard file (sharded format)."""
    model = ["model.num_layers=4"]
    cp2 = ["parallel.cp=2", "parallel.cp_algo=zigzag"]
    cases = {"tp2pp2_to_1": (["parallel.tp=2", "parallel.pp=2"], []),
             "1_to_tp4": ([], ["parallel.tp=4"]),
             "cp2_to_cp1": (cp2, [])}
    reference = tmp_path / "reference"  # its step-4 checkpoint is the 1-rank save
    train(reference, byte_data, "train.iters=8", *model, f"checkpoint.save={reference}/ckpt", "checkpoint.interval=4")
    ref = metrics(reference)
    saved: dict[tuple[str, ...], Path] = {(): reference / "ckpt" / "iter_0000004"}
    for name, (save_layout, load_layout) in cases.items():
        key = tuple(save_layout)
        if key not in saved:
            first = tmp_path / f"first_{len(saved)}"
            train(first, byte_data, "train.iters=4", f"checkpoint.save={first}/ckpt", *model, *save_layout)
            saved[key] = first / "ckpt" / "iter_0000004"
        files = sorted(p.name for p in (saved[key] / "shards").iterdir())
        world = {"tp2pp2_to_1": 4, "cp2_to_cp1": 2}.get(name, 1)
        assert files == [f"rank_{r:05d}.safetensors" for r in range(world)], (name, files)
        cont = tmp_path / name
        train(cont, byte_data, "train.iters=8", f"checkpoint.load={saved[key]}", *model, *load_layout)
        got = metrics(cont)
        assert sorted(got) == [5, 6, 7, 8], name
        for s in got:
            assert abs(got[s]["loss"] - ref[s]["loss"]) <= 1e-5 * ref[s]["loss"], (name, s)


def test_expert_parallel_checkpoint_resumes_at_other_ep(tmp_path, byte_data):
    """A MoE llama saved under ep2 × tp2 + SP (experts folded over tp: each TP rank writes its own experts' box of
    the full [E, ...] tensors) resumes at ep1 on one rank and at ep4 × dp4 with ZeRO-1 on the same trajectory."""
    moe = LLAMA + ["model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_z_loss_coeff=1e-3"]
    ep2 = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]
    full, first = tmp_path / "full", tmp_path / "first"
    train(full, byte_data, "train.iters=6", *moe, *ep2)
    train(first, byte_data, "train.iters=3", f"checkpoint.save={first}/ckpt", *moe, *ep2)
    for name, layout in (("ep1", []), ("ep4", ["parallel.dp=4", "parallel.ep=4", "parallel.zero=1"])):
        train(tmp_path / name, byte_data, "train.iters=6", f"checkpoint.load={first}/ckpt", *moe, *layout)
        ref, got = metrics(full), metrics(tmp_path / name)
        assert sorted(got) == [4, 5, 6], name
        for s in got:
            assert abs(got[s]["loss"] - ref[s]["loss"]) <= 5e-6 * ref[s]["loss"], (name, s)


def test_latent_attention_checkpoint_moves_between_layouts(tmp_path, byte_data):
    """A DeepSeek-style model (latent attention with a query latent, grouped MoE with the routing bias, a
    multi-token prediction module) saved at tp2 + SP × ep2 resumes at cp2 zigzag × pp2 on the uninterrupted run's
    trajectory, its MTP loss too: the replicated down projections are stored once, the head-split up projections
    whole, the experts as [E, ...], the MTP layer's routing bias in meta.json, the last stage's embedding copy read
    from the embedding."""
    model = ["model.arch=llama", "model.num_heads=4", "model.ffn_multiple_of=32", "model.kv_lora_rank=16",
             "model.q_lora_rank=24", "model.qk_nope_head_dim=12", "model.qk_rope_head_dim=4", "model.v_head_dim=8",
             "model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_router_score=sigmoid",
             "model.moe_bias_update_rate=1e-2", "model.moe_router_groups=2", "model.moe_routed_scaling=2.5",
             "model.mtp_layers=1"]
    saved = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]
    full, other = tmp_path / "full", tmp_path / "cp2"
    train(full, byte_data, "train.iters=6", f"checkpoint.save={full}/ckpt", "checkpoint.interval=3", *model, *saved)
    train(other, byte_data, "train.iters=6", f"checkpoint.load={full}/ckpt/iter_0000003", *model, "parallel.cp=2",
          "parallel.cp_algo=zigzag", "parallel.pp=2")
    ref, got = metrics(full), metrics(other)
    assert sorted(got) == [4, 5, 6]
    for s in got:
        for key in ("loss", "mtp_loss_1"):
            assert abs(got[s][key] - ref[s][key]) <= 5e-6 * ref[s][key], (s, key)


def test_zero3_checkpoint_resumes_at_other_layouts_and_back(tmp_path, byte_data):
    """dp2 + ZeRO-3 (asynchronous saves of the sharded parameters, a validation run between steps, the greedy sample at
    the end) saves what every
    layout reads: resumed at dp2×tp2 + ZeRO-1 and at 1 rank its steps stay on the uninterrupted run's trajectory
    (reduction order only), and a checkpoint of that ZeRO-1 run resumes at dp2 + ZeRO-3 on it too (ZeRO-2 saves the
    same: its loads are in the optimizer's gloo test)."""
    zero3 = ["parallel.dp=2", "parallel.zero=3"]
    full, tp2, one, back = (tmp_path / n for n in ("full", "tp2_zero1", "one", "back"))
    out = train(full, byte_data, "train.iters=5", f"checkpoint.save={full}/ckpt", "checkpoint.interval=3",
                "checkpoint.async_save=true", "train.eval_interval=2", "train.eval_iters=1", "train.sample_prompt=def",
                "train.sample_tokens=4", *zero3)
    assert "sample (greedy):" in out.stdout + out.stderr  # every rank decodes: each gather needs the whole dp group
    resume = f"checkpoint.load={full}/ckpt/iter_0000003"
    train(tp2, byte_data, "train.iters=5", resume, "parallel.dp=2", "parallel.tp=2", "parallel.zero=1",
          f"checkpoint.save={tp2}/ckpt", "checkpoint.interval=4")
    train(one, byte_data, "train.iters=5", resume, "train.eval_interval=2", "train.eval_iters=1")
    train(back, byte_data, "train.iters=5", f"checkpoint.load={tp2}/ckpt/iter_0000004", *zero3)
    ref = metrics(full)
    for run, steps in ((tp2, [4, 5]), (one, [4, 5]), (back, [5])):
        got = metrics(run)
        assert sorted(got) == steps, run
        for s in got:
            assert abs(got[s]["loss"] - ref[s]["loss"]) <= 5e-6 * ref[s]["loss"], (run, s)
            assert abs(got[s]["grad_norm"] - ref[s]["grad_norm"]) <= 1e-6 * ref[s]["grad_norm"], (run, s)
    val = {run: {r["step"]: r["val_loss"] for r in map(json.loads, (run / "log" / "metrics.jsonl").read_text().splitlines())
                 if "val_loss" in r} for run in (full, one)}
    assert sorted(val[full]) == [2, 4, 5] and sorted(val[one]) == [4, 5]  # (ZeRO-3's eval forward gathers too)
    assert all(abs(val[one][s] - val[full][s]) <= 5e-6 * val[full][s] for s in (4, 5)), val


def test_muon_checkpoint_resumes_at_pp2_and_one_rank(tmp_path, byte_data):
    """A Muon run's checkpoint at dp2·tp2 + ZeRO-1 (its momentum stored by name like Adam's moments) resumes at pp2
    and at 1 rank on the uninterrupted run's trajectory (reduction order only); AdamW takes its weights when asked."""
    muon = [*LLAMA, "train.optimizer=muon"]
    full, pp2, one = tmp_path / "full", tmp_path / "pp2", tmp_path / "one"
    train(full, byte_data, "train.iters=5", f"checkpoint.save={full}/ckpt", "checkpoint.interval=3", *muon,
          "parallel.dp=2", "parallel.tp=2", "parallel.zero=1")
    resume = f"checkpoint.load={full}/ckpt/iter_0000003"
    train(pp2, byte_data, "train.iters=5", resume, *muon, "parallel.pp=2")
    train(one, byte_data, "train.iters=5", resume, *muon)
    switched = train(tmp_path / "adamw", byte_data, "train.iters=4", resume, *LLAMA,
                     "checkpoint.allow_optimizer_change=true")  # the weights, a fresh AdamW
    assert "another train.optimizer (checkpoint.allow_optimizer_change): starting with a fresh optimizer" in switched.stdout
    ref = metrics(full)
    for run in (pp2, one):
        got = metrics(run)
        assert sorted(got) == [4, 5], run
        for s in got:
            assert abs(got[s]["loss"] - ref[s]["loss"]) <= 5e-6 * ref[s]["loss"], (run, s)
            assert abs(got[s]["grad_norm"] - ref[s]["grad_norm"]) <= 1e-6 * ref[s]["grad_norm"], (run, s)
