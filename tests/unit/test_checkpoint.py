"""Checkpoint files: atomic layout, keep-last-N, safe loading and clear errors for bad files."""
import json
import logging

import pytest
import torch

from megatron_sp import checkpointing, config
from megatron_sp.checkpointing import rng
from megatron_sp.errors import DataError
from megatron_sp.model import GPTModel
from megatron_sp.mpu.random import TP_DIFFERENT, RNGTracker, init_rng
from megatron_sp.optim import DistributedOptimizer, named_trainable

OVR = ["data.paths=[x]", "tokenizer.type=byte", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
       "model.seq_length=16"]


def _setup(tmp_path, *extra):
    cfg = config.load(overrides=OVR + [f"checkpoint.save={tmp_path}/ckpt", *extra])
    config.set_vocab(cfg, 258)
    model = GPTModel(cfg.model, seed=1)
    opt = _optimizer(model, cfg)
    tokens = torch.randint(0, 258, (2, 16))
    model(tokens, labels=tokens).mean().backward()
    opt.step(1e-3)
    return cfg, model, opt


def _optimizer(model, cfg):
    return DistributedOptimizer(named_trainable(model), cfg.train, None)


RUN = checkpointing.Lineage((("test-run", 0),))  # every _save is one run (a fresh Lineage per call would be a new run)


def _save(cfg, model, opt, step):
    return checkpointing.save(cfg, step, step * 4, model, opt, None, torch.device("cpu"), lineage=RUN)


def test_save_load_round_trip_and_keep(tmp_path):
    cfg, model, opt = _setup(tmp_path, "checkpoint.keep=2")
    for step in (1, 2, 3):
        _save(cfg, model, opt, step)
    root = tmp_path / "ckpt"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["iter_0000002", "iter_0000003"]
    assert (root / "latest").read_text().strip() == "iter_0000003"
    assert not list(root.glob(".tmp*"))
    meta = json.loads((root / "iter_0000003" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["consumed_samples"] == 12 and meta["config"]["model"]["num_layers"] == 2

    cfg2, model2, opt2 = _setup(tmp_path)
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)
    ckpt = checkpointing.resolve(root)
    out = checkpointing.load(ckpt, model2, opt2, None, torch.device("cpu"), seed=1)
    assert out["step"] == 3
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict_by_name(), opt2.state_dict_by_name()
    assert s1.keys() == s2.keys()
    for k in s1:
        for key in s1[k]:
            assert torch.equal(s1[k][key], s2[k][key]), (k, key)


def test_bad_checkpoints_give_one_clear_error(tmp_path):
    cfg, model, opt = _setup(tmp_path)
    ckpt = _save(cfg, model, opt, 1)
    with pytest.raises(DataError, match="no 'latest' file"):
        checkpointing.resolve(tmp_path / "empty")

    shard = ckpt / "shards" / "rank_00000.safetensors"
    data = shard.read_bytes()
    # a truncated shard file
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"rank_00000\.safetensors' has \d+ bytes, index\.json says"):
        checkpointing.load(ckpt, model, opt, None, torch.device("cpu"), 1)
    # a corrupted header at the recorded size
    shard.write_bytes(b"\xff" * len(data))
    with pytest.raises(DataError, match=r"rank_00000\.safetensors' is corrupted or truncated"):
        checkpointing.load(ckpt, model, opt, None, torch.device("cpu"), 1)
    # a missing shard file
    shard.unlink()
    with pytest.raises(DataError, match=r"rank_00000\.safetensors' is missing"):
        checkpointing.load(ckpt, model, opt, None, torch.device("cpu"), 1)

    # a config that does not match the weights
    ckpt = _save(cfg, model, opt, 2)
    other = config.load(overrides=OVR + ["model.hidden_size=64"])
    config.set_vocab(other, 258)
    bigger = GPTModel(other.model, seed=1)
    with pytest.raises(DataError, match="does not match this model config|has shape"):
        checkpointing.load(ckpt, bigger, _optimizer(bigger, other), None, torch.device("cpu"), 1)

    # an index whose boxes do not cover a tensor
    index = json.loads((ckpt / "index.json").read_text())
    index["tensors"]["model/final_norm.weight"]["boxes"] = []
    (ckpt / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="covers 0 of 32 requested elements of 'model/final_norm.weight'"):
        checkpointing.load(ckpt, model, opt, None, torch.device("cpu"), 1)
    (ckpt / "index.json").unlink()
    with pytest.raises(DataError, match=r"index\.json' is missing"):
        checkpointing.load(ckpt, model, opt, None, torch.device("cpu"), 1)

    # a checkpoint of the first (unsharded torch.save) format
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    with pytest.raises(DataError, match="format version 1; this version of megatron_sp reads version 2"):
        checkpointing.load(ckpt, model, opt, None, torch.device("cpu"), 1)


