"""Config tree: load, merge, overrides, strictness, cross-field validation, derived values."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_sp.mpu.cp_layout import DOCUMENT_CHUNK
from megatron_sp import config
from megatron_sp.errors import ConfigError

BASE = ["data.paths=[d/x]", "tokenizer.type=byte"]
DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yml"


def test_defaults_and_derived_values():
    cfg = config.load(overrides=BASE)
    assert cfg.model.num_kv_heads == cfg.model.num_heads
    assert cfg.model.ffn_hidden_size == 4 * cfg.model.hidden_size
    assert cfg.model.rotary_pct == 0.25
    assert cfg.parallel.dp == 1 and cfg.parallel.world_size == 1
    assert cfg.train.global_batch_size == cfg.train.micro_batch_size
    assert cfg.train.grad_accum_steps == 1
    assert cfg.train.lr_decay_iters == cfg.train.iters
    assert cfg.parallel.backend == "gloo" and cfg.parallel.device == "cpu"


def test_llama_derived_ffn_and_rotary():
    cfg = config.load(overrides=BASE + ["model.arch=llama", "model.hidden_size=256", "model.ffn_multiple_of=64"])
    assert cfg.model.rotary_pct == 1.0
    assert cfg.model.ffn_hidden_size == 704  # 8·256/3 = 682.67 → next multiple of 64
    assert cfg.model.ffn_hidden_size % 64 == 0


def test_files_merge_in_order_and_overrides_win(tmp_path):
    a = tmp_path / "a.yml"
    a.write_text(yaml.safe_dump({"model": {"num_layers": 4, "hidden_size": 64}, "train": {"lr": 1e-3}}))
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"model": {"num_layers": 6}, "train": {"iters": 7}}))
    cfg = config.load([a, b], BASE + ["train.iters=9", "train.lr=5e-4", "model.tie_embeddings=yes"])
    assert cfg.model.num_layers == 6          # b over a
    assert cfg.model.hidden_size == 64        # a kept
    assert cfg.train.iters == 9               # override over b
    assert cfg.train.lr == pytest.approx(5e-4) and isinstance(cfg.train.lr, float)
    assert cfg.model.tie_embeddings is True


def test_overrides_are_typed():
    cfg = config.load(overrides=BASE + ["train.micro_batch_size=2", "parallel.dp=2", "train.global_batch_size=8",
                                        "checkpoint.save=none", "model.hidden_dropout=0.1"])
    assert cfg.train.micro_batch_size == 2 and isinstance(cfg.train.micro_batch_size, int)
    assert cfg.train.grad_accum_steps == 2
    assert cfg.checkpoint.save is None
    assert cfg.model.hidden_dropout == pytest.approx(0.1)


@pytest.mark.parametrize("override, needle", [
    ("train.itres=5", "did you mean 'train.iters'"),
    ("modle.arch=neox", "did you mean 'model'"),
    ("train.iters=abc", "train.iters"),
    ("model.tie_embeddings=maybe", "model.tie_embeddings"),
    ("model.arch=gpt5", "model.arch"),
    ("train.precision=fp8", "train.precision"),
    ("noequals", "section.key=value"),
    ("model.num_heads=3", "num_heads"),
    ("model.num_kv_heads=3", "num_kv_heads"),
    ("train.iters=0", "train.iters"),
    ("train.lr=-1", "train.lr"),
    ("parallel.sequence_parallel=true", "sequence_parallel"),
])
def test_bad_overrides_raise_config_error_naming_the_key(override, needle):
    with pytest.raises(ConfigError) as exc:
        config.load(overrides=BASE + [override])
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="global_batch_size 10 must be a multiple"):
        config.load(overrides=BASE + ["train.micro_batch_size=4", "train.global_batch_size=10"])
    with pytest.raises(ConfigError, match="num_layers = 3 is not divisible"):
        config.finalize(_raw(["model.num_layers=3", "parallel.pp=2"]))
    with pytest.raises(ConfigError, match="num_heads 4 must be divisible by parallel.tp 3"):
        config.finalize(_raw(["parallel.tp=3"]))
    with pytest.raises(ConfigError, match="world size 6 is not divisible"):
        config.load(overrides=BASE + ["parallel.tp=4"], world_size=6)
    with pytest.raises(ConfigError, match="launched 4 ranks"):
        config.load(overrides=BASE + ["parallel.dp=2"], world_size=4)
    with pytest.raises(ConfigError, match="min_lr"):
        config.load(overrides=BASE + ["train.lr=1e-4", "train.min_lr=1e-3"])
    with pytest.raises(ConfigError, match="data.paths is empty"):
        config.load(overrides=["tokenizer.type=byte"])


def test_dp_derived_from_world_size():
    cfg = config.load(overrides=BASE + ["train.micro_batch_size=2"], world_size=4)
    assert cfg.parallel.dp == 4 and cfg.parallel.world_size == 4
    assert cfg.train.global_batch_size == 8


def test_pipeline_needs_micro_batches():
    with pytest.raises(ConfigError, match="schedule needs at least pp"):
        config.load(overrides=BASE + ["parallel.pp=2", "model.num_layers=2"])
    ok = config.load(overrides=BASE + ["parallel.pp=2", "model.num_layers=2", "train.global_batch_size=2"])
    assert ok.parallel.world_size == 2 and ok.train.grad_accum_steps == 2


def test_pipeline_layout_checks():
    pp2 = BASE + ["parallel.pp=2", "train.global_batch_size=4"]
    cases = {
        "interleaved needs parallel.pp >= 2 and parallel.virtual_stages >= 2": ["parallel.pp_schedule=interleaved"],
        "virtual_stages = 2 needs parallel.pp_schedule = interleaved": ["parallel.virtual_stages=2", "model.num_layers=4"],
        "not divisible by parallel.pp·virtual_stages = 2·2": ["parallel.pp_schedule=interleaved",
                                                             "parallel.virtual_stages=2", "model.num_layers=6"],
        "pp_partition = '1,2'": ["parallel.pp_partition=1,2", "model.num_layers=4"],
        "interleaved schedule needs a multiple of pp": ["parallel.pp_schedule=interleaved", "parallel.virtual_stages=2",
                                                        "model.num_layers=4", "train.global_batch_size=3"],
    }
    for message, extra in cases.items():
        with pytest.raises(ConfigError, match=message):
            config.load(overrides=pp2 + extra)
    ok = config.load(overrides=pp2 + ["parallel.pp_schedule=interleaved", "parallel.virtual_stages=2",
                                      "model.num_layers=4"])
    assert ok.parallel.virtual_stages == 2
    assert config.load(overrides=pp2 + ["parallel.pp_partition=1,2", "model.num_layers=3"]).parallel.pp_partition == "1,2"
    assert config.load(overrides=pp2 + ["parallel.pp_schedule=none", "train.global_batch_size=1",
                                        "model.num_layers=2"]).train.grad_accum_steps == 1


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load([tmp_path / "missing.yml"])
    bad = tmp_path / "bad.yml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load([bad])
    unknown = tmp_path / "unknown.yml"
    unknown.write_text("model:\n  hidden_szie: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'model.hidden_size'"):
        config.load([unknown])


def test_resolved_config_round_trips(tmp_path):
    cfg = config.load(overrides=BASE + ["model.num_layers=3"])
    config.set_vocab(cfg, 300)
    assert cfg.model.padded_vocab_size == 384
    config.save(cfg, tmp_path / "config.yml")
    again = config.load([tmp_path / "config.yml"])
    assert config.to_dict(again) == config.to_dict(cfg)


def test_every_field_is_documented():
    text = config.help_text()
    for line in text.splitlines():
        if line.startswith("  "):
            assert line.split("): ", 1)[1].strip(), line


def test_train_py_config_error_is_one_line_exit_2(repo_root):
    p = subprocess.run([sys.executable, "train.py", "--conf", "configs/demo.yml", "train.itres=3"],
                       cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "train.iters" in lines[0], p.stderr


def _raw(overrides):
    return config.load(overrides=BASE + overrides, finalize_config=False)


def test_tensor_parallel_validation():
    ok = config.load(overrides=BASE + ["model.arch=llama", "model.num_kv_heads=2", "parallel.tp=4",
                                       "parallel.sequence_parallel=true", "model.ffn_multiple_of=64"])
    assert ok.parallel.world_size == 4  # tp 4 > 2 kv heads: kv heads replicated
    with pytest.raises(ConfigError, match="num_kv_heads 3 and parallel.tp 2"):
        config.load(overrides=BASE + ["model.arch=llama", "model.num_heads=6", "model.hidden_size=96",
                                      "model.num_kv_heads=3", "parallel.tp=2"])
    with pytest.raises(ConfigError, match="ffn_hidden_size 130 must be divisible by parallel.tp 4"):
        config.load(overrides=BASE + ["model.ffn_hidden_size=130", "parallel.tp=4"])
    with pytest.raises(ConfigError, match="seq_length 130 must be divisible by parallel.tp 4"):
        config.load(overrides=BASE + ["model.seq_length=130", "parallel.tp=4", "parallel.sequence_parallel=true"])
    with pytest.raises(ConfigError, match="model.recompute"):
        config.load(overrides=BASE + ["model.recompute=some"])
    cfg = config.load(overrides=BASE + ["parallel.tp=2"])
    config.set_vocab(cfg, 300)
    assert cfg.model.padded_vocab_size == 512  # multiple of 128 · tp


def test_context_parallel_checks():
    cp = BASE + ["parallel.cp=2", "model.seq_length=64"]
    cases = {
        "seq_length 62 must be divisible by 4 for parallel.cp=2 with cp_algo=zigzag": [
            "parallel.cp_algo=zigzag", "model.seq_length=62"],
        "must be divisible by 8 .* under sequence parallelism": [
            "parallel.cp_algo=zigzag", "parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_length=68"],
        "attention_dropout > 0 with parallel.cp > 1": ["model.attention_dropout=0.1"],
        "cp_algo=ulysses: the 3 query heads": ["parallel.cp_algo=ulysses", "model.num_heads=3", "model.hidden_size=48"],
    }
    for message, extra in cases.items():
        with pytest.raises(ConfigError, match=message):
            config.load(overrides=cp + extra)
    with pytest.raises(ConfigError, match="cp_ulysses=3 must divide parallel.cp=4"):
        config.load(overrides=BASE + ["parallel.cp=4", "parallel.cp_algo=usp", "parallel.cp_ulysses=3"])
    with pytest.raises(ConfigError, match="cp_ulysses=2 needs parallel.cp_algo=usp"):
        config.load(overrides=cp + ["parallel.cp_ulysses=2"])
    with pytest.raises(ConfigError, match="divisible by parallel.cp_ulysses=4"):
        config.load(overrides=BASE + ["parallel.cp=4", "parallel.cp_algo=usp", "parallel.cp_ulysses=4", "model.num_heads=2",
                                      "model.hidden_size=64"])
    assert config.load(overrides=BASE + ["parallel.cp=4", "parallel.cp_algo=usp",
                                         "parallel.cp_ulysses=2"]).parallel.cp_ulysses == 2
    ok = config.load(overrides=cp + ["parallel.cp_algo=llama3", "parallel.cp_heads_k_stride=2"])
    assert ok.parallel.world_size == 2 and ok.parallel.cp_heads_k_stride == 2
    assert config.load(overrides=cp + ["parallel.cp_document_chunk=1"]).parallel.cp_document_chunk == 1
    assert config.load(overrides=BASE).parallel.cp_document_chunk == DOCUMENT_CHUNK  # schema and layout agree
    with pytest.raises(ConfigError, match="parallel.cp_document_chunk: 0 must be >= 1"):
        config.load(overrides=cp + ["parallel.cp_document_chunk=0"])
    with pytest.raises(ConfigError, match="reset_attention_mask with model.attention_dropout"):
        config.load(overrides=BASE + ["data.reset_attention_mask=true", "model.attention_dropout=0.1"])


def test_loss_options_load_and_are_range_checked():
    cfg = config.load(overrides=BASE + ["train.label_smoothing=0.1", "train.z_loss=1e-4"])
    assert cfg.train.label_smoothing == pytest.approx(0.1) and cfg.train.z_loss == pytest.approx(1e-4)
    default = config.load(overrides=BASE)
    assert default.train.label_smoothing == 0.0 and default.train.z_loss == 0.0
    bad = {"train.label_smoothing=1": "train.label_smoothing: 1.0 must be in [0, 1)",
           "train.label_smoothing=-0.1": "train.label_smoothing: -0.1 must be in [0, 1)",
           "train.label_smoothing=nan": "train.label_smoothing: nan",
           "train.z_loss=-1e-4": "train.z_loss: -0.0001 must be a finite number >= 0",
           "train.z_loss=inf": "train.z_loss: inf",
           "train.z_loss=nan": "train.z_loss: nan"}
    for override, needle in bad.items():
        with pytest.raises(ConfigError) as exc:
            config.load(overrides=BASE + [override])
        assert needle in str(exc.value) and "\n" not in str(exc.value), (override, str(exc.value))


def test_warmup_fraction_derives_the_warmup_from_the_decay():
    assert config.load(overrides=BASE).train.lr_warmup_iters == 0  # neither set
    assert config.load(overrides=BASE + ["train.lr_warmup_iters=3"]).train.lr_warmup_iters == 3
    demo = config.load([DEMO])  # 0.1 of its 150 steps: the 15 it had before
    assert (demo.train.lr_warmup_fraction, demo.train.lr_warmup_iters) == (0.1, 15)
    assert config.load([DEMO], ["train.iters=10"]).train.lr_warmup_iters == 1  # shortened: a tenth
    t = config.load(overrides=BASE + ["train.iters=40", "train.lr_decay_iters=30", "train.lr_warmup_fraction=0.25"]).train
    assert t.lr_warmup_iters == 8  # of lr_decay_iters, rounded (7.5 → 8)
    assert config.finalize(demo).train.lr_warmup_iters == 15  # the resolved config holds both, and they agree
    assert config.load([DEMO], ["train.lr_warmup_iters=3", "train.lr_warmup_fraction=null"]
                       ).train.lr_warmup_iters == 3


def test_a_later_source_replaces_the_other_exclusive_key(tmp_path):
    """An exclusive key from a later source (file or command line) replaces the other one, with a note; both in one
    source (one file, or the command line) stay an error unless they agree."""
    notes: list[str] = []
    t = config.load([DEMO], ["train.lr_warmup_iters=5"], notes=notes).train
    assert (t.lr_warmup_iters, t.lr_warmup_fraction) == (5, None)
    assert notes == ["train.lr_warmup_iters=5 (command line) replaces train.lr_warmup_fraction=0.1 set before it"]
    later = tmp_path / "later.yml"
    later.write_text("train: {lr_warmup_fraction: 0.2}\n")
    assert config.load([DEMO, later], ["train.lr_warmup_iters=5"]).train.lr_warmup_iters == 5
    t = config.load([DEMO, later], ["train.lr_warmup_iters=5", "train.lr_warmup_fraction=null"]).train
    assert t.lr_warmup_iters == 5  # the command line sets both: as it says
    resolved = tmp_path / "resolved.yml"  # a run's config.yml: both, agreeing; a later fraction wins
    config.save(config.load([DEMO]), resolved)
    assert config.load([resolved, later]).train.lr_warmup_iters == 30  # 0.2 of 150
    with pytest.raises(ConfigError, match=r"train.lr_warmup_iters 3 and train.lr_warmup_fraction 0.1 are both set"):
        config.load([DEMO], ["train.lr_warmup_iters=3", "train.lr_warmup_fraction=0.1"])
    both = tmp_path / "both.yml"
    both.write_text("train: {lr_warmup_iters: 3, lr_warmup_fraction: 0.1}\n")
    with pytest.raises(ConfigError, match="are both set"):
        config.load([DEMO, both])
    from megatron_sp.config.loader import EXCLUSIVE

    assert all(hasattr(getattr(config.Config(), k.split(".")[0]), k.split(".")[1]) for pair in EXCLUSIVE for k in pair)
    with pytest.raises(ConfigError, match=r"train.lr_warmup_fraction: 1.5 must be in \[0, 1\]"):
        config.load(overrides=BASE + ["train.lr_warmup_fraction=1.5"])


def test_run_name_fills_the_run_directories(tmp_path):
    assert config.load(overrides=BASE).logging.dir == "runs/default"
    demo = config.load([DEMO])
    assert (demo.logging.dir, demo.checkpoint.save, demo.checkpoint.auto_resume) == ("runs/demo", "checkpoints/demo", True)
    tp2 = config.load([DEMO], ["logging.name=tp2", "checkpoint.load=ckpt/{name}-base"])
    assert (tp2.logging.dir, tp2.checkpoint.save, tp2.checkpoint.load) == ("runs/tp2", "checkpoints/tp2", "ckpt/tp2-base")
    assert config.load([DEMO], ["logging.name=x", "logging.dir=logs/fixed"]).logging.dir == "logs/fixed"
    config.save(tp2, tmp_path / "config.yml")  # the resolved config shows the paths, and loads as it is
    assert "dir: runs/tp2" in (tmp_path / "config.yml").read_text()
    assert config.to_dict(config.load([tmp_path / "config.yml"])) == config.to_dict(tp2)
    for override, needle in [("logging.name=a/b", "logging.name: 'a/b' must be letters"),
                             ("logging.name=..", "logging.name: '..'"),
                             ("checkpoint.save=ckpt/{nmae}", "checkpoint.save: 'ckpt/{nmae}' holds {nmae}")]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            config.load([DEMO], [override])
