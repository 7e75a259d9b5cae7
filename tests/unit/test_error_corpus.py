"""The error corpus: malformed configs and inputs through train.py's entry point.

Every case must end with a non-zero exit code and exactly one stderr line ``error: ...`` that names
the offending key or file, with no traceback, before any rank starts or any step runs. The cases go
through train.py's ``main(argv)`` in this process (the config and the input files are
checked before ``train.py`` launches ranks, so nothing else runs); a few also go through a real
``python train.py`` to show the process behaves the same. Data-file corruption and hostfile cases
live with their own modules' tests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import train as cli  # train.py: its main() is the command line
from megatron_sp import launcher, training

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Case:
    """``args`` after ``--conf {base}``, unless ``conf`` is False; ``{dir}`` is the corpus folder.
    ``needles`` must all appear in the error line; ``exit_code`` 2 for config errors, 1 for data."""

    name: str
    args: tuple[str, ...]
    needles: tuple[str, ...]
    exit_code: int = 2
    conf: bool = True
    hide: str | None = None  # a package to make unimportable for this case
    absent: tuple[str, ...] = ()  # must not appear in the line


def case(name: str, *args: str, needles: str | tuple[str, ...], **kw) -> Case:
    return Case(name, args, (needles,) if isinstance(needles, str) else needles, **kw)


# A valid small config: every case breaks one thing. Its dataset is missing on purpose, so a case
# whose own check did not fire ends with the dataset's error, which the needles reject.
BASE_YML = """\
model: {num_layers: 2, hidden_size: 64, num_heads: 4, seq_length: 64}
train: {iters: 2, micro_batch_size: 1}
tokenizer: {type: byte}
data: {paths: ["{dir}/no_data/corpus_text_document"]}
logging: {dir: "{dir}/run", interval: 1}
"""

FILES = {
    "unknown_key.yml": "model:\n  hidden_szie: 64\n",
    "unknown_section.yml": "trian:\n  iters: 3\n",
    "list_for_int.yml": "model:\n  num_layers: [1, 2]\n",
    "null_value.yml": "model:\n  num_layers: null\n",
    "float_for_int.yml": "model:\n  hidden_size: 64.5\n",
    "scalar_section.yml": "model: 3\n",
    "paths_not_list.yml": "data:\n  paths: {a: 1}\n",
    "bad_yaml.yml": "model: [unclosed\n",
    "bad_indent.yml": "model:\n  num_layers: 2\n hidden_size: 64\n",
    "tab_indent.yml": "model:\n\tnum_layers: 2\n",
    "top_level_list.yml": "- model\n- train\n",
    "bad_json.json": '{"model": {"num_layers": }}',
    "string_for_bool.json": json.dumps({"model": {"tie_embeddings": "sometimes"}}),
    "dup_key.yml": "train:\n  iters: 5\n  iters: 100\n",
    "dup_section.yml": "train:\n  iters: 5\nmodel:\n  num_layers: 2\ntrain:\n  iters: 100\n",
    "dup_key.json": '{"train": {"iters": 5, "iters": 100}}',
    "nan_lr.yml": "train:\n  lr: .nan\n",
    "inf_lr.yml": "train:\n  lr: .inf\n",
    "nan.json": '{"train": {"lr": NaN}}',
    # 1.1 KB of nested aliases: 9^9 values when walked (a 5.8 MB error line before)
    "alias_bomb.yml": "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")),
    "python_tag.yml": "model: !!python/object/apply:os.system ['echo pwned']\n",
    "huge_value.yml": "model:\n  arch: " + "x" * 200_000 + "\n",
    "merge_key.yml": "base: &base {num_layers: 2}\n",
}
BINARY_FILES = {"binary.yml": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "binary_override.json": b"{\"model\": \xff}"}

CASES = [
    # --- unknown keys ---
    case("unknown override key", "train.itres=5", needles=("train.itres", "did you mean 'train.iters'")),
    case("unknown override section", "modle.arch=neox", needles=("modle", "did you mean 'model'")),
    case("unknown key in a file", "--conf", "{dir}/unknown_key.yml",
         needles=("unknown_key.yml", "model.hidden_szie", "model.hidden_size")),
    case("unknown section in a file", "--conf", "{dir}/unknown_section.yml", needles=("unknown_section.yml", "trian")),
    # --- wrong types ---
    case("text for an int", "train.iters=abc", needles=("train.iters", "abc")),
    case("text for a float", "train.lr=fast", needles=("train.lr", "fast")),
    case("text for a bool", "model.tie_embeddings=maybe", needles="model.tie_embeddings"),
    case("list for an int", "--conf", "{dir}/list_for_int.yml", needles="model.num_layers"),
    case("null for an int", "--conf", "{dir}/null_value.yml", needles=("model.num_layers", "null")),
    case("fraction for an int", "--conf", "{dir}/float_for_int.yml", needles=("model.hidden_size", "64.5")),
    case("section not a mapping", "--conf", "{dir}/scalar_section.yml", needles=("scalar_section.yml", "'model'")),
    case("mapping for a list", "--conf", "{dir}/paths_not_list.yml", needles="data.paths"),
    case("string for a bool in JSON", "--conf", "{dir}/string_for_bool.json", needles="model.tie_embeddings"),
    case("unknown choice", "model.arch=gpt5", needles=("model.arch", "'gpt5' is not one of neox, llama"),
         absent=("known keys",)),
    case("unknown precision", "train.precision=fp8", needles="train.precision"),
    case("unknown schedule", "parallel.pp_schedule=gpipe", needles="parallel.pp_schedule"),
    case("unknown log level", "logging.level=loud", needles="logging.level"),
    # --- sizes that do not divide ---
    case("heads do not divide hidden", "model.num_heads=3", needles=("model.hidden_size", "model.num_heads")),
    case("tp does not divide heads", "parallel.tp=3", needles=("model.num_heads", "parallel.tp")),
    case("global batch not a multiple", "train.micro_batch_size=4", "train.global_batch_size=10",
         needles="train.global_batch_size"),
    case("layers do not split over pp", "parallel.pp=2", "model.num_layers=3", "train.global_batch_size=4",
         needles="model.num_layers"),
    case("seq not divisible under SP", "parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_length=65",
         needles=("model.seq_length", "parallel.tp")),
    case("seq not divisible under zigzag CP", "parallel.cp=2", "parallel.cp_algo=zigzag", "model.seq_length=62",
         needles=("model.seq_length", "parallel.cp")),
    case("kv heads do not divide heads", "model.arch=llama", "model.num_kv_heads=3", "model.ffn_multiple_of=64",
         needles="model.num_kv_heads"),
    case("pipeline without micro-batches", "parallel.pp=2", needles="parallel.pp"),
    # --- conflicting options ---
    case("SP without TP", "parallel.sequence_parallel=true", needles="parallel.sequence_parallel"),
    case("nccl on cpu", "parallel.device=cpu", "parallel.backend=nccl", needles="parallel.backend"),
    case("min_lr above lr", "train.lr=1e-4", "train.min_lr=1e-3", needles=("train.min_lr", "train.lr")),
    case("warm-up past the decay", "train.lr_warmup_iters=10", "train.lr_decay_iters=5",
         needles=("train.lr_warmup_iters", "train.lr_decay_iters >= 10"), absent=("train.iters",)),
    case("warm-up past a run made short", "train.lr_warmup_iters=10",
         needles=("train.lr_decay_iters 2 (= train.iters)", "train.lr_warmup_iters <= 2")),
    case("warm-up in steps and as a fraction", "train.lr_warmup_iters=2", "train.lr_warmup_fraction=0.1",
         needles=("train.lr_warmup_iters 2", "train.lr_warmup_fraction 0.1", "both set")),
    case("warm-up fraction above 1", "train.lr_warmup_fraction=1.5", needles="train.lr_warmup_fraction"),
    case("run name with a slash", "logging.name=a/b", needles="logging.name"),
    case("unknown path placeholder", "checkpoint.save={dir}/ckpt/{run}", needles=("checkpoint.save", "{run}")),
    case("checkpoint interval without save", "checkpoint.interval=5", needles=("checkpoint.interval", "checkpoint.save")),
    case("virtual stages without interleaving", "parallel.virtual_stages=2", needles="parallel.virtual_stages"),
    case("world size disagrees", "parallel.world_size=3", needles="parallel.world_size"),
    case("grad accumulation disagrees", "train.grad_accum_steps=3", "train.global_batch_size=2", needles="train.grad_accum_steps"),
    case("GQA on neox", "model.num_kv_heads=2", needles=("model.num_kv_heads", "llama")),
    case("ulysses degree without usp", "parallel.cp=2", "parallel.cp_ulysses=2", needles="parallel.cp_ulysses"),
    case("zero stage 4", "parallel.zero=4", needles="parallel.zero"),
    case("vocab size below the tokenizer's", "model.vocab_size=10", needles="model.vocab_size 10 is smaller"),
    case("wandb not installed", "logging.wandb=true", needles=("logging.wandb", "pip install"), hide="wandb"),
    case("tensorboard not installed", "logging.tensorboard=true", needles=("logging.tensorboard", "pip install"),
         hide="tensorboard"),
    # --- mixture of experts (model.num_experts, model.moe_*) ---
    case("MoE top-k above the experts", "model.num_experts=4", "model.moe_top_k=5",
         needles=("model.moe_top_k", "model.num_experts (4)")),
    case("MoE key on a dense model", "model.moe_top_k=1", needles=("model.moe_top_k", "model.num_experts is 0")),
    case("MoE capacity factor of 0", "model.num_experts=4", "model.moe_capacity_factor=0",
         needles=("model.moe_capacity_factor", "must be > 0")),
    case("negative MoE aux coefficient", "model.num_experts=4", "model.moe_aux_loss_coeff=-0.01",
         needles="model.moe_aux_loss_coeff"),
    case("negative MoE z-loss coefficient", "model.num_experts=4", "model.moe_z_loss_coeff=-1",
         needles="model.moe_z_loss_coeff"),
    case("negative expert count", "model.num_experts=-2", needles="model.num_experts"),
    case("unknown router score", "model.num_experts=4", "model.moe_router_score=relu",
         needles=("model.moe_router_score", "softmax, sigmoid")),
    case("MoE with no MoE layer", "model.num_experts=4", "model.moe_first_dense_layers=2",
         needles="model.moe_first_dense_layers"),
    case("MoE layer frequency 0", "model.num_experts=4", "model.moe_layer_freq=0", needles="model.moe_layer_freq"),
    case("MoE capacity with context parallelism", "model.num_experts=4", "model.moe_capacity_factor=1.0", "parallel.cp=2",
         needles=("model.moe_capacity_factor", "parallel.cp=1")),
    case("experts not divisible by ep", "model.num_experts=3", "parallel.dp=2", "parallel.ep=2",
         needles=("model.num_experts: 3", "parallel.ep 2")),
    case("ep not dividing cp·dp", "model.num_experts=4", "parallel.dp=2", "parallel.ep=4",
         needles=("parallel.ep: 4", "cp·dp = 2")),
    case("ep not dividing tp·cp·dp under SP", "model.num_experts=8", "parallel.tp=2", "parallel.sequence_parallel=true",
         "parallel.ep=8", needles=("parallel.ep: 8", "tp·cp·dp = 2")),
    case("ep on a dense model", "parallel.dp=2", "parallel.ep=2", needles=("parallel.ep: 2", "needs a MoE model")),
    case("expert_tp other than 1 or tp", "model.num_experts=4", "parallel.expert_tp=2",
         needles=("parallel.expert_tp: 2", "or parallel.tp 1")),
    case("expert_tp with sequence parallelism", "model.num_experts=4", "parallel.tp=2", "parallel.expert_tp=2",
         "parallel.sequence_parallel=true", needles=("parallel.expert_tp: 2", "parallel.expert_tp=1")),
    case("expert width not divisible by expert_tp", "model.num_experts=4", "model.moe_ffn_hidden_size=63",
         "parallel.tp=2", "parallel.expert_tp=2", needles=("model.moe_ffn_hidden_size: 63", "parallel.expert_tp 2")),
    # --- negative and zero sizes ---
    case("negative iters", "train.iters=-5", needles=("train.iters", "-5")),
    case("negative hidden size", "model.hidden_size=-64", needles="model.hidden_size"),
    case("zero micro-batch", "train.micro_batch_size=0", needles="train.micro_batch_size"),
    case("negative lr", "train.lr=-1", needles="train.lr"),
    case("dropout of 1.5", "model.hidden_dropout=1.5", needles="model.hidden_dropout"),
    case("zero rotary", "model.rotary_pct=0", needles="model.rotary_pct"),
    case("negative split", "data.split=-1,2,0", needles="data.split"),
    case("split not numbers", "data.split=a,b", needles="data.split"),
    # --- missing or unreadable files ---
    case("missing config file", "--conf", "{dir}/missing.yml", needles="missing.yml"),
    case("missing config file alone", "--conf", "{dir}/nowhere/demo.yml", needles="nowhere/demo.yml", conf=False),
    case("missing dataset prefix", needles=("no_data/corpus_text_document", "not found"), exit_code=1),
    case("missing tokenizer model", "tokenizer.type=sentencepiece", "tokenizer.model={dir}/absent.model",
         needles=("absent.model", "not found"), exit_code=1),
    case("sentencepiece without a model", "tokenizer.type=sentencepiece", needles="tokenizer.model"),
    case("no dataset at all", "data.paths=[]", needles="data.paths"),
    # --- malformed files ---
    case("bad YAML", "--conf", "{dir}/bad_yaml.yml", needles=("bad_yaml.yml", "not valid YAML: line 2, column 1")),
    case("bad YAML indentation", "--conf", "{dir}/bad_indent.yml",
         needles=("bad_indent.yml", "not valid YAML: line 3, column 2")),
    case("tab in YAML", "--conf", "{dir}/tab_indent.yml", needles=("tab_indent.yml", "line 2, column 1", "'\\t'")),
    case("YAML list at the top", "--conf", "{dir}/top_level_list.yml", needles=("top_level_list.yml", "mapping")),
    case("bad JSON", "--conf", "{dir}/bad_json.json", needles=("bad_json.json", "not valid JSON")),
    # --- bad override syntax and command line ---
    case("override without =", "noequals", needles=("noequals", "section.key=value")),
    case("override without a section", "iters=5", needles=("iters=5", "section.key")),
    case("override three levels deep", "model.arch.name=neox", needles=("model.arch.name", "section.key")),
    case("override with an empty section", ".iters=5", needles=(".iters=5", "section.key")),
    case("misspelt option", "--confg", "{dir}/base.yml", needles="--confg"),
    case("option without its value", "--conf", needles="--conf"),
    # --- output directories: never write over what another run (or the user) left there ---
    case("checkpoint.save is a file", "checkpoint.save={dir}/base.yml", needles=("checkpoint.save", "is a file")),
    case("logging.dir is a file", "logging.dir={dir}/base.yml", needles=("logging.dir", "base.yml", "is a file")),
    case("logging.dir under a file", "logging.dir={dir}/base.yml/run",
         needles=("logging.dir", "lies under the file", "base.yml")),
    case("save dir of another run", "checkpoint.save={dir}/other_run",
         needles=("checkpoint.save", "holds checkpoints of another run", "iter_0000003", "checkpoint.overwrite=true")),
    case("save dir in use by a run", "checkpoint.save={dir}/locked",
         needles=("checkpoint.save", "locked' is in use by another run", f"pid {os.getpid()}")),
    case("load elsewhere into a used save dir", "checkpoint.load={dir}/branch", "checkpoint.save={dir}/other_run",
         needles=("other_run", "does not continue", "checkpoint.overwrite=true")),
    case("rollback over another branch", "checkpoint.load={dir}/branch/iter_0000002", "checkpoint.save={dir}/branch",
         "train.iters=4", needles=("resumes from iter_0000002", "iter_0000004 again", "checkpoint.overwrite=true")),
    # --- duplicates: the last one used to win silently (a duplicated train: section ran 100 iterations, not 5) ---
    case("duplicate key in YAML", "--conf", "{dir}/dup_key.yml", needles=("dup_key.yml", "'iters' appears twice",
                                                                           "lines 2 and 3")),
    case("duplicate section in YAML", "--conf", "{dir}/dup_section.yml",
         needles=("dup_section.yml", "'train' appears twice", "lines 1 and 5")),
    case("duplicate key in JSON", "--conf", "{dir}/dup_key.json", needles=("dup_key.json", "'iters' appears twice")),
    # --- NaN and infinity pass no range check: every float key is finite at load ---
    case("nan lr", "train.lr=nan", needles=("train.lr", "not a finite number")),
    case("inf lr", "train.lr=inf", needles=("train.lr", "not a finite number")),
    case("-inf min_lr", "train.min_lr=-inf", needles=("train.min_lr", "not a finite number")),
    case("nan weight decay", "train.weight_decay=nan", needles="train.weight_decay"),
    case("nan clip_grad", "train.clip_grad=nan", needles="train.clip_grad"),
    case("nan hidden dropout", "model.hidden_dropout=nan", needles="model.hidden_dropout"),
    case("inf attention dropout", "model.attention_dropout=inf", needles="model.attention_dropout"),
    case("nan init_std", "model.init_std=nan", needles="model.init_std"),
    case("nan norm eps", "model.norm_eps=NaN", needles="model.norm_eps"),
    case("inf rotary base", "model.rotary_base=Infinity", needles="model.rotary_base"),
    case("nan adam beta", "train.adam_beta2=nan", needles="train.adam_beta2"),
    case("inf timeout", "parallel.timeout_s=inf", needles="parallel.timeout_s"),
    case("nan peak tflops", "logging.peak_tflops=nan", needles="logging.peak_tflops"),
    case("nan label smoothing", "train.label_smoothing=nan", needles="train.label_smoothing"),
    case("nan in a YAML file", "--conf", "{dir}/nan_lr.yml", needles=("nan_lr.yml", "train.lr", "finite")),
    case("inf in a YAML file", "--conf", "{dir}/inf_lr.yml", needles=("inf_lr.yml", "train.lr", "finite")),
    case("NaN in a JSON file", "--conf", "{dir}/nan.json", needles=("nan.json", "train.lr", "finite")),
    case("nan in the split", "data.split=nan,1,0", needles="data.split"),
    case("inf in the split", "data.split=inf,1,0", needles="data.split"),
    # --- ranges the old checks missed ---
    case("negative init_std", "model.init_std=-0.02", needles=("model.init_std", "> 0")),
    case("negative norm eps", "model.norm_eps=-1e-5", needles="model.norm_eps"),
    case("zero rotary base", "model.rotary_base=0", needles="model.rotary_base"),
    case("adam beta of 1.5", "train.adam_beta1=1.5", needles=("train.adam_beta1", "[0, 1)")),
    case("zero adam eps", "train.adam_eps=0", needles="train.adam_eps"),
    case("heads leave no rotary dims", "model.num_heads=64", needles=("model.rotary_pct", "no rotary dims",
                                                                      "num_heads 64")),
    # --- sizes and counts bounded by what is meaningful ---
    case("iterations of 1e21", "train.iters=1e21", needles=("train.iters", "too large")),
    case("sequence of 1e20", "model.seq_length=100000000000000000000", needles=("model.seq_length", "too large")),
    case("batch of 2^60", "train.global_batch_size=1152921504606846976", needles="train.global_batch_size"),
    case("a sample of 1e8 tokens", "train.sample_tokens=100000000", needles=("train.sample_tokens", "100000")),
    case("more samples than memory", "data.paths=[{dir}/tiny_text_document]", "train.iters=1000000000000000",
         needles=("train.iters", "GiB", "lower train.iters"), exit_code=2),  # the pre-flight counts the index
    # --- files that are not configs, and error lines that stay lines ---
    case("binary config", "--conf", "{dir}/binary.yml", needles=("binary.yml", "not UTF-8")),
    case("binary JSON config", "--conf", "{dir}/binary_override.json", needles=("binary_override.json", "not UTF-8")),
    case("alias bomb", "--conf", "{dir}/alias_bomb.yml", needles=("alias_bomb.yml", "expands to more than")),
    case("python tag in YAML", "--conf", "{dir}/python_tag.yml", needles=("python_tag.yml", "not valid YAML")),
    case("200k-character value", "--conf", "{dir}/huge_value.yml", needles=("model.arch", "200000 characters")),
    case("100k-character override", "train.lr=" + "9" * 100_000, needles=("train.lr", "characters")),
    case("binary latest", "checkpoint.load={dir}/binary_latest", "data.paths=[{dir}/tiny_text_document]",
         needles=("binary_latest/latest", "does not name"), exit_code=1),
    case("latest naming a path", "checkpoint.load={dir}/escaping_latest", "data.paths=[{dir}/tiny_text_document]",
         needles=("escaping_latest/latest", "does not name"), exit_code=1),
    case("binary meta.json", "checkpoint.load={dir}/binary_meta", "data.paths=[{dir}/tiny_text_document]",
         needles=("binary_meta/meta.json", "unreadable"), exit_code=1),
    case("unknown top-level anchor section", "--conf", "{dir}/merge_key.yml", needles=("merge_key.yml", "'base'")),
]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    from megatron_sp.checkpointing import FORMAT_VERSION, SaveDirLock

    d = tmp_path_factory.mktemp("error_corpus")
    (d / "base.yml").write_text(BASE_YML.replace("{dir}", str(d)))
    for name, text in FILES.items():
        (d / name).write_text(text)
    for name, data in BINARY_FILES.items():
        (d / name).write_bytes(data)
    for name, file, data in (("binary_latest", "latest", b"\xff\xfeiter\x00"), ("escaping_latest", "latest", b"../../etc\n"),
                             ("binary_meta", "meta.json", b"\x89\xff{")):
        (d / name).mkdir()
        (d / name / file).write_bytes(data)
    from megatron_sp.data.indexed import IndexedDatasetWriter
    with IndexedDatasetWriter(d / "tiny_text_document", "uint16") as writer:  # a real dataset of 3 documents
        for doc in ([72, 105, 256], [79, 107, 33, 256], [10, 256]):
            writer.add_document(doc)
    for run, steps in (("other_run", (3,)), ("branch", (2, 4))):  # save directories of earlier runs
        for step in steps:
            (d / run / f"iter_{step:07d}").mkdir(parents=True)
            meta = {"format_version": FORMAT_VERSION, "step": step, "consumed_samples": step, "run_id": run}
            (d / run / f"iter_{step:07d}" / "meta.json").write_text(json.dumps(meta))
        (d / run / "latest").write_text(f"iter_{steps[-1]:07d}\n")
    with SaveDirLock(d / "locked"):  # a run using that save directory now (this process)
        yield d


def argv_of(c: Case, d: Path) -> list[str]:
    args = [a.replace("{dir}", str(d)) for a in c.args]
    return (["--conf", str(d / "base.yml")] if c.conf else []) + args


def check_line(c: Case, code: int, stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code != 0, f"{c.name}: exit code 0"
    assert "Traceback" not in stderr, f"{c.name}:\n{stderr}"
    assert len(lines) == 1, f"{c.name}: expected one stderr line, got:\n{stderr}"
    line = lines[0]
    assert line.startswith("error: "), f"{c.name}: {line}"
    assert len(line) <= 600, f"{c.name}: an error line of {len(line)} characters"
    for needle in c.needles:
        assert needle in line, f"{c.name}: {needle!r} not in {line!r}"
    for word in c.absent:
        assert word not in line, f"{c.name}: {word!r} in {line!r}"
    assert code == c.exit_code, f"{c.name}: exit code {code}, expected {c.exit_code}: {line}"
    return line


def run_in_process(c: Case, d: Path, monkeypatch, capsys) -> tuple[int, str]:
    """``cli.main`` with train.py's argv; any launch or training would fail the case."""
    def must_not_train(*_: object, **__: object) -> None:
        raise AssertionError(f"{c.name}: passed the checks and would train")

    with monkeypatch.context() as m:
        for var in TORCHRUN_ENV:
            m.delenv(var, raising=False)
        m.setattr(training.log, "handlers", [])  # main() points the logger at this test's stdout: undo after
        m.setattr(training.log, "propagate", training.log.propagate)
        m.setattr(training.log, "level", training.log.level)
        m.setattr(training, "run", must_not_train)
        m.setattr(launcher, "start_local", must_not_train)
        if c.hide:
            m.setitem(sys.modules, c.hide, None)  # as if not installed
        try:
            code = cli.main(argv_of(c, d))
        except SystemExit as exc:  # argparse usage errors exit from parse_args
            code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def test_corpus_is_large_and_distinct():
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_error_is_one_line_naming_the_culprit(c: Case, corpus_dir, monkeypatch, capsys):
    code, err = run_in_process(c, corpus_dir, monkeypatch, capsys)
    check_line(c, code, err)