def test_async_save_finishes_on_poll_and_loads_equal(tmp_path):
    cfg, model, opt = _setup(tmp_path, "checkpoint.async_save=true", "checkpoint.keep=1")
    saver = checkpointing.Checkpointer(cfg, None, torch.device("cpu"))
    saver.save(1, 4, model, opt)
    saver.wait()
    saver.save(2, 8, model, opt)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():  # training goes on: the snapshot taken at save time is what lands
        for p in model.parameters():
            p.add_(1.0)
    while not saver.poll():
        pass
    root = tmp_path / "ckpt"
    assert (root / "latest").read_text().strip() == "iter_0000002"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["iter_0000002"]
    checkpointing.load(checkpointing.resolve(root), model, opt, None, torch.device("cpu"), seed=1)
    for n, p in model.named_parameters():
        assert torch.equal(p, expected[n]), n


def test_pickled_code_is_never_executed(tmp_path):
    cfg, model, opt = _setup(tmp_path)
    ckpt = _save(cfg, model, opt, 1)

    class Evil:
        def __reduce__(self):
            return (exec, ("open('%s', 'w').write('pwned')" % (tmp_path / "pwned"),))

    shard = ckpt / "shards" / "rank_00000.safetensors"
    torch.save({"x": Evil()}, shard)
    index = json.loads((ckpt / "index.json").read_text())  # even with the size the index expects
    index["files"]["shards/rank_00000.safetensors"] = shard.stat().st_size
    (ckpt / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError):
        checkpointing.load(ckpt, model, opt, None, torch.device("cpu"), 1)
    assert not (tmp_path / "pwned").exists()


KILL_SCRIPT = r"""
import sys, time, pathlib, torch
sys.path.insert(0, {tests!r})
from test_checkpoint import _setup, _save
root = pathlib.Path({root!r})
cfg, model, opt = _setup(root)
_save(cfg, model, opt, 1)
from megatron_sp.checkpointing import store
real_write = store.write_file
def slow_write(path, *a, **k):
    if "iter_0000002" in str(path):
        pathlib.Path(path).write_bytes(b"half written")  # a truncated file, then hang
        (root / "ready").write_text("1")
        time.sleep(60)
    return real_write(path, *a, **k)
store.write_file = slow_write
_save(cfg, model, opt, 2)
"""


