"""``inference.generate_batch`` under TP, PP and TP × PP (gloo) against the 1-rank run from the same seed (fp32).

Each rank builds its stage of the same tiny GPT (initialisation is layout-free) and decodes the same prompts of
different lengths: greedy and seeded top-p sampling must give the 1-rank tokens; the sampled tokens of a prompt
must not depend on the other prompts of the batch nor on the micro-batching (several micro-batches in flight
through the pipeline); a prompt that fills the context stops with ``context``; a tied llama with GQA and kv heads
replicated over tp 4 too (tp > kv heads); under SP (no KV cache: the whole contexts re-run) too; and with the
prompts prefilled over two cp ranks (zigzag; llama3 with tp2), every cp rank then decoding with the whole cache;
and DeepSeek's latent attention (its cache of latents) under tp2 × pp2 and tp2 × cp2 zigzag.
"""
from __future__ import annotations

import pytest
import torch

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import GPTModel
from megatron_sp.model.inference import Sampling, generate_batch
from megatron_sp.mpu import ParallelContext, ParallelDims, initialize
from megatron_sp.pipeline.partition import build_stage
from megatron_sp.testing import run_distributed

SEED, NEW = 7, 12
PROMPTS = [[3, 9, 4], [11, 2, 7, 7, 30, 1, 5], [42], [8, 8, 8, 8, 8], [17, 23, 29, 31, 37, 41, 43, 47, 2, 3, 5, 7, 11, 13]]
SAMPLE = Sampling(greedy=False, temperature=0.9, top_k=20, top_p=0.9, seed=5)


def _cfg(arch: str) -> ModelConfig:
    extra = {"num_kv_heads": 2, "tie_embeddings": True} if arch == "llama" else {"num_kv_heads": 4}
    if arch == "mla":  # DeepSeek's latent attention: the cache holds latents and shared rotary keys
        arch, extra = "llama", {"num_kv_heads": 4, "head_dim": 12, "kv_lora_rank": 16, "q_lora_rank": 24,
                                "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}
    return ModelConfig(arch=arch, num_layers=4, hidden_size=32, num_heads=4, seq_length=16,
                       vocab_size=50, padded_vocab_size=64, ffn_hidden_size=64, rotary_pct=1.0, **extra)


def _decode(model: GPTModel, state=None, eod: int | None = None, batching: bool = False) -> dict[str, list]:
    """Greedy (default micro-batches: pp of them), sampled (micro-batches of 2), greedy stopping at ``eod``; with
    ``batching`` (the 1-rank reference) also one prompt per micro-batch, and a prompt sampled alone."""
    def ids(out):
        return [(c.index, c.new_ids, c.stop) for c in out]
    model.eval()
    out = {"greedy": ids(generate_batch(model, PROMPTS, NEW, None, state=state)),
           "sampled": ids(generate_batch(model, PROMPTS, NEW, None, SAMPLE, micro_batch_size=2, state=state)),
           "eod": ids(generate_batch(model, PROMPTS, NEW, eod, state=state)) if eod is not None else []}
    if batching:
        out["greedy_mb1"] = ids(generate_batch(model, PROMPTS, NEW, None, micro_batch_size=1))
        out["sampled_alone"] = ids(generate_batch(model, PROMPTS[1:2], NEW, None, SAMPLE, indices=[1]))
    return out


def _rank(rank: int, world: int, tp: int, pp: int, sp: bool, arch: str, eod: int, cp: int = 1,
          algo: str = "ring") -> dict[str, list]:
    torch.set_num_threads(1)
    state = initialize(ParallelDims(tp=tp, pp=pp, cp=cp, world_size=world))
    model = build_stage(_cfg(arch), SEED, state, ParallelContext(tp_group=state.tp_group, sequence_parallel=sp,
                                                                 cp_group=state.cp_group, cp_algo=algo))
    return _decode(model, state, eod)


@pytest.mark.parametrize("arch,tp,pp,sp,cp", [("neox", 2, 1, True, ""), ("llama", 2, 2, False, ""),
                                              ("llama", 4, 1, False, ""),
                                              ("neox", 1, 1, False, "zigzag"), ("llama", 2, 1, False, "llama3"),
                                              ("mla", 2, 2, False, ""), ("mla", 2, 1, False, "zigzag")])
def test_generate_batch_layouts_equal_one_rank(arch: str, tp: int, pp: int, sp: bool, cp: str) -> None:
    torch.set_num_threads(1)
    model = GPTModel(_cfg(arch), seed=SEED)
    want = _decode(model)
    tokens = want["greedy"][1][1]
    eod = tokens[3]  # a token the second prompt's fourth step gives: it stops at its first occurrence
    want = _decode(model, eod=eod, batching=True)
    assert want["greedy"] == want["greedy_mb1"]
    assert want["sampled_alone"] == [want["sampled"][1]]  # independent of the other prompts
    assert want["greedy"][-1][2] == "context" and len(want["greedy"][-1][1]) == 3  # 14 + 3 - 1 = seq_length
    assert want["eod"][1][1:] == (tokens[:tokens.index(eod)], "eod")
    layout = {"cp": 2, "algo": cp} if cp else {}  # the prompts prefilled over two cp ranks with that algorithm
    for rank, got in enumerate(run_distributed(_rank, tp * pp * (2 if cp else 1), tp=tp, pp=pp, sp=sp, arch=arch,
                                               eod=eod, **layout)):
        assert got == {k: want[k] for k in got}, (arch, tp, pp, rank)
