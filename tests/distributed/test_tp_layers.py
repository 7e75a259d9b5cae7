"""TP/SP layers and the vocab-parallel cross entropy against unsharded references, on gloo.

Every rank builds the same full fp64 tensors from fixed seeds, runs the reference module
(``nn.Linear``, ``nn.Embedding``, ``F.cross_entropy``) on them, and compares the parallel layer's
output, input grad, weight grad and bias grad with the slices this rank should hold; the cross
entropy also with label smoothing and PaLM's z-loss over a padded vocabulary, and a whole GPTModel
with both loss options under TP + SP against the one-rank model. Also measured:
bytes saved for backward by the sequence-parallel column-parallel linear (recompute on/off), the
communication volume of a column+row pair with and without SP, and bf16 autocast. One launch per
world size; each rank returns ``{check: (error, tolerance)}`` plus facts and measurements.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_sp.config.schema import ModelConfig
from megatron_sp.model import GPTModel
from megatron_sp.mpu import (
    ColumnParallelLinear,
    GatherBuffer,
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
    comm,
    shard,
    vocab_parallel_cross_entropy,
)
from megatron_sp.testing import run_distributed

F64 = torch.float64
TOL64 = 1e-12  # fp64 layers: summation order only
S, B, H, FF, V = 8, 3, 6, 8, 16  # seq, batch, hidden, ffn (column out / row in), vocab


def _full(shape: tuple[int, ...], seed: int, dtype: torch.dtype = F64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64).to(dtype)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert tuple(got.shape) == tuple(want.shape), (tuple(got.shape), tuple(want.shape))
    return (got.double() - want.double()).abs().max().item()


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _ref_linear(W: torch.Tensor, Bias: torch.Tensor | None, X: torch.Tensor, G: torch.Tensor) -> dict[str, torch.Tensor]:
    lin = nn.Linear(W.shape[1], W.shape[0], bias=Bias is not None, dtype=F64)
    with torch.no_grad():
        lin.weight.copy_(W)
        if Bias is not None:
            lin.bias.copy_(Bias)
    x = _leaf(X)
    y = lin(x)
    y.backward(G)
    return {"y": y.detach(), "x": x.grad, "w": lin.weight.grad, "b": lin.bias.grad if Bias is not None else None}


# ---------------------------------------------------------------------------------------------- layers


def _column_case(group, t: int, r: int, sp: bool, gather_output: bool, recompute: bool, bias: bool,
                 external: bool) -> dict[str, tuple[float, float]]:
    W, Bias, X, G = _full((FF, H), 1), _full((FF,), 2), _full((S, B, H), 3), _full((S, B, FF), 4)
    ref = _ref_linear(W, Bias if bias else None, X, G)
    layer = ColumnParallelLinear(H, FF, bias=bias, group=group, sequence_parallel=sp, gather_output=gather_output,
                                 recompute_allgather=recompute, skip_weight=external, dtype=F64)
    with torch.no_grad():
        if not external:
            layer.weight.copy_(layer.shard_of(W, "weight"))
        if bias:
            layer.bias.copy_(layer.shard_of(Bias, "bias"))
    ext = _leaf(layer.shard_of(W, "weight")) if external else None
    x = _leaf(X.chunk(t, 0)[r] if sp else X)
    y = layer(x, weight=ext)
    y.backward(G if gather_output else G.chunk(t, -1)[r])
    grad_w = ext.grad if external else layer.weight.grad
    out = {"out": (_err(y, ref["y"] if gather_output else ref["y"].chunk(t, -1)[r]), TOL64),
           "grad x": (_err(x.grad, ref["x"].chunk(t, 0)[r] if sp else ref["x"]), TOL64),
           "grad w": (_err(grad_w, ref["w"].chunk(t, 0)[r]), TOL64)}
    if bias:
        out["grad b"] = (_err(layer.bias.grad, ref["b"].chunk(t, 0)[r]), TOL64)
    return out


def _row_case(group, t: int, r: int, sp: bool, input_is_parallel: bool, bias: bool) -> dict[str, tuple[float, float]]:
    W, Bias, X, G = _full((H, FF), 5), _full((H,), 6), _full((S, B, FF), 7), _full((S, B, H), 8)
    ref = _ref_linear(W, Bias if bias else None, X, G)
    layer = RowParallelLinear(FF, H, bias=bias, group=group, sequence_parallel=sp, input_is_parallel=input_is_parallel,
                              dtype=F64)
    with torch.no_grad():
        layer.weight.copy_(layer.shard_of(W, "weight"))
        if bias:
            layer.bias.copy_(layer.shard_of(Bias, "bias"))
    x = _leaf(X.chunk(t, -1)[r] if input_is_parallel else X)
    y = layer(x)
    y.backward(G.chunk(t, 0)[r] if sp else G)
    out = {"out": (_err(y, ref["y"].chunk(t, 0)[r] if sp else ref["y"]), TOL64),
           "grad x": (_err(x.grad, ref["x"].chunk(t, -1)[r] if input_is_parallel else ref["x"]), TOL64),
           "grad w": (_err(layer.weight.grad, ref["w"].chunk(t, 1)[r]), TOL64)}
    if bias:
        if sp:  # a partial sum over this rank's sequence slice; the trainer all-reduces it over TP
            out["grad b local"] = (_err(layer.bias.grad, G.chunk(t, 0)[r].sum((0, 1))), TOL64)
            out["grad b after TP all-reduce"] = (_err(comm.all_reduce(layer.bias.grad.clone(), group), ref["b"]), TOL64)
        else:
            out["grad b"] = (_err(layer.bias.grad, ref["b"]), TOL64)
    return out


def _embedding_case(group, t: int, r: int, sp: bool) -> dict[str, tuple[float, float]]:
    E, G = _full((V, H), 9), _full((S, B, H), 10)
    ids = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(11))
    ids[0, 0], ids[-1, -1] = 0, V - 1  # both ends of the vocabulary
    emb = nn.Embedding(V, H, dtype=F64)
    with torch.no_grad():
        emb.weight.copy_(E)
    y_ref = emb(ids)
    y_ref.backward(G)
    layer = VocabParallelEmbedding(V, H, group=group, sequence_parallel=sp, dtype=F64)
    with torch.no_grad():
        layer.weight.copy_(layer.shard_of(E, "weight"))
    y = layer(ids)
    y.backward(G.chunk(t, 0)[r] if sp else G)
    return {"out": (_err(y, y_ref.chunk(t, 0)[r] if sp else y_ref), TOL64),
            "grad w": (_err(layer.weight.grad, emb.weight.grad.chunk(t, 0)[r]), TOL64)}


def _ce_cases(group, t: int, r: int) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    L, gl = _full((S, B, V), 12), _full((S, B), 13)
    T = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(14))
    T[0, 0], T[1, 2], T[3, 1] = -100, -1, V - 1  # two ignored targets (any negative id), the last vocab row
    ignored = T < 0
    cases = [("fp64", L, 0.0, TOL64, TOL64), ("fp64 smoothing 0.1", L, 0.1, TOL64, TOL64),
             ("bf16 smoothing 0.1", L.to(torch.bfloat16), 0.1, 1e-5, 2.0 ** -8),  # bf16 grads: 8-bit mantissa
             ("fp32 large logits", (L * 4 + 500).float(), 0.0, 1e-4, 1e-6)]
    for name, logits, eps, tol_loss, tol_grad in cases:  # tolerances relative to max(1, max |loss| or |grad_loss|)
        ref_in = _leaf(logits.double())  # the reference sees exactly the (rounded) logits the ranks see
        ref = F.cross_entropy(ref_in.flatten(0, 1), T.masked_fill(ignored, -100).flatten(), reduction="none",
                              label_smoothing=eps).view(S, B)
        ref.backward(gl)
        x = _leaf(logits.chunk(t, -1)[r])
        loss = vocab_parallel_cross_entropy(x, T, group, label_smoothing=eps)
        loss.backward(gl.to(loss.dtype))
        out[f"{name} loss"] = (_err(loss, ref), tol_loss * max(1.0, ref.abs().max().item()))
        out[f"{name} grad"] = (_err(x.grad, ref_in.grad.chunk(t, -1)[r]), tol_grad * max(1.0, gl.abs().max().item()))
        out[f"{name} loss dtype"] = (0.0 if loss.dtype == torch.promote_types(logits.dtype, torch.float32) else 1.0, 0)
        out[f"{name} grad dtype"] = (0.0 if x.grad.dtype == logits.dtype else 1.0, 0)
        out[f"{name} ignored loss is 0"] = (loss[ignored].abs().max().item(), 0)
        out[f"{name} ignored grad is 0"] = (x.grad[ignored].abs().max().item(), 0)
    return out


def _ce_option_cases(group, t: int, r: int) -> dict[str, tuple[float, float]]:
    """Label smoothing + z-loss on a padded vocabulary (the last rank's slice ends in padding columns).

    Oracle: ``F.cross_entropy(real, label_smoothing=ε) + z·logsumexp(real)²`` on the real columns,
    ignored targets at 0; padded columns get zero gradient.
    """
    out: dict[str, tuple[float, float]] = {}
    real_v = V - 3
    L, gl = _full((S, B, V), 15), _full((S, B), 16)
    T = torch.randint(0, real_v, (S, B), generator=torch.Generator().manual_seed(17))
    T[0, 0], T[2, 1], T[3, 2] = -100, -1, real_v - 1
    ignored = T < 0
    cases = [("fp64 smoothing 0.1 z 1e-2", L * 3, 0.1, 1e-2, TOL64, TOL64),
             ("fp64 z 0.05", L, 0.0, 0.05, TOL64, TOL64),
             ("fp32 large logits smoothing 0.1 z 1e-4", (L * 4 + 500).float(), 0.1, 1e-4, 1e-6, 1e-6)]
    for name, logits, eps, z, tol_loss, tol_grad in cases:  # tolerances relative to max(1, max |loss| or |grad|)
        ref_in = _leaf(logits.double())
        real = ref_in[..., :real_v]
        ce = F.cross_entropy(real.flatten(0, 1), T.masked_fill(ignored, -100).flatten(), reduction="none",
                             label_smoothing=eps).view(S, B)
        ref = (ce + z * torch.logsumexp(real, -1).square()).masked_fill(ignored, 0.0)
        ref.backward(gl)
        x = _leaf(logits.chunk(t, -1)[r])
        loss = vocab_parallel_cross_entropy(x, T, group, label_smoothing=eps, vocab_size=real_v, z_loss=z)
        loss.backward(gl.to(loss.dtype))
        out[f"{name} loss"] = (_err(loss, ref), tol_loss * max(1.0, ref.abs().max().item()))
        out[f"{name} grad"] = (_err(x.grad, ref_in.grad.chunk(t, -1)[r]), tol_grad * max(1.0, ref_in.grad.abs().max().item()))
        out[f"{name} ignored grad is 0"] = (x.grad[ignored].abs().max().item(), 0)
    return out


def _gpt_loss_options_case(group, t: int, r: int, arch: str) -> dict[str, tuple[float, float]]:
    """GPTModel(label_smoothing, z_loss) under TP + SP (fp64) against the one-rank model from the same seed.

    The loss is Σ masked token losses / valid tokens, as in training; after backward the grads of
    ``sequence_parallel`` parameters are summed over TP (the trainer's finalize step), then every
    parameter's grad is compared with its slice of the one-rank model's (max|Δ| / max|ref|).
    """
    kv = 2 if arch == "llama" and t <= 2 else 4
    cfg = ModelConfig(arch=arch, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=kv,
                      ffn_hidden_size=64 if arch == "neox" else 48, rotary_pct=0.25 if arch == "neox" else 1.0,
                      seq_length=S * 2, vocab_size=50, padded_vocab_size=64, norm_eps=1e-5,
                      tie_embeddings=arch == "llama")
    g = torch.Generator().manual_seed(70)
    tokens = torch.randint(0, 50, (B, S * 2), generator=g)
    labels = torch.randint(0, 50, (B, S * 2), generator=g)
    labels[0, :3] = -100
    mask = (labels >= 0).to(F64)
    options = {"label_smoothing": 0.1, "z_loss": 1e-2}

    def run(model: GPTModel) -> torch.Tensor:
        losses = model(tokens, labels=labels)  # [b, s]
        ((losses * mask).sum() / mask.sum()).backward()
        return losses.detach()

    ref_model = GPTModel(cfg, seed=5, **options).double()
    ref_losses = run(ref_model)
    ref_grads = dict((n, p.grad) for n, p in ref_model.named_parameters())
    parallel = ParallelContext(tp_group=group, sequence_parallel=t > 1)
    assert (parallel.tp_size, parallel.tp_rank) == (t, r)
    model = GPTModel(cfg, seed=5, parallel=parallel, **options).double()
    losses = run(model)
    out = {"loss": (_err(losses, ref_losses), TOL64 * max(1.0, ref_losses.abs().max().item()))}
    for name, p in model.named_parameters():
        grad = comm.all_reduce(p.grad.clone(), group) if p.sequence_parallel else p.grad
        want = shard(ref_grads[name], p.partition_dim, r, t) if p.tensor_model_parallel else ref_grads[name]
        out[f"grad {name}"] = (_err(grad, want) / want.abs().max().item(), TOL64)
    return out


# ---------------------------------------------------------------------------------------------- chain


def _build_mlp(group, sp: bool, recompute: bool, buffer: GatherBuffer | None,
               dtype: torch.dtype = F64) -> tuple[list[nn.Module], list[torch.Tensor]]:
    """Two blocks of column(H→FF) → gelu → row(FF→H); returns the parallel layers and the full weights."""
    layers, fulls = [], []
    for k in range(2):
        col = ColumnParallelLinear(H, FF, bias=True, group=group, sequence_parallel=sp, recompute_allgather=recompute,
                                   gather_buffer=buffer, dtype=dtype)
        row = RowParallelLinear(FF, H, bias=True, group=group, sequence_parallel=sp, dtype=dtype)
        full = [_full((FF, H), 20 + 4 * k), _full((FF,), 21 + 4 * k), _full((H, FF), 22 + 4 * k), _full((H,), 23 + 4 * k)]
        with torch.no_grad():
            col.weight.copy_(col.shard_of(full[0], "weight"))
            col.bias.copy_(col.shard_of(full[1], "bias"))
            row.weight.copy_(row.shard_of(full[2], "weight"))
            row.bias.copy_(row.shard_of(full[3], "bias"))
        layers += [col, row]
        fulls += full
    return layers, fulls


def _mlp_forward(layers: list, x: torch.Tensor) -> torch.Tensor:
    """x → block 1 → + x → block 2 (a residual between the blocks)."""
    h = layers[1](F.gelu(layers[0](x))) + x
    return layers[3](F.gelu(layers[2](h)))


def _ref_mlp(fulls: list[torch.Tensor], X: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    params = [_leaf(p) for p in fulls]
    x = _leaf(X)
    lin = [lambda z, w=params[i], b=params[i + 1]: F.linear(z, w, b) for i in (0, 2, 4, 6)]
    y = _mlp_forward(lin, x)
    y.backward(G)
    return y.detach(), x.grad, [p.grad for p in params]


def _mlp_case(group, t: int, r: int, sp: bool, recompute: bool, reuse: bool) -> dict[str, tuple[float, float]]:
    X, G = _full((S, B, H), 30), _full((S, B, H), 31)
    buffer = GatherBuffer(reuse=reuse)
    layers, fulls = _build_mlp(group, sp, recompute, buffer)
    y_ref, gx_ref, gp_ref = _ref_mlp(fulls, X, G)
    x = _leaf(X.chunk(t, 0)[r] if sp else X)
    y = _mlp_forward(layers, x)
    y.backward(G.chunk(t, 0)[r] if sp else G)
    cut = (lambda z: z.chunk(t, 0)[r]) if sp else (lambda z: z)
    out = {"out": (_err(y, cut(y_ref)), TOL64), "grad x": (_err(x.grad, cut(gx_ref)), TOL64)}
    for k in range(2):
        col, row = layers[2 * k], layers[2 * k + 1]
        gw1, gb1, gw2, gb2 = gp_ref[4 * k: 4 * k + 4]
        out[f"block {k} col grad w"] = (_err(col.weight.grad, col.shard_of(gw1, "weight")), TOL64)
        out[f"block {k} col grad b"] = (_err(col.bias.grad, col.shard_of(gb1, "bias")), TOL64)
        out[f"block {k} row grad w"] = (_err(row.weight.grad, row.shard_of(gw2, "weight")), TOL64)
        row_gb = comm.all_reduce(row.bias.grad.clone(), group) if sp else row.bias.grad
        out[f"block {k} row grad b"] = (_err(row_gb, gb2), TOL64)
    held = buffer.nbytes
    one_gather = S * B * H * 8
    # both column layers gathered into one shared buffer (reuse), or nothing was kept (no reuse / no SP)
    want_held = one_gather if (sp and recompute and reuse and t > 1) else 0
    out["buffer bytes held"] = (abs(held - want_held), 0)
    return out


def _autocast_case(group, t: int, r: int, sp: bool) -> dict[str, tuple[float, float]]:
    """bf16 autocast with fp32 parameters: bf16 activations out, fp32 grads, close to the fp64 reference."""
    X, G = _full((S, B, H), 32), _full((S, B, H), 33)
    layers, fulls = _build_mlp(group, sp, True, None, dtype=torch.float32)
    y_ref, gx_ref, gp_ref = _ref_mlp(fulls, X, G)
    x = _leaf((X.chunk(t, 0)[r] if sp else X).float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _mlp_forward(layers, x)
    y.float().backward((G.chunk(t, 0)[r] if sp else G).float())
    cut = (lambda z: z.chunk(t, 0)[r]) if sp else (lambda z: z)

    def rel(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
        return _err(got, want), 3e-2 * want.abs().max().item()

    out = {"out": rel(y, cut(y_ref)), "grad x": rel(x.grad, cut(gx_ref)),
           "col grad w": rel(layers[0].weight.grad, layers[0].shard_of(gp_ref[0], "weight")),
           "row grad w": rel(layers[3].weight.grad, layers[3].shard_of(gp_ref[6], "weight")),
           "out is bf16": (0.0 if y.dtype == torch.bfloat16 else 1.0, 0),
           "grads are fp32": (0.0 if all(p.grad.dtype == torch.float32 for m in layers for p in m.parameters())
                              else 1.0, 0)}
    return out


# ---------------------------------------------------------------------------------------------- memory, volume


def _saved_bytes(group, t: int, r: int, recompute: bool) -> dict[str, float]:
    """Activation bytes (unique storages, parameters excluded) the SP column-parallel linear saves."""
    X, G = _full((S, B, H), 40), _full((S, B, FF), 41)
    buffer = GatherBuffer()
    layer = ColumnParallelLinear(H, FF, bias=True, group=group, sequence_parallel=True, recompute_allgather=recompute,
                                 gather_buffer=buffer, dtype=F64)
    with torch.no_grad():
        layer.weight.copy_(layer.shard_of(_full((FF, H), 42), "weight"))
        layer.bias.zero_()
    param_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = _leaf(X.chunk(t, 0)[r])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = layer(x)
    buffer_ptrs = {b.untyped_storage().data_ptr() for b in buffer._buffers.values()}
    y.backward(G.chunk(t, -1)[r])
    ref = _ref_linear(_full((FF, H), 42), None, X, G)
    return {"saved": float(sum(saved.values())), "gathered": float(S * B * H * 8), "shard": float(x.nbytes),
            "buffer saved": float(bool(buffer_ptrs & saved.keys())),
            "grad x err": _err(x.grad, ref["x"].chunk(t, 0)[r])}


def _pair_volume(group, t: int, r: int, sp: bool, recompute: bool) -> dict[str, dict]:
    """CommCounter summaries of one column(H→FF) + row(FF→H) pair: forward and backward."""
    X, G = _full((S, B, H), 50), _full((S, B, H), 51)
    layers, _ = _build_mlp(group, sp, recompute, GatherBuffer())
    x = _leaf(X.chunk(t, 0)[r] if sp else X)
    with comm.count() as fwd:
        y = layers[1](F.gelu(layers[0](x)))
    with comm.count() as bwd:
        y.backward(G.chunk(t, 0)[r] if sp else G)
    return {"fwd": fwd.summary(), "bwd": bwd.summary(), "fwd_total": fwd.total_bytes, "bwd_total": bwd.total_bytes}


def _facts(group, t: int) -> dict[str, bool]:
    col = ColumnParallelLinear(H, FF, bias=True, group=group)
    row_sp = RowParallelLinear(FF, H, bias=True, group=group, sequence_parallel=True)
    row = RowParallelLinear(FF, H, bias=True, group=group)
    emb = VocabParallelEmbedding(V, H, group=group)
    tied = ColumnParallelLinear(H, V, bias=False, group=group, skip_weight=True)

    def attrs(p: torch.Tensor) -> tuple:
        return p.tensor_model_parallel, p.partition_dim, p.sequence_parallel, p.shared_embedding

    facts = {
        "column weight attrs": attrs(col.weight) == (True, 0, False, False) and col.weight.shape == (FF // t, H),
        "column bias attrs": attrs(col.bias) == (True, 0, False, False) and col.bias.shape == (FF // t,),
        "row weight attrs": attrs(row.weight) == (True, 1, False, False) and row.weight.shape == (H, FF // t),
        "row bias attrs (no SP)": attrs(row.bias) == (False, -1, False, False) and row.bias.shape == (H,),
        "row bias attrs (SP)": attrs(row_sp.bias) == (False, -1, True, False),
        "embedding weight attrs": attrs(emb.weight) == (True, 0, False, False) and emb.weight.shape == (V // t, H),
        "skip_weight creates no weight": tied.weight is None and [n for n, _ in tied.named_parameters()] == [],
        "tied layer takes the embedding's shard": tied.shard_of(torch.zeros(V, H), "weight").shape == emb.weight.shape,
        "shard() matches shard_of": torch.equal(shard(_full((FF, H), 60), 0, comm.group_rank(group), t),
                                                col.shard_of(_full((FF, H), 60), "weight")),
    }
    try:
        tied(torch.zeros(S, B, H))
        facts["skip_weight without a weight raises"] = False
    except ValueError:
        facts["skip_weight without a weight raises"] = True
    if t > 1:
        try:
            VocabParallelEmbedding(V + 1, H, group=group)
            facts["unpadded vocab raises"] = False
        except ValueError as e:
            facts["unpadded vocab raises"] = "padded" in str(e)
        try:
            col.shard_of(torch.zeros(FF + t, H), "weight")
            facts["wrong full shape raises"] = False
        except ValueError:
            facts["wrong full shape raises"] = True
    return facts


# ---------------------------------------------------------------------------------------------- worker


def _layer_checks(group, t: int, r: int) -> dict[str, tuple[float, float]]:
    errs: dict[str, tuple[float, float]] = {}

    def add(prefix: str, found: dict[str, tuple[float, float]]) -> None:
        errs.update({f"{prefix}: {k}": v for k, v in found.items()})

    for sp in (False, True):
        for gather_output in (False, True):
            for recompute in ((True, False) if sp else (True,)):
                add(f"column sp={sp} gather_output={gather_output} recompute={recompute}",
                    _column_case(group, t, r, sp, gather_output, recompute, bias=True, external=False))
        add(f"column sp={sp} no bias", _column_case(group, t, r, sp, False, True, bias=False, external=False))
        add(f"column sp={sp} external (tied) weight",
            _column_case(group, t, r, sp, False, True, bias=False, external=True))
        for input_is_parallel in (True, False):
            add(f"row sp={sp} input_is_parallel={input_is_parallel}",
                _row_case(group, t, r, sp, input_is_parallel, bias=True))
        add(f"row sp={sp} no bias", _row_case(group, t, r, sp, True, bias=False))
        add(f"embedding sp={sp}", _embedding_case(group, t, r, sp))
    add("cross entropy", _ce_cases(group, t, r))
    add("ce options", _ce_option_cases(group, t, r))
    return errs


def _worker(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    group, t, r = dist.group.WORLD, world, rank
    singles = [dist.new_group([j]) for j in range(world)]
    errs = _layer_checks(group, t, r)
    errs.update({f"size-1 group: {k}": v for k, v in _layer_checks(singles[rank], 1, 0).items()})
    for sp, recompute, reuse in ((False, True, True), (True, True, True), (True, True, False), (True, False, True)):
        errs.update({f"mlp sp={sp} recompute={recompute} reuse={reuse}: {k}": v
                     for k, v in _mlp_case(group, t, r, sp, recompute, reuse).items()})
    for sp in (False, True):
        errs.update({f"autocast bf16 sp={sp}: {k}": v for k, v in _autocast_case(group, t, r, sp).items()})
    for arch in ("neox", "llama"):
        errs.update({f"gpt loss options {arch}: {k}": v for k, v in _gpt_loss_options_case(group, t, r, arch).items()})
    return {"errs": errs, "facts": _facts(group, t),
            "saved": {rc: _saved_bytes(group, t, r, rc) for rc in (True, False)},
            "volume": {name: _pair_volume(group, t, r, sp, rc)
                       for name, sp, rc in (("tp", False, True), ("sp", True, True), ("sp_no_recompute", True, False))}}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, object]]]:
    return request.param, run_distributed(_worker, request.param)


def _check_errs(world: int, per_rank: list, prefix: str) -> None:
    checked = 0
    for rank, res in enumerate(per_rank):
        for key, (err, tol) in res["errs"].items():
            if key.startswith((prefix, f"size-1 group: {prefix}")):
                checked += 1
                assert err <= tol, f"world {world} rank {rank} {key}: error {err:.3e} > tolerance {tol:.1e}"
    assert checked > 0, prefix


def test_column_parallel_linear(results):
    _check_errs(*results, "column")


def test_row_parallel_linear(results):
    _check_errs(*results, "row")


def test_vocab_parallel_embedding(results):
    _check_errs(*results, "embedding")


def test_vocab_parallel_cross_entropy(results):
    """fp64 with and without label smoothing (full vocab), ignored targets, bf16 and large fp32 logits."""
    _check_errs(*results, "cross entropy")


def test_vocab_parallel_cross_entropy_smoothing_and_z_loss(results):
    """Label smoothing over the full real vocabulary + PaLM's z-loss, padded vocabulary, fp64 and fp32."""
    _check_errs(*results, "ce options")


def test_gpt_loss_options_under_tp_sp(results):
    """GPTModel with train.label_smoothing and train.z_loss: tp + SP equals one rank (loss and every grad)."""
    _check_errs(*results, "gpt loss options")


def test_mlp_chain_shared_gather_buffer(results):
    """Two column+row blocks sharing one GatherBuffer; SP on/off, recompute on/off, reuse on/off."""
    _check_errs(*results, "mlp")


def test_autocast_bf16(results):
    _check_errs(*results, "autocast")


def test_parameter_attributes_and_errors(results):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        failed = [k for k, ok in res["facts"].items() if not ok]
        assert not failed, f"world {world} rank {rank}: {failed}"


def test_sp_column_saves_only_the_local_shard(results):
    """recompute_allgather: 1/t of the gathered input is saved; without it, the whole gathered input."""
    world, per_rank = results
    for res in per_rank:
        on, off = res["saved"][True], res["saved"][False]
        assert on["gathered"] == world * on["shard"]
        assert on["saved"] == on["gathered"] / world, on
        assert off["saved"] == off["gathered"], off
        assert on["buffer saved"] == 0.0
        assert on["grad x err"] <= TOL64 and off["grad x err"] <= TOL64


def test_sp_communication_volume_equals_tp(results):
    """One column+row pair: forward bytes equal plain TP's; backward too without the recomputed all-gather.

    unit = (t−1)/t · s·b·h·8 bytes. TP: an all-reduce (2 units) forward and backward. SP: all-gather +
    reduce-scatter (1 + 1) forward; backward all-gather (row) + reduce-scatter (column), plus one
    all-gather when the column layer recomputes its gathered input (the price of saving 1/t memory).
    """
    world, per_rank = results
    unit = (world - 1) / world * S * B * H * 8

    def approx(v: float) -> object:
        return pytest.approx(v, rel=1e-12)

    for res in per_rank:
        vol = res["volume"]
        tp, sp, sp_nr = vol["tp"], vol["sp"], vol["sp_no_recompute"]
        assert tp["fwd"] == {"all_reduce": {"calls": 1, "bytes": approx(2 * unit)}}
        assert tp["bwd"] == {"all_reduce": {"calls": 1, "bytes": approx(2 * unit)}}
        assert sp["fwd"] == {"all_gather": {"calls": 1, "bytes": approx(unit)},
                             "reduce_scatter": {"calls": 1, "bytes": approx(unit)}}
        assert sp_nr["bwd"] == {"all_gather": {"calls": 1, "bytes": approx(unit)},
                                "reduce_scatter": {"calls": 1, "bytes": approx(unit)}}
        assert sp["bwd"] == {"all_gather": {"calls": 2, "bytes": approx(2 * unit)},
                             "reduce_scatter": {"calls": 1, "bytes": approx(unit)}}
        assert sp["fwd_total"] == approx(tp["fwd_total"])
        assert sp_nr["fwd_total"] + sp_nr["bwd_total"] == approx(tp["fwd_total"] + tp["bwd_total"])
        assert sp["fwd_total"] + sp["bwd_total"] == approx(tp["fwd_total"] + tp["bwd_total"] + unit)