def test_killing_a_save_midway_keeps_the_previous_checkpoint(tmp_path):
    """SIGKILL while step 2 is being written: `latest` still names step 1, which loads; the next save works."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the save never reached the shard file"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    root = tmp_path / "ckpt"
    assert (root / "latest").read_text().strip() == "iter_0000001"
    assert not (root / "iter_0000002").exists() and (root / ".tmp_iter_0000002").exists()
    ckpt = checkpointing.resolve(root)
    assert ckpt.name == "iter_0000001"
    cfg, model, opt = _setup(tmp_path)
    assert checkpointing.load(ckpt, model, opt, None, torch.device("cpu"), seed=1)["step"] == 1
    _save(cfg, model, opt, 2)  # the leftover temporary directory is replaced
    _save(cfg, model, opt, 2)  # saving the same step again keeps a complete copy at every moment
    assert (root / "latest").read_text().strip() == "iter_0000002"
    assert not list(root.glob(".tmp*")) and not list(root.glob(".old*"))
    assert checkpointing.load(checkpointing.resolve(root), model, opt, None, torch.device("cpu"), seed=1)["step"] == 2


def test_rng_streams_are_restored_where_they_map_and_reseeded_otherwise(tmp_path, caplog):
    """Same layout: every stream comes back; only tp changed: the default generator (the writer rank's at tp 0 of
    this rank's cp, dp, pp) comes back and the tracker is reseeded; any other change: all are reseeded from the
    seed and step. A reseed is one log line naming the streams."""
    writer = {"tp": 2, "pp": 1, "cp": 1, "dp": 2, "virtual_stages": 1}
    at = {"tp": 1, "cp": 0, "dp": 1, "pp": 0}  # rank 3
    assert rng.sources(writer, writer, at, 3) == (3, 3)
    assert rng.sources(writer, {**writer, "tp": 4}, {**at, "tp": 3}, 7) == (2, None)
    for change in ({"dp": 1}, {"cp": 2}, {"pp": 2}, {"virtual_stages": 2}, {"sequence_parallel": 1}):
        assert rng.sources(writer, {**writer, **change}, at, 3) == (None, None), change
    assert rng.sources(None, writer, at, 3) == (None, None)  # a checkpoint without its layout

    cfg, model, opt = _setup(tmp_path)
    cpu, tracker = torch.device("cpu"), RNGTracker("cpu")
    init_rng(tracker, 5, 0, 0)
    torch.rand(3)
    with tracker.fork(TP_DIFFERENT):
        torch.rand(3)
    saved = {"cpu": torch.get_rng_state(), **{f"tracker/{k}": v for k, v in tracker.get_states().items()}}
    ckpt = checkpointing.save(cfg, 3, 12, model, opt, None, cpu, tracker, lineage=RUN)
    fresh = RNGTracker("cpu")
    init_rng(fresh, 1 + rng.STEP_SEED_STRIDE * 3, 0, 0)  # what a reseed at step 3 with seed 1 gives rank 0
    reseeded = {"cpu": torch.get_rng_state(), **{f"tracker/{k}": v for k, v in fresh.get_states().items()}}
    layout = checkpointing.writer_layout(cfg)
    for where, restored in ((layout, {"cpu", f"tracker/{TP_DIFFERENT}"}), ({**layout, "tp": 2}, {"cpu"}),
                            ({**layout, "dp": 2}, set())):
        init_rng(tracker, 99, 0, 0)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megatron_sp"):
            checkpointing.load(ckpt, model, opt, None, cpu, 1, tracker, layout=where)
        now = {"cpu": torch.get_rng_state(), **{f"tracker/{k}": v for k, v in tracker.get_states().items()}}
        for name in now:
            assert torch.equal(now[name], (saved if name in restored else reseeded)[name]), (where, name)
        lines = [r.getMessage() for r in caplog.records if "reseeded" in r.getMessage()]
        assert len(lines) == (where != layout), lines
        assert all(f"RNG streams {', '.join(n for n in now if n not in restored)} reseeded" in x for x in lines)


def test_weights_only_load_refreshes_the_fp32_masters(tmp_path):
    """A converted (weights-only) checkpoint loaded into a bf16 run: the fp32 masters follow the loaded weights, so a
    step without gradient keeps them (the masters of the random init used to overwrite them at the first step)."""
    cfg, model, _ = _setup(tmp_path)
    weights = {n: p.detach()[:258] + 0.5 if n.endswith(("embedding.weight", "output_layer.weight")) else p.detach() + 0.5
               for n, p in model.named_parameters()}  # (vocabulary tables stored without their padding rows)
    ckpt = tmp_path / "converted"
    checkpointing.write_weights(ckpt, {"step": 0, "consumed_samples": 0, "converted_from": "test"}, weights)
    cfg16 = config.load(overrides=OVR + ["train.precision=bf16", "train.weight_decay=0"])
    config.set_vocab(cfg16, 258)
    model16 = GPTModel(cfg16.model, seed=2)
    opt16 = DistributedOptimizer(named_trainable(model16), cfg16.train, None, precision="bf16")
    checkpointing.load(ckpt, model16, opt16, None, torch.device("cpu"), seed=1)
    opt16.zero_grad()
    opt16.step(1e-3)  # no gradient: Adam's update is 0
    for n, p in model16.named_parameters():
        assert torch.equal(p[:len(weights[n])], weights[n].to(torch.bfloat16)), n
