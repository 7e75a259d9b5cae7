"""Resuming with another global batch size (Megatron's ramp-up: on from consumed_samples, to the end), and with
another model.seq_length or tokenizer: refused in one line, accepted with checkpoint.allow_data_change."""
from __future__ import annotations

import json

from .runs import metrics, train


def test_resume_with_another_batch_size_sequence_length_or_tokenizer(tmp_path, byte_data):
    first = tmp_path / "first"
    train(first, byte_data, "train.iters=2", "train.global_batch_size=4", f"checkpoint.save={first}/ckpt")
    ckpt = first / "ckpt"
    meta_path = ckpt / "iter_0000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["consumed_samples"] == 8 and len(meta["tokenizer_sha256"]) == 64

    smaller = tmp_path / "smaller"  # 4 → 2: samples 8..11 in two steps, then the end (was: StopIteration)
    train(smaller, byte_data, "train.iters=4", "train.global_batch_size=2", f"checkpoint.load={ckpt}")
    assert {s: r["consumed_samples"] for s, r in metrics(smaller).items()} == {3: 10, 4: 12}

    meta_path.write_text(json.dumps({**meta, "tokenizer_sha256": "0" * 64}))  # as if trained with another tokenizer
    changed = ["model.seq_length=32", "train.iters=3", "train.global_batch_size=8", f"checkpoint.load={ckpt}"]
    refused = tmp_path / "refused"
    p = train(refused, byte_data, *changed, expect_ok=False)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "model.seq_length 64 -> 32" in lines[0] and "another tokenizer" in lines[0]
    assert "checkpoint.allow_data_change=true" in lines[0]
    assert not (refused / "log" / "config.yml").exists()  # nothing written

    larger = tmp_path / "larger"  # 4 → 8 (was: ValueError "start_sample ... multiple"), opted in
    p = train(larger, byte_data, *changed, "checkpoint.allow_data_change=true", f"checkpoint.save={larger}/ckpt")
    assert "going on from sample 8 of the new data order" in p.stdout + p.stderr
    assert {s: r["consumed_samples"] for s, r in metrics(larger).items()} == {3: 16}
    saved = json.loads((larger / "ckpt" / "iter_0000003" / "meta.json").read_text())
    assert saved["tokenizer_sha256"] == meta["tokenizer_sha256"]  # this run's tokenizer from now on
