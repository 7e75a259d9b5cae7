"""tools/convert_checkpoint.py on checkpoints written by train.py at tp2 and pp2, and HF weights resumed by train.py.

The tools run in this process (convert_checkpoint makes no process group) or, tools/generate.py, on one harness rank
(``run_distributed``: the torchrun environment). Their command lines run in tests/e2e/test_readme_commands.py (the
README's convert, generate and evaluate commands) and tests/unit/test_generate.py."""
from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from megatron_sp import checkpointing
from megatron_sp.config.loader import _apply_section
from megatron_sp.config.schema import Config
from megatron_sp.model import GPTModel
from megatron_sp.testing import run_distributed
from tools import convert_checkpoint

from .runs import train

transformers = pytest.importorskip("transformers")


def convert(*args: object) -> None:
    assert convert_checkpoint.main([str(a) for a in args]) == 0


def _generate_rank(rank: int, world_size: int, argv: list[str]) -> tuple[int, str]:
    """tools/generate.py's ``main(argv)`` on this rank: (exit code, stdout)."""
    from tools import generate

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = generate.main(argv)
    return code, out.getvalue()


def ours_from(ckpt_root) -> GPTModel:
    """The full model of a checkpoint, loaded in this single process (no process groups)."""
    ckpt = checkpointing.resolve(ckpt_root)
    cfg = Config()
    _apply_section(cfg, "model", checkpointing.read_meta(ckpt)["config"]["model"], "meta.json")
    model = GPTModel(cfg.model, seed=0)
    checkpointing.load_model_state(model, ckpt, None)
    return model.eval()


@pytest.mark.parametrize("layout", [
    ("model.arch=neox", "parallel.tp=2", "parallel.sequence_parallel=true"),
    ("model.arch=llama", "model.tie_embeddings=true", "parallel.pp=2"),
], ids=["neox-tp2-sp", "llama-tied-pp2"])
def test_export_after_parallel_training(tmp_path, byte_data, layout):
    train(tmp_path / "run", byte_data, "train.iters=2", f"checkpoint.save={tmp_path}/ckpt", *layout)
    convert("--input", tmp_path / "ckpt", "--output", tmp_path / "hf", "--to", "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = ours_from(tmp_path / "ckpt")
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = ours(tokens)[..., :258]
        theirs = hf(input_ids=tokens).logits
    assert float((mine - theirs).abs().max() / theirs.abs().max()) <= 1e-5
    # greedy decoding: tools/generate.py on our checkpoint and transformers on the export agree token for token
    ((code, stdout),) = run_distributed(_generate_rank, 1, init=False, argv=[
        "--load", str(tmp_path / "ckpt"), "--prompt", "def main(", "--max-new-tokens", "12", "--greedy", "--json",
        "train.preflight=false"])
    assert code == 0
    out = json.loads(stdout.strip().splitlines()[-1])
    with torch.no_grad():
        hf_ids = hf.generate(torch.tensor([out["prompt_ids"]]), max_new_tokens=12, do_sample=False)[0].tolist()
    hf_new = hf_ids[len(out["prompt_ids"]):]
    eos = hf.generation_config.eos_token_id
    if hf_new and hf_new[-1] == eos:  # transformers keeps the end-of-document token; ours stops before it
        hf_new = hf_new[:-1]
    assert out["new_ids"] == hf_new and len(hf_new) > 0


def test_hf_import_resumes_in_train_py_with_a_fresh_optimizer(tmp_path, byte_data):
    cfg = transformers.LlamaConfig(vocab_size=258, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=256, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    convert("--input", tmp_path / "src", "--output", tmp_path / "ours", "--to", "megatron_sp", "--tp", "2")
    p = train(tmp_path / "run", byte_data, "train.iters=2", "model.arch=llama", "model.ffn_hidden_size=256",
              "parallel.tp=2", f"checkpoint.load={tmp_path}/ours")
    assert "fresh optimizer" in p.stdout + p.stderr
