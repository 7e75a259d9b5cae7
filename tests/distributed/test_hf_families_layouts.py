"""Greedy tokens of every open-model family, imported from transformers, equal transformers' under tp2 (± SP) and pp2.

The parent builds each family's tiny random model from transformers' own config class and imports it with
tools/convert_checkpoint.py (``test_hf_families``'s helpers: the same path and models as the 1-rank check), then
computes transformers' greedy ``generate``. One launch of two gloo ranks loads every checkpoint, as
tools/generate.py does (the checkpoint's config with the layout as overrides, no data path, each rank reading its
shard), under tp2, tp2 with SP (the whole contexts re-run) and pp2 in turn, and decodes the same prompts with
``generate_batch``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_sp import checkpointing
from megatron_sp.model.inference import generate_batch
from megatron_sp.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "olmo2", "qwen3_moe",  # Qwen3-MoE: a dense layer, then MoE
            "deepseek_v3"]  # latent attention, a dense layer, then MoE with groups, shared expert, routing bias
LAYOUTS = [(2, 1, False), (2, 1, True), (1, 2, False)]  # (tp, pp, sequence_parallel)
NEW = 10


def _rank(rank: int, world: int, ckpts: dict[str, str], prompts: list[list[int]]) -> dict[tuple, list]:
    sys.path.insert(0, str(ROOT / "tools"))
    from inference_setup import checkpoint_config, loaded_stage  # tools/generate.py's path, its ranks' part

    out = {}
    for tp, pp, sp in LAYOUTS:
        layout = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.sequence_parallel={str(sp).lower()}"]
        for family, path in ckpts.items():
            ckpt = Path(path)
            meta = checkpointing.read_meta(ckpt)
            cfg = checkpoint_config(meta, ckpt, layout, world, batches=False)  # no data.paths
            with loaded_stage(cfg, ckpt, meta) as (state, model, _, _):
                done = generate_batch(model, prompts, NEW, None, state=state)
            out[(tp, pp, sp, family)] = [c.new_ids for c in done]
    return out


def tokenizer_json(path: Path, size: int) -> None:
    """A word-level tokenizer.json of ``size`` tokens, id 0 the end of document: the import copies it."""
    from tokenizers import Tokenizer, models

    vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, size)}}
    path.mkdir(parents=True)
    Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>")).save(str(path / "tokenizer.json"))


def test_greedy_equals_transformers_under_tp2_sp_and_pp2(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.unit.test_hf_families import V, hf_model, imported

    prompts = torch.randint(0, V, (4, 6), generator=torch.Generator().manual_seed(3))
    ckpts, want = {}, {}
    for family in FAMILIES:
        hf = hf_model(family).eval()
        hf.generation_config.eos_token_id = None  # ours is given no EOD either
        hf.config.output_router_logits = False  # (Qwen3-MoE's aux loss is no part of decoding)
        tokenizer_json(tmp_path / family / "hf", V)
        ckpts[family] = str(imported(hf, tmp_path / family)[0])
        with torch.no_grad():
            want[family] = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW,
                                       do_sample=False, pad_token_id=0)[:, 6:].tolist()  # (a prompt holds id 0)
    for rank, got in enumerate(run_distributed(_rank, 2, ckpts=ckpts, prompts=prompts.tolist())):
        assert len(got) == len(LAYOUTS) * len(FAMILIES)
        for (tp, pp, sp, family), tokens in got.items():
            assert tokens == want[family], (family, f"tp{tp} pp{pp} sp={sp}", rank)
