"""Integrity: per-tensor checksums in checkpoint shards and index caches, a full disk while saving or converting
(one line naming the file and the bytes needed, nothing left behind), and the converter's tokenizer files."""
from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError

from megatron_sp import checkpointing, config
from megatron_sp.checkpointing import store
from megatron_sp.data.index_cache import load_or_build
from megatron_sp.errors import DataError, TrainingError
from megatron_sp.model import GPTModel
from megatron_sp.optim import DistributedOptimizer, named_trainable

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
RUN = checkpointing.Lineage((("test-run", 0),))
FULL = "Error while serializing: I/O error: No space left on device (os error 28)"  # what safetensors raises


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_integrity", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _setup(root: Path, *extra: str, vocab: int = 258):
    cfg = config.load(overrides=["data.paths=[x]", "tokenizer.type=byte", "model.num_layers=1", "model.hidden_size=32",
                                 "model.num_heads=2", "model.seq_length=16", f"checkpoint.save={root}", *extra])
    config.set_vocab(cfg, vocab)
    model = GPTModel(cfg.model, seed=1)
    return cfg, model, DistributedOptimizer(named_trainable(model), cfg.train, None)


def _one_line_error(capsys: pytest.CaptureFixture, *parts: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert all(p in err for p in parts), err
    return err


def test_flipped_bytes_in_a_shard_are_refused_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg, model, opt = _setup(tmp_path / "ckpt")
    ckpt = checkpointing.save(cfg, 1, 4, model, opt, None, CPU, lineage=RUN)
    shard = ckpt / store.rank_file(0)
    key = json.loads((ckpt / "index.json").read_text())["tensors"]["model/embedding.weight"]["boxes"][0]["key"]
    data = bytearray(shard.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    begin, end = (start + o for o in json.loads(data[8:start])[key]["data_offsets"])
    floats = np.frombuffer(bytes(data[begin:end]), dtype=np.float32).copy()
    floats[::7] = 0.5  # every 7th float overwritten, the size kept
    data[begin:end] = floats.tobytes()
    shard.write_bytes(bytes(data))

    for load in (lambda: checkpointing.load(ckpt, model, opt, None, CPU, 1), lambda: checkpointing.read_full(ckpt)):
        with pytest.raises(DataError) as e:
            load()
        assert str(shard) in str(e.value) and "checksum" in str(e.value) and "\n" not in str(e.value)
    assert _tool("convert_checkpoint").main(["--input", str(ckpt), "--output", str(tmp_path / "hf"), "--to", "hf"]) == 1
    _one_line_error(capsys, str(shard), "checksum")
    assert not (tmp_path / "hf").exists()

    # a checkpoint written before checksums (no metadata in its shards) still loads
    from safetensors.torch import load_file, save_file

    ckpt = checkpointing.save(cfg, 2, 8, model, opt, None, CPU, lineage=RUN)
    shard = ckpt / store.rank_file(0)
    save_file(load_file(shard), shard)
    index = json.loads((ckpt / "index.json").read_text())
    index["files"][store.rank_file(0)] = shard.stat().st_size
    (ckpt / "index.json").write_text(json.dumps(index))
    assert checkpointing.load(ckpt, model, opt, None, CPU, 1)["step"] == 2


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != ".lock")


def test_a_full_disk_while_saving_leaves_the_previous_checkpoint_and_nothing_else(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    cfg, model, opt = _setup(root, "checkpoint.async_save=true")
    saver = checkpointing.Checkpointer(cfg, None, CPU, RUN)
    saver.save(1, 4, model, opt)
    saver.wait()

    def no_space(*args: object, **kwargs: object) -> None:
        raise SafetensorError(FULL)

    with monkeypatch.context() as m:  # the shard, written by the asynchronous save's thread
        m.setattr("safetensors.torch.save_file", no_space)
        saver.save(2, 8, model, opt)
        with pytest.raises(TrainingError) as e:
            while not saver.poll():
                pass
    msg = str(e.value)
    assert "\n" not in msg and "rank_00000.safetensors" in msg and "No space left on device" in msg, msg
    assert "bytes are needed" in msg and "'latest' still names iter_0000001" in msg, msg
    assert _names(root) == ["iter_0000001", "latest"]

    fsync = os.fsync
    for victim in ("index.json", "meta.json", ".latest.tmp"):
        def failing(fd: int, victim: str = victim) -> None:  # the blocks of a small file are allocated at fsync
            if os.readlink(f"/proc/self/fd/{fd}").endswith(victim):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            fsync(fd)

        with monkeypatch.context() as m:
            m.setattr(os, "fsync", failing)
            with pytest.raises(TrainingError, match=rf"step 2 not saved: cannot write '[^']*{victim}' \(No space left on "
                                                    r"device\); about [\d,]+ bytes are needed"):
                saver.save(2, 8, model, opt, asynchronous=False)
        assert _names(root) == ["iter_0000001", "latest"], victim
        assert (root / "latest").read_text() == "iter_0000001\n"
    saver.save(2, 8, model, opt, asynchronous=False)
    assert (root / "latest").read_text() == "iter_0000002\n"

    # a fresh run's first save failing at `latest` leaves no checkpoint, so the same command runs again
    fresh = tmp_path / "fresh"
    cfg, model, opt = _setup(fresh)
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", lambda fd: failing(fd, ".latest.tmp"))
        with pytest.raises(TrainingError):
            checkpointing.save(cfg, 1, 4, model, opt, None, CPU)
    assert _names(fresh) == []
    checkpointing.check_save_dir(cfg)  # not "checkpoints of another run"
    checkpointing.save(cfg, 1, 4, model, opt, None, CPU)
    assert (fresh / "latest").read_text() == "iter_0000001\n"


def _rank_one_disk_full(rank: int, world: int, root: str) -> str:
    from types import SimpleNamespace

    import safetensors.torch

    cfg, model, opt = _setup(Path(root))
    state = SimpleNamespace(rank=rank, dims=SimpleNamespace(world_size=world), tp_rank=0, tp_size=1)
    if rank == 1:  # rank 0 writes every tensor; rank 1 only its RNG states, and its disk is full
        boxes = checkpointing.rank_boxes
        checkpointing.rank_boxes = lambda *a: ([], boxes(*a)[1])
        safetensors.torch.save_file = lambda *a, **k: (_ for _ in ()).throw(SafetensorError(FULL))
    try:
        checkpointing.Checkpointer(cfg, state, CPU, RUN).save(1, 4, model, opt, asynchronous=False)
    except TrainingError as e:
        return str(e)
    return "saved"


def test_a_full_disk_on_another_rank_fails_every_rank_in_one_line(tmp_path: Path) -> None:
    from megatron_sp.testing import run_distributed

    messages = run_distributed(_rank_one_disk_full, 2, timeout_s=120, root=str(tmp_path / "ckpt"))
    assert messages[0] == messages[1] and "rank_00001.safetensors' (No space left on device)" in messages[0], messages
    assert _names(tmp_path / "ckpt") == []


def test_a_tampered_index_cache_is_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = ("doc_idx", "shuffle_idx")
    paths = {k: tmp_path / f"c_{k}.npy" for k in keys} | {"description": tmp_path / "c_description.json"}
    build = lambda: {"doc_idx": np.arange(50, dtype=np.int32), "shuffle_idx": np.random.default_rng(0).permutation(40)}

    def load() -> tuple[dict[str, np.ndarray], bool]:
        return load_or_build(paths, keys, {"what": "test"}, build, lambda a: True, "index cache")

    first, loaded = load()
    assert not loaded and load()[1]
    np.save(paths["shuffle_idx"], np.zeros_like(first["shuffle_idx"]))  # zeroed, same shape
    with caplog.at_level(logging.WARNING, logger="megatron_sp"):
        again, loaded = load()
    assert not loaded and np.array_equal(again["shuffle_idx"], first["shuffle_idx"])
    assert [r.message for r in caplog.records if "c_shuffle_idx.npy" in r.message and "checksum" in r.message]
    rebuilt, loaded = load()
    assert loaded and np.array_equal(rebuilt["shuffle_idx"], first["shuffle_idx"])
    # a cache written before checksums (none in its description file) is rebuilt once
    paths["description"].write_text(json.dumps({"what": "test"}))
    assert not load()[1] and load()[1]


def test_a_full_disk_while_preprocessing_is_one_line_and_leaves_no_output(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_sp.data.indexed import IndexedDatasetWriter

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(50)))
    out = tmp_path / "out"
    out.mkdir()

    def no_space(self: IndexedDatasetWriter, array: np.ndarray) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(IndexedDatasetWriter, "_write_tokens", no_space)
    tool = _tool("preprocess_data")
    assert tool.main(["--input", str(corpus), "--output-prefix", str(out / "demo"), "--tokenizer-type", "byte",
                      "--append-eod", "--log-interval", "0"]) == 1
    _one_line_error(capsys, str(out / "demo_text_document.bin"), "No space left on device", "bytes are needed")
    assert list(out.iterdir()) == []


def test_the_converter_on_a_full_disk_and_without_tokenizers(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    convert = _tool("convert_checkpoint")
    cfg, model, opt = _setup(tmp_path / "ckpt")
    checkpointing.save(cfg, 1, 4, model, opt, None, CPU)
    out = tmp_path / "out"

    def no_space(*args: object, **kwargs: object) -> None:
        raise SafetensorError(FULL)

    with monkeypatch.context() as m:
        m.setattr("safetensors.torch.save_file", no_space)
        for to in ("hf", "megatron_sp"):
            m.setattr(convert.shutil, "copytree", lambda src, dst, **k: (_ for _ in ()).throw(
                convert.shutil.Error([(str(src), str(dst) + "/rank_00000.safetensors", "[Errno 28] No space left on device")])))
            assert convert.main(["--input", str(tmp_path / "ckpt"), "--output", str(out), "--to", to]) == 1
            _one_line_error(capsys, str(out), "No space left on device", "bytes are needed", "safetensors")
            assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no output, no temporary directory

    # an HF tokenizer goes into the export and comes back with the import; without `tokenizers`, one line
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<pad>": 1, "[UNK]": 2} | {f"w{i}": i + 3 for i in range(61)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    for kind, model_path in (("sentencepiece", tmp_path / "tokenizer.json"), ("hf", tmp_path)):  # the file is not read
        cfg, model, opt = _setup(tmp_path / kind, f"tokenizer.type={kind}", f"tokenizer.model={model_path}", vocab=64)
        checkpointing.save(cfg, 1, 4, model, opt, None, CPU)
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "tokenizers", None)
            assert convert.main(["--input", str(tmp_path / kind), "--output", str(out), "--to", "hf"]) == 2
            _one_line_error(capsys, "pip install -e '.[hf]'")
    assert convert.main(["--input", str(tmp_path / "hf"), "--output", str(out), "--to", "hf"]) == 0
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoTokenizer.from_pretrained(out).encode("w3 w7", add_special_tokens=False) == [6, 10]
    back = tmp_path / "back"
    assert convert.main(["--input", str(out), "--output", str(back), "--to", "megatron_sp"]) == 0
    tokenizer = checkpointing.read_meta(checkpointing.resolve(back))["config"]["tokenizer"]
    assert (tokenizer["type"], tokenizer["model"], tokenizer["eod_token"]) == ("hf", str(back.resolve() / "tokenizer.json"),
                                                                               "<|endoftext|>")
    assert (back / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
