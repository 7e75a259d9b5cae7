"""End-to-end runs of train.py: determinism, exact resume, and the parity standard for data parallelism."""
from __future__ import annotations

import torch

from megatron_sp import checkpointing

from .runs import DROPOUT, metrics, train


def test_same_seed_same_losses_and_resume_is_bitwise(tmp_path, byte_data):
    """With dropout on both RNG streams: every stream is saved at step 5 and restored, so the resumed run
    (whose data loader starts at step 6) draws the masks of the uninterrupted one."""
    full, again, first, second = (tmp_path / n for n in ("full", "again", "first", "second"))
    train(full, byte_data, "train.iters=10", f"checkpoint.save={full}/ckpt", "checkpoint.interval=5",
          "checkpoint.async_save=true", *DROPOUT)  # the files written in the background are the same
    train(again, byte_data, "train.iters=10", *DROPOUT)
    train(first, byte_data, "train.iters=5", f"checkpoint.save={first}/ckpt", *DROPOUT)
    train(second, byte_data, "train.iters=10", f"checkpoint.load={first}/ckpt", f"checkpoint.save={second}/ckpt",
          *DROPOUT)

    ref, rep = metrics(full), metrics(again)
    assert sorted(ref) == list(range(1, 11))
    assert [ref[s]["loss"] for s in ref] == [rep[s]["loss"] for s in ref]          # determinism: bitwise
    assert ref[10]["loss"] < ref[1]["loss"]

    resumed = metrics(second)
    assert sorted(resumed) == list(range(6, 11))
    for s in range(6, 11):                                                          # 5 + resume + 5: bitwise
        assert resumed[s]["loss"] == ref[s]["loss"], s
        assert resumed[s]["grad_norm"] == ref[s]["grad_norm"], s
    a = checkpointing.read_full(full / "ckpt" / "iter_0000010", "")  # weights and optimizer state
    b = checkpointing.read_full(second / "ckpt" / "iter_0000010", "")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (full / "ckpt" / "latest").read_text().strip() == "iter_0000010"
    assert (full / "log" / "config.yml").is_file()


def test_bf16_trains_and_starts_close_to_fp32(tmp_path, byte_data):
    """bf16 params with fp32 master weights: the first loss is within 1e-2 of fp32 and the loss falls."""
    train(tmp_path / "fp32", byte_data, "train.iters=1")
    train(tmp_path / "bf16", byte_data, "train.iters=12", "train.precision=bf16", "parallel.dp=2", "parallel.zero=1")
    a, b = metrics(tmp_path / "fp32"), metrics(tmp_path / "bf16")
    assert abs(a[1]["loss"] - b[1]["loss"]) < 1e-2 * a[1]["loss"], (a[1]["loss"], b[1]["loss"])
    assert all(torch.isfinite(torch.tensor(b[s]["loss"])) for s in b)
    assert sum(b[s]["loss"] for s in (10, 11, 12)) < sum(b[s]["loss"] for s in (1, 2, 3))


def test_zero1_checkpoint_resumes_at_other_dp_sizes(tmp_path, byte_data):
    """A checkpoint written at dp2 + ZeRO-1 resumes at dp1 and at dp4 on the same loss trajectory (1e-5)."""
    full, first = tmp_path / "full", tmp_path / "first"
    train(full, byte_data, "train.iters=10", "parallel.dp=2", "parallel.zero=1")
    train(first, byte_data, "train.iters=5", "parallel.dp=2", "parallel.zero=1", f"checkpoint.save={first}/ckpt")
    ref = metrics(full)
    shards = sorted(p.name for p in (first / "ckpt" / "iter_0000005" / "shards").iterdir())
    assert shards == ["rank_00000.safetensors", "rank_00001.safetensors"]  # each rank wrote its ZeRO-1 part
    for dp in (1, 4):
        run = tmp_path / f"dp{dp}"
        train(run, byte_data, "train.iters=10", f"parallel.dp={dp}", "parallel.zero=1", f"checkpoint.load={first}/ckpt")
        got = metrics(run)
        assert sorted(got) == [6, 7, 8, 9, 10]
        for s in got:
            assert abs(got[s]["loss"] - ref[s]["loss"]) <= 1e-5 * ref[s]["loss"], (dp, s, got[s]["loss"], ref[s]["loss"])


def test_missing_data_is_one_line_naming_the_file(tmp_path):
    p = train(tmp_path / "x", str(tmp_path / "nope" / "missing_text_document"), "train.iters=1", expect_ok=False)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "missing_text_document" in lines[0] and "preprocess_data.py" in lines[0], p.stderr


def test_fp16_loss_scaler_skips_overflows_and_recovers(tmp_path, byte_data):
    """fp16 with an absurd initial loss scale: early steps overflow and are skipped, the scale backs off,
    then training proceeds (finite losses)."""
    train(tmp_path, byte_data, "train.iters=14", "train.precision=fp16", "train.loss_scale_init=1e9",
          "train.loss_scale_hysteresis=1", "parallel.dp=2")
    m = metrics(tmp_path)
    assert m[1]["skipped_steps"] == 1 and m[1]["loss_scale"] == 5e8
    assert 1 <= m[14]["skipped_steps"] < 14
    assert m[14]["loss_scale"] < 1e30
    last = max(s for s in m if m[s]["skipped_steps"] == m[14]["skipped_steps"] and s > 1 and
               m[s - 1]["skipped_steps"] < m[s]["skipped_steps"])  # the last skipped step
    assert last < 14                                              # steps after it were taken
    assert all(torch.isfinite(torch.tensor(m[s]["loss"])) for s in m)


def test_nan_stops_with_the_step_unless_skipped(tmp_path, byte_data):
    p = train(tmp_path / "stop", byte_data, "train.iters=3", "train.lr=1e30", "train.clip_grad=0",
              expect_ok=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "is not finite" in p.stderr and "step " in p.stderr


def test_end_of_training_sample_under_pp_equals_one_rank(tmp_path, byte_data):
    """The greedy sample at the end of training, decoded through two pipeline stages with the prompt prefilled split
    over two cp ranks, is the 1-rank run's text (generate_batch under SP and the other layouts:
    tests/distributed/test_generate_layouts.py)."""
    def sample(name: str, *layout: str) -> str:
        p = train(tmp_path / name, byte_data, "train.iters=3", "train.sample_prompt=def ", "train.sample_tokens=12",
                  *layout)
        out = p.stdout + p.stderr
        assert "sample (greedy):" in out, out[-2000:]
        return out.split("sample (greedy):", 1)[1].split("\n", 2)[1]
    want = sample("one")
    assert want.startswith("def ") and len(want) > 4
    assert sample("pp2cp2", "parallel.pp=2", "parallel.cp=2") == want