# The real entry point, for a few cases: same line, same exit code, and a multi-rank layout with a
# missing dataset stops before it starts any rank. The processes run side by side (each mostly imports torch).
SUBPROCESS_CASES = {"bad YAML": [], "missing dataset prefix": ["parallel.dp=2", "train.global_batch_size=2"],
                    "save dir in use by a run": []}  # the lock is held by this test process


@pytest.fixture(scope="module")
def train_py_results(corpus_dir) -> dict[str, tuple[int, str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    procs = {}
    for name, extra in SUBPROCESS_CASES.items():
        c = next(x for x in CASES if x.name == name)
        procs[name] = subprocess.Popen([sys.executable, "train.py", *argv_of(c, corpus_dir), *extra], cwd=ROOT,
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = (proc.returncode, out, err)
    return results


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_train_py_prints_the_same_line(name, train_py_results, corpus_dir, monkeypatch, capsys):
    c = next(x for x in CASES if x.name == name)
    returncode, stdout, stderr = train_py_results[name]
    line = check_line(c, returncode, stderr)
    assert "local ranks" not in stdout + stderr and "[rank" not in stdout + stderr  # nothing was launched
    code, err = run_in_process(c, corpus_dir, monkeypatch, capsys)
    assert (code, err.strip()) == (returncode, line)
