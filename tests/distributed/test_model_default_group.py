"""A model built without tensor parallelism inside a multi-rank job is whole on every rank."""
import torch

from megatron_sp import config
from megatron_sp.model import GPTModel
from megatron_sp.testing import run_distributed


def _build(rank, world):
    cfg = config.load(overrides=["data.paths=[x]", "tokenizer.type=byte", "model.num_layers=1", "model.hidden_size=32",
                                 "model.num_heads=2", "model.seq_length=16"])
    config.set_vocab(cfg, 258)
    model = GPTModel(cfg.model, seed=1)  # default ParallelContext: this process alone, not the world group
    tokens = torch.arange(16).view(1, 16)
    return model.embedding.weight.shape, model(tokens, labels=tokens)


def test_default_model_is_not_sharded_over_the_world():
    (shape0, loss0), (shape1, loss1) = run_distributed(_build, 2)
    assert shape0 == shape1 == (384, 32)
    assert torch.equal(loss0, loss1)
