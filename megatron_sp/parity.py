"""Full (unsharded) gradients by name from any layout, and the comparison of two runs under the parity
standard (loss, step-1 grad norm, ``logging.dump_grads_step`` dumps). See docs/parity.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .mpu import ParallelState
from .mpu.sharding import gather_full
from .optim import DistributedOptimizer, named_trainable


def full_main_grads(model: nn.Module, optimizer: DistributedOptimizer,
                    state: ParallelState | None) -> dict[str, torch.Tensor]:
    """{name: full reduced fp32 gradient} from the optimizer's main grads (collective: dp_cp, TP, PP)."""
    grads = optimizer.main_grads_by_name()
    named = named_trainable(model)
    name_of = {id(p): n for n, p in named}
    return gather_full(named, state, lambda p: grads[name_of[id(p)]])


def grad_diffs(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """max|got − ref| / max|ref| per parameter name (inf when a name or shape is missing)."""
    diffs = {}
    for name, r in ref.items():
        g = got.get(name)
        if g is None or g.shape != r.shape:
            diffs[name] = float("inf")
            continue
        scale = r.abs().max().item()
        diffs[name] = (g - r).abs().max().item() / (scale if scale > 0 else 1.0)
    for name in got.keys() - ref.keys():
        diffs[name] = float("inf")
    return diffs


def load_grads(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a gradient dump written by ``logging.dump_grads_step``."""
    return torch.load(path, map_location="cpu", weights_only=True)


@dataclass
class ParityReport:
    """How a run compares with the reference run under the parity standard (docs/parity.md)."""

    steps: list[int]
    worst_loss_rel: float
    grad_norm_rel: float
    worst_grad: tuple[str, float]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        head = (f"loss worst rel {self.worst_loss_rel:.1e} over steps {self.steps}, step-1 grad norm rel "
                f"{self.grad_norm_rel:.1e}, worst gradient {self.worst_grad[0]} {self.worst_grad[1]:.1e}")
        return head + ("" if self.ok else "; " + "; ".join(self.problems))


def _losses(log_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]): r for r in rows if "loss" in r}


def compare_runs(ref_dir: str | Path, got_dir: str | Path, loss_rtol: float = 5e-6, grad_norm_rtol: float = 1e-6,
                 grad_tol: float = 1e-5) -> ParityReport:
    """Compare two runs' ``logging.dir``s: per-step loss, step-1 grad norm, every full gradient at step 1
    (both runs with ``logging.interval=1`` and ``logging.dump_grads_step=1``)."""
    ref_dir, got_dir = Path(ref_dir), Path(got_dir)
    ref, got = _losses(ref_dir), _losses(got_dir)
    problems = []
    steps = sorted(ref)
    if sorted(got) != steps or not steps:
        problems.append(f"logged steps differ: ref {sorted(ref)}, got {sorted(got)}")
        steps = sorted(set(ref) & set(got))
    keys = ["loss", *sorted(k for k in ref[steps[0]] if k.startswith("mtp_loss_"))] if steps else ["loss"]
    worst_loss = max((abs(got[s].get(k, math.inf) - ref[s][k]) / abs(ref[s][k]) for s in steps for k in keys),
                     default=math.inf)  # the LM loss and each multi-token prediction loss
    if worst_loss > loss_rtol:
        problems.append(f"loss differs by {worst_loss:.1e} relative (tolerance {loss_rtol:.0e})")
    s1 = steps[0] if steps else 1
    gn_ref, gn_got = ref.get(s1, {}).get("grad_norm"), got.get(s1, {}).get("grad_norm")
    gn_rel = abs(gn_got - gn_ref) / abs(gn_ref) if gn_ref and gn_got is not None else math.inf
    if gn_rel > grad_norm_rtol:
        problems.append(f"step-1 grad norm differs by {gn_rel:.1e} relative (tolerance {grad_norm_rtol:.0e})")
    diffs = grad_diffs(load_grads(got_dir / "grads_step1.pt"), load_grads(ref_dir / "grads_step1.pt"))
    worst_name = max(diffs, key=diffs.get) if diffs else "(none)"
    worst = (worst_name, diffs.get(worst_name, math.inf))
    bad = sorted((n for n, d in diffs.items() if d > grad_tol), key=lambda n: -diffs[n])
    if bad:
        problems.append(f"{len(bad)} gradients differ beyond {grad_tol:.0e}: " +
                        ", ".join(f"{n} {diffs[n]:.1e}" for n in bad[:5]))
    return ParityReport(steps, worst_loss, gn_rel, worst, problems)
