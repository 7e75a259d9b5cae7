"""Static rules that keep communication observable (issue 16).

1. No module of ``megatron_sp/`` or ``tools/`` but ``megatron_sp/mpu/comm.py`` uses a
   ``torch.distributed`` name outside an allow-list of queries and types; group creation and
   teardown only where the process groups are made. Every collective, point-to-point transfer and
   barrier therefore goes through ``mpu.comm``, where ``comm.count()`` and ``comm.observe()`` see it.
2. No monkey-patching: no assignment to (or ``setattr`` on) an attribute of an imported module,
   e.g. ``training.forward_backward = ...`` or ``schedules._P2P.send = ...``. Measure through the
   supported hooks (``comm.observe``, ``pipeline.executor.observe``,
   ``SelfAttention.register_kernel_hook``) instead.

Each failure names ``file:line``.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("megatron_sp", "tools")
COMM = Path("megatron_sp/mpu/comm.py")

QUERIES = {"is_available", "is_initialized", "get_rank", "get_world_size", "get_backend", "get_process_group_ranks",
           "group", "GroupMember", "ReduceOp", "ProcessGroup", "Work", "Backend"}
"""``torch.distributed`` names that communicate nothing: allowed everywhere."""
GROUP_MAKING = {
    "new_group": {"megatron_sp/mpu/parallel_state.py"},
    "init_process_group": {"megatron_sp/mpu/parallel_state.py", "megatron_sp/testing.py"},
    "destroy_process_group": {"megatron_sp/mpu/parallel_state.py", "megatron_sp/testing.py", "megatron_sp/training.py",
                              "tools/inference_setup.py"},
    "TCPStore": {"megatron_sp/mpu/parallel_state.py"},
    "PrefixStore": {"megatron_sp/mpu/parallel_state.py"},
    "distributed_c10d": {"megatron_sp/faults.py"},  # the default store's key-value reads (peer diagnosis)
    "run": {"megatron_sp/launcher.py"},  # starting local ranks (torchrun's launcher)
}
"""Group creation, teardown, the default store and the local launcher: allowed in the files that own them."""
LAUNCHING = ("torch.distributed.elastic", "torch.distributed.launcher")
"""torchrun's launcher packages (process start-up, its errors, ``elastic_launch``): no communication."""


def _sources() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)


def _module_names(tree: ast.Module, rel: str) -> tuple[set[str], set[str]]:
    """(names bound to ``torch.distributed``, names bound to any module) by the file's imports."""
    dist_names: set[str] = set()
    modules: set[str] = set()
    package = ".".join(Path(rel).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    modules.add(alias.asname)
                    if alias.name == "torch.distributed":
                        dist_names.add(alias.asname)
                else:
                    modules.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1] if package else []
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for alias in node.names:
                bound = alias.asname or alias.name
                if base == "torch" and alias.name == "distributed":
                    dist_names.add(bound)
                try:
                    is_module = importlib.util.find_spec(f"{base}.{alias.name}") is not None
                except (ImportError, ValueError, AttributeError):
                    is_module = False
                if is_module:
                    modules.add(bound)
    return dist_names, modules


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _dist_attr(node: ast.Attribute, dist_names: set[str]) -> bool:
    """``dist.X`` or ``torch.distributed.X``."""
    v = node.value
    if isinstance(v, ast.Name) and v.id in dist_names:
        return True
    return isinstance(v, ast.Attribute) and v.attr == "distributed" and isinstance(v.value, ast.Name) \
        and v.value.id == "torch"


def _violations(path: Path, rel: str | None = None) -> list[str]:
    """The rule breaks in ``path`` (``rel``: the repository path it stands for; default its own)."""
    rel = rel or path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(), filename=rel)
    dist_names, modules = _module_names(tree, rel)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch.distributed") \
                and not node.module.startswith(LAUNCHING):
            for alias in node.names:
                if alias.name not in QUERIES and rel not in GROUP_MAKING.get(alias.name, ()):
                    found.append(f"{rel}:{node.lineno}: from {node.module} import {alias.name} (go through mpu.comm)")
        if isinstance(node, ast.Attribute) and _dist_attr(node, dist_names) and Path(rel) != COMM:
            if node.attr not in QUERIES and rel not in GROUP_MAKING.get(node.attr, ()):
                found.append(f"{rel}:{node.lineno}: torch.distributed.{node.attr} outside mpu/comm.py "
                             "(add or use a comm function)")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and _root_name(t) in modules:
                    found.append(f"{rel}:{node.lineno}: assignment to {ast.unparse(t)} (monkey-patching a module)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and _root_name(node.args[0]) in modules:
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (monkey-patching a module)")
    return found


def test_every_collective_goes_through_comm_and_nothing_is_patched() -> None:
    sources = _sources()
    assert any(p.relative_to(ROOT) == COMM for p in sources)
    found = [v for p in sources for v in _violations(p)]
    assert not found, "\n".join(found)


def test_the_rules_catch_what_they_are_for(tmp_path: Path) -> None:
    """The checker itself: each kind of violation in a scratch file is reported with its line."""
    bad = tmp_path / "probe.py"
    bad.write_text("import torch.distributed as dist\nfrom megatron_sp import training\nfrom megatron_sp.mpu import comm\n"
                   "dist.all_reduce(x)\ntraining.forward_backward = None\nsetattr(comm, 'all_reduce', None)\n"
                   "dist.get_rank()\n")
    found = _violations(bad, "tools/probe.py")
    assert sorted(v.split(":")[1] for v in found) == ["4", "5", "6"], found
