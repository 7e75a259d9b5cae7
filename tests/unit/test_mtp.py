"""Multi-token prediction (``model.mtp_layers``, model/mtp.py): the shifted inputs and targets of a batch, and the
objective's value and every gradient against a plain-torch restatement of DeepSeek-V3 §2.2 on the same weights (fp64).
Layouts: the parity matrix (tests/e2e/test_layout_parity.py, ``mtp_*`` rows)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_sp.config.schema import ModelConfig
from megatron_sp.data.batching import mtp_targets
from megatron_sp.data.packed import IGNORE_INDEX
from megatron_sp.model import GPTModel
from megatron_sp.model import mtp as mtp_mod

S, B, V, D, LAMBDA = 12, 2, 40, 2, 0.3


def test_targets_shift_on_the_whole_sequence_and_stop_at_masks_documents_and_the_end() -> None:
    tokens = torch.arange(10, 16).unsqueeze(0)  # [1, 6]
    labels = tokens + 1
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0, 1.0]])
    docs = torch.tensor([[0, 0, 0, 0, 1, 1]])
    out = mtp_targets({"tokens": tokens, "labels": labels, "loss_mask": mask, "document_ids": docs}, 2)
    assert out["mtp_tokens"][0].T.tolist() == [[11, 12, 13, 14, 15, 0], [12, 13, 14, 15, 0, 0]]
    x = IGNORE_INDEX  # module 1 at i targets label i+1; module 2 label i+2 (masked label 3; documents 0 | 1; the end)
    assert out["mtp_labels"][0].T.tolist() == [[12, 13, x, x, 16, x], [13, x, x, x, x, x]]
    no_docs = mtp_targets({"tokens": tokens, "labels": labels, "loss_mask": mask}, 2)["mtp_labels"][0].T.tolist()
    assert no_docs == [[12, 13, x, 15, 16, x], [13, x, 15, 16, x, x]]


def _model(**kw) -> GPTModel:
    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                      rotary_pct=1.0, head_dim=8, seq_length=S, vocab_size=V, padded_vocab_size=V, init_std=0.2,
                      mtp_layers=D, mtp_loss_coeff=LAMBDA, **kw)
    model = GPTModel(cfg, seed=5).double()
    with torch.no_grad():  # norms off 1, so that a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=p.dtype))
    return model


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("tie", [False, True])
def test_objective_and_gradients_match_a_plain_restatement(tie: bool) -> None:
    model = _model(tie_embeddings=tie).train()
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, V, (B, S + 1), generator=gen)
    mask = (torch.rand(B, S, generator=gen) > 0.2).double()
    batch = {"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": mask}
    extra = mtp_targets(batch, D)
    counts = [float((extra["mtp_labels"][..., k] != IGNORE_INDEX).sum()) for k in range(D)]
    captured = {}
    hook = model.layers["1"].register_forward_hook(lambda m, args, out: captured.update(args=args))
    mtp_mod.set_loss_scales(model, model.cfg, counts, grad_scale=1.0)
    losses = model(batch["tokens"], labels=batch["labels"], mtp=(extra["mtp_tokens"], extra["mtp_labels"]))
    ((losses * mask).sum() / mask.sum()).backward()
    hook.remove()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    sums = model.mtp_sums.clone()
    model.zero_grad()

    # DeepSeek-V3 §2.2 in plain torch on the same weights: h^0 = the main model's last state (before its final norm).
    eps, emb_w = model.cfg.norm_eps, model.embedding.weight
    out_w = emb_w if tie else model.output_layer.weight
    x = model.embedding(batch["tokens"].t())
    cos, sin = captured["args"][1], captured["args"][2]  # the rotary tables the model used
    for i in range(2):
        x = model.layers[str(i)](x, cos, sin)
    main = F.cross_entropy((_rms(x, model.final_norm.weight, eps) @ out_w.T).transpose(0, 1).reshape(-1, V),
                           batch["labels"].reshape(-1), reduction="none").view(B, S)
    objective = (main * mask).sum() / mask.sum()
    h, ref_sums = x, []
    for k, module in enumerate(model.mtp):
        shifted = torch.zeros_like(batch["tokens"])
        shifted[:, :S - k - 1] = seq[:, k + 1:S]  # token i + k + 1
        e = F.embedding(shifted.t(), emb_w)
        u = torch.cat([_rms(e, module.enorm.weight, eps), _rms(h, module.hnorm.weight, eps)], dim=-1)
        h = module.layer(u @ module.eh_proj.weight.T, cos, sin)
        logits = _rms(h, module.final_norm.weight, eps) @ out_w.T  # [s, b, V]
        target = extra["mtp_labels"][..., k]
        ce = F.cross_entropy(logits.transpose(0, 1).reshape(-1, V), target.reshape(-1), ignore_index=IGNORE_INDEX,
                             reduction="sum")
        ref_sums.append(ce)
        objective = objective + LAMBDA / D * ce / counts[k]
    objective.backward()
    torch.testing.assert_close(sums, torch.stack(ref_sums).detach(), rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_mtp_is_training_only() -> None:
    model = _model()
    tokens = torch.randint(0, V, (B, S))
    with pytest.raises(ValueError, match="mtp_tokens"):
        model(tokens, labels=tokens)  # training without the shifted targets
    with torch.no_grad():
        model(tokens, labels=tokens)  # evaluation: the main loss alone
    model.eval()
    model(tokens, labels=tokens)
    assert model.mtp_sums is None
