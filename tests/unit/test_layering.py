"""The package's layering (README "Code layout", DESIGN.md): imports only point down, no module of ``megatron_sp``
imports itself through others, and the planner uses only public names of the code it measures. Read from the
source (``ast``), in this process: every import that runs counts, inside functions too; ``if TYPE_CHECKING:``
blocks do not (they never run). Each failure names the file and the import."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import megatron_sp

PACKAGE = Path(megatron_sp.__file__).parent
PLANNER = (PACKAGE.parent / "tools" / "planner", PACKAGE.parent / "tools" / "plan.py")

LAYERS = (
    ("training", "launcher"),
    ("checkpointing", "pipeline", "parity", "multinode", "testing"),
    ("optim",),
    ("model",),
    ("data", "metrics", "faults"),
    ("mpu",),
    ("device",),
    ("config",),
    ("errors", "files"),
)
"""The parts of ``megatron_sp`` (top-level modules and packages), top to bottom: a part imports only parts of the
rows below its own (so the data never imports the model, nor the model the data). ``megatron_sp/__init__.py``
imports every part's config checks and stands above them all."""

UPWARD: set[tuple[str, str]] = set()
"""Known imports against the layers (none today; an entry names the module and what it imports)."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["megatron_sp", *path.relative_to(PACKAGE).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:``."""
    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            stack += node.orelse
            continue
        nodes.append(node)
        stack += ast.iter_child_nodes(node)
    return nodes


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Each module's runtime imports of other ``megatron_sp`` modules (a name imported from a package: the package,
    unless the name is a submodule)."""
    modules = _modules()

    def known(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names if a.name.split(".")[0] == "megatron_sp"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
                if base.split(".")[0] == "megatron_sp":
                    deps |= {known(f"{base}.{a.name}") for a in node.names}
        graph[name] = deps - {name}
    return graph


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_point_down_and_no_module_imports_itself() -> None:
    graph = import_graph()
    level = {part: i for i, row in enumerate(LAYERS) for part in row}
    parts = {_part(m) for m in graph} - {""}
    assert parts == set(level), f"give every part a row of LAYERS: {sorted(parts ^ set(level))}"
    upward = sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps
                    if _part(m) and _part(d) != _part(m) and level[_part(d)] <= level[_part(m)]
                    and (m, d) not in UPWARD)
    assert not upward, "imports against the layers:\n" + "\n".join(upward)
    assert all(d in graph[m] for m, d in UPWARD), "a known upward import is gone: drop it from UPWARD"
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"


def test_the_checker_sees_lazy_relative_and_cyclic_imports() -> None:
    graph = import_graph()
    assert "megatron_sp.mpu.cp_layout" in graph["megatron_sp.data.batching"]  # inside a function
    assert "megatron_sp.mpu.comm" in graph["megatron_sp.mpu.layers"]  # ``from . import comm``
    assert "megatron_sp.model.transformer" not in graph["megatron_sp.model.moe"]  # only under TYPE_CHECKING
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def private_uses(path: Path) -> list[str]:
    """``megatron_sp`` names starting with ``_`` that ``path`` imports (``from megatron_sp.x import _y``) or reads off
    a module it imported from ``megatron_sp`` (``training._y``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "megatron_sp":
            modules |= {a.asname or a.name for a in node.names}
            found += [f"{path.name}:{node.lineno}: {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.asname and a.name.split(".")[0] == "megatron_sp"}
    found += [f"{path.name}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
              and node.attr.startswith("_") and not node.attr.startswith("__")]
    return found


def test_the_planner_uses_public_names(tmp_path: Path) -> None:
    """The planner measures the real training code (``training.setup``, ``training.autocast``, ``gpt.parameter_parts``):
    through its public names, which the code keeps, not private ones that may change under it."""
    files = [f for p in PLANNER for f in ([p] if p.is_file() else sorted(p.glob("*.py")))]
    assert len(files) > 3
    assert not [u for f in files for u in private_uses(f)]
    probe = tmp_path / "probe.py"
    probe.write_text("from megatron_sp import training\nfrom megatron_sp.model.gpt import _x\ntraining._autocast(1)\n")
    assert private_uses(probe) == ["probe.py:2: _x", "probe.py:3: training._autocast"]
