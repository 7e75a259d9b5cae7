"""The config is pure data: it imports no other part of megatron_sp, and each part registers its own checks."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sp import config
from megatron_sp.errors import ConfigError

CONFIG_DIR = Path(config.__file__).parent


def _megatron_imports(path: Path) -> list[str]:
    """The megatron_sp modules ``path`` imports, as absolute names (relative imports resolved)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "megatron_sp"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["megatron_sp", "config"][:max(0, 3 - node.level)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "megatron_sp":
                names += [f"{module}.{a.name}" if module in ("megatron_sp", "megatron_sp.config") else module
                          for a in node.names]
    return names


def test_config_imports_only_itself_and_errors():
    files = sorted(CONFIG_DIR.glob("*.py"))
    assert len(files) >= 4
    for path in files:
        for name in _megatron_imports(path):
            assert name.startswith(("megatron_sp.config.", "megatron_sp.errors")), f"{path.name} imports {name}"


def test_deepy_path_is_torch_free_and_finalize_runs_every_part(repo_root):
    code = """if True:
        import json, sys
        from megatron_sp import config, launcher
        raw = config.load(["configs/demo.yml"], finalize_config=False)
        layout = launcher.config_layout(["--conf", "configs/demo.yml", "parallel.tp=2"])
        torch_free = "torch" not in sys.modules
        cfg = config.finalize(raw)
        print(json.dumps({"torch_free": torch_free, "mp": layout.model_parallel, "device": cfg.parallel.device,
                          "checks": config.registry.registered()}))
    """
    p = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["torch_free"] and out["mp"] == 2 and out["device"] in ("cpu", "cuda")
    owners = {name.rsplit(".", 1)[0] for name in out["checks"]}
    assert owners == {"megatron_sp.pipeline.partition", "megatron_sp.mpu.cp_layout", "megatron_sp.device",
                      "megatron_sp.optim.reducer", "megatron_sp.data.blending", "megatron_sp.data.gpt_dataset",
                      "megatron_sp.model.moe", "megatron_sp.optim.muon"}


@pytest.mark.parametrize("override, needle", [
    ("parallel.pp_schedule=1fb1", "did you mean '1f1b'"),
    ("parallel.cp_algo=zigzig", "did you mean 'zigzag'"),
    ("parallel.backend=nccl", "parallel.backend=nccl needs parallel.device=cuda"),
    ("data.split=9,x", "data.split"),
    ("data.paths=[1, a, b]", "data.paths"),
    ("train.precision=fp8", "train.precision: 'fp8' is not one of fp32, bf16, fp16"),
    ("parallel.zero=4", "parallel.zero: 4 must be 0, 1, 2 or 3"),
])
def test_each_part_checks_its_keys_once(override, needle):
    with pytest.raises(ConfigError) as exc:
        config.load(overrides=["data.paths=[d/x]", "tokenizer.type=byte", "parallel.device=cpu", override])
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_train_compile_defaults_off_on_cpu_and_needs_a_compiler(monkeypatch):
    base = ["data.paths=[d/x]", "tokenizer.type=byte", "parallel.device=cpu"]
    assert config.load(overrides=base).train.compile is False
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError) as exc:
        config.load(overrides=[*base, "train.compile=true"])
    assert "train.compile=true on CPU needs a C++ compiler" in str(exc.value) and "\n" not in str(exc.value)
