"""Decoding: KV-cache logits equal full-context logits, ``generate_batch`` greedy/sampling, HF parity and the generate CLI."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_sp import checkpointing, config
from megatron_sp.config.schema import ModelConfig
from megatron_sp.data.tokenizer import build_tokenizer
from megatron_sp.model.gpt import GPTModel
from megatron_sp.model.hf_names import build_hf_model
from megatron_sp.model.inference import KVCache, Sampling, generate_batch, sample_next
from megatron_sp.optim import DistributedOptimizer, named_trainable
from test_model import PADDED, VOCAB
from test_model import make_cfg as model_cfg

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "generate.py"


def make_cfg(arch: str, **overrides: object) -> ModelConfig:
    """``test_model.make_cfg`` (neox: 4 rotary dims of 16; llama: GQA 4 heads over 2) with a wider init,
    so the logits are far from ties."""
    return model_cfg(arch, **{"init_std": 0.2, **overrides})


def make_model(arch: str, **overrides: object) -> GPTModel:
    model = GPTModel(make_cfg(arch, **overrides), seed=5).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    return model


PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


GREEDY = Sampling()


def new_ids(model: GPTModel, prompts: list[list[int]], n: int, eod: int | None = None,
            sampling: Sampling = GREEDY, **kw: object) -> list[list[int]]:
    """``generate_batch``'s new tokens of each prompt."""
    return [c.new_ids for c in generate_batch(model, prompts, n, eod, sampling, **kw)]  # type: ignore[arg-type]


# --------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("arch", ["neox", "llama"])
@pytest.mark.parametrize("blocks", [[8, 1, 1, 1, 1, 1, 1, 1, 1], [5, 3, 1, 4, 1, 2]])
def test_cached_logits_equal_full_context(arch: str, blocks: list[int]) -> None:
    model = make_model(arch)
    total = sum(blocks)
    tokens = torch.randint(0, VOCAB, (2, total), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)  # [2, total, V]
        cache = KVCache(model.cfg.seq_length)
        start = 0
        for n in blocks:  # prefill, then single tokens and multi-token blocks (explicit mask)
            step = model(tokens[:, start:start + n], kv_cache=cache)
            torch.testing.assert_close(step, full[:, start:start + n], atol=1e-5, rtol=0)
            start += n
    assert cache.length == total


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_cached_logits_equal_full_context_fp64(arch: str) -> None:
    """The whole seq_length, token by token after a prefill: in fp64 the only difference is rounding."""
    model = make_model(arch).double()
    tokens = torch.randint(0, VOCAB, (2, model.cfg.seq_length), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.cfg.seq_length)
        steps = [model(tokens[:, :4], kv_cache=cache)]
        steps += [model(tokens[:, i:i + 1], kv_cache=cache) for i in range(4, tokens.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=0)


def test_kv_cache_refuses_training_and_overflow() -> None:
    model = make_model("llama")
    cache = KVCache(4)
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        model(torch.tensor([[1, 2]]), kv_cache=cache)
    model.eval()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), kv_cache=cache)
        with pytest.raises(ValueError, match="KV cache full"):
            model(torch.tensor([[4, 5]]), kv_cache=cache)


def test_logit_rows_are_rows_of_the_full_logits() -> None:
    model = make_model("llama")
    tokens = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(4))
    rows = torch.tensor([11, 0, 5])
    with torch.no_grad():
        full, some = model(tokens), model(tokens, logit_rows=rows)
    torch.testing.assert_close(some[:, 0], full[torch.arange(3), rows], atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_greedy_with_cache_equals_without(arch: str) -> None:
    """Left-padded prompts that stop at the context (seq_length 32) or at the token limit; the prefill computes
    the logits of each prompt's last token only (the model returns ``[b, 1, V]``), cached or not."""
    model = make_model(arch)
    prompts = [PROMPT, [7] * 30, PROMPT[:3]]
    shapes: list[tuple[int, ...]] = []
    hook = model.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    cached = generate_batch(model, prompts, 30, None)
    assert [c.new_ids for c in cached] == new_ids(model, prompts, 30, use_cache=False)
    hook.remove()
    assert {s[1] for s in shapes} == {1} and shapes[0] == (3, 1, PADDED)
    assert [(len(c.new_ids), c.stop) for c in cached] == [(25, "context"), (3, "context"), (30, "max_new_tokens")]
    new = new_ids(model, [PROMPT], 10)[0]
    stop = new.index(new[-1])  # where the last token first appears
    (c,) = generate_batch(model, [PROMPT], 10, new[stop])
    assert (c.new_ids, c.stop) == (new[:stop], "eod")  # stops at eod, not appended


def test_generate_batch_restores_mode() -> None:
    model = make_model("neox")
    model.train()
    (out,) = new_ids(model, [PROMPT], 4)
    assert model.training and len(out) == 4 and all(0 <= t < VOCAB for t in out)


# --------------------------------------------------------------------------- HF transformers


def build_hf(cfg: ModelConfig, model: GPTModel) -> torch.nn.Module:
    pytest.importorskip("transformers")
    return build_hf_model(cfg, model.state_dict())


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_greedy_matches_hf_generate(arch: str) -> None:
    model = make_model(arch)
    hf = build_hf(model.cfg, model)
    n = 24  # prompt 8 + 24 = seq_length: no cropping on either side
    ours = PROMPT + new_ids(model, [PROMPT], n)[0]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                             pad_token_id=0, suppress_tokens=list(range(VOCAB, PADDED)))
    assert theirs[0].tolist() == ours
    assert len(set(ours[len(PROMPT):])) >= 8  # a varied continuation, not one repeated token


# --------------------------------------------------------------------------- sampling


def test_sampling_is_seeded_and_top_k_1_is_greedy() -> None:
    model = make_model("llama")
    (greedy,) = new_ids(model, [PROMPT], 16)

    def sample(seed: int, use_cache: bool = True, **kw: object) -> list[int]:
        return new_ids(model, [PROMPT], 16, sampling=Sampling(greedy=False, seed=seed, **kw), use_cache=use_cache)[0]

    a, b = sample(1, temperature=1.5), sample(1, temperature=1.5)
    assert a == b and a != greedy and a != sample(2, temperature=1.5)
    assert sample(1, temperature=1.5, use_cache=False) == a
    assert sample(3, temperature=2.0, top_k=1) == greedy
    assert sample(4, top_p=1e-6) == greedy  # the nucleus always keeps the most likely token
    assert all(0 <= t < VOCAB for t in sample(5, temperature=50.0))  # padded rows never chosen


def test_sample_next_filters() -> None:
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0, -5.0])
    gen = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, False, 1.0, 2, 1.0, gen) for _ in range(200)}
    assert draws == {1, 2}
    probs = torch.softmax(logits, -1)  # [.04, .67, .24, .09, 0]: top_p .8 keeps ids 1 and 2
    assert probs[1] < 0.8 < probs[1] + probs[2]
    assert {sample_next(logits, False, 1.0, 0, 0.8, gen) for _ in range(200)} == {1, 2}
    with pytest.raises(ValueError, match="temperature"):
        generate_batch(make_model("neox"), [PROMPT], 1, None, Sampling(greedy=False, temperature=0.0))
    for temperature, top_p in ((1e-39, 1.0), (5e-324, 1.0), (1.0, 1e-300), (1e-39, 1e-300)):
        assert sample_next(logits, False, temperature, 0, top_p, gen) == 1  # the top id, never a NaN draw


# --------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama checkpoint written by ``checkpointing.save`` (byte tokenizer) without data paths, as an imported
    one (convert_checkpoint.py --from hf): generation needs none."""
    root = tmp_path_factory.mktemp("gen") / "ckpt"
    cfg = config.load(overrides=CKPT_CONFIG + [f"checkpoint.save={root}"])
    config.set_vocab(cfg, build_tokenizer(cfg.tokenizer).vocab_size)
    cfg.data.paths = []
    model = GPTModel(cfg.model, seed=3)
    optimizer = DistributedOptimizer(named_trainable(model), cfg.train, None)
    checkpointing.save(cfg, 2, 8, model, optimizer, None, torch.device("cpu"))
    return root


CKPT_CONFIG = ["data.paths=[x]", "tokenizer.type=byte", "model.arch=llama", "model.num_layers=2", "model.hidden_size=32",
               "model.num_heads=2", "model.seq_length=48", "model.init_std=0.2"]


def saved_model() -> GPTModel:
    """The fixture's model, rebuilt in this process (the same seed: the same weights)."""
    cfg = config.load(overrides=CKPT_CONFIG)
    config.set_vocab(cfg, build_tokenizer(cfg.tokenizer).vocab_size)
    return GPTModel(cfg.model, seed=3)


def run_tool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, input=stdin,
                          timeout=300, cwd=ROOT)


def json_lines(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_cli_json_greedy_matches_library(checkpoint_dir: Path) -> None:
    (result,) = json_lines(run_tool("--load", str(checkpoint_dir), "--prompt", "def f(x):", "--max-new-tokens", "12",
                                    "--greedy", "--json"))
    assert set(result) == {"index", "prompt", "prompt_ids", "new_ids", "text", "stop"}
    tokenizer = build_tokenizer(config.load(overrides=CKPT_CONFIG).tokenizer)
    ids = tokenizer.encode("def f(x):")
    (expected,) = new_ids(saved_model(), [ids], 12, tokenizer.eod)
    assert result["prompt_ids"] == ids and result["new_ids"] == expected and result["stop"] == "max_new_tokens"
    assert result["text"] == tokenizer.decode(expected) and len(expected) > 0


def _tool_rank(rank: int, world_size: int, argv: list[str], stdin: bytes) -> tuple[int, str, str]:
    """One rank of ``tool_ranks``: tools/generate.py's ``main(argv)`` (stdin holding ``stdin``); (exit code, stdout,
    stderr)."""
    import contextlib
    import io

    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = load_tool("generate").main(argv)  # type: ignore[attr-defined]
    return code, out.getvalue(), err.getvalue()


def tool_ranks(world: int, *args: str, stdin: str = "") -> list[dict]:
    """tools/generate.py ``args`` run as torchrun starts it on each of ``world`` ranks (``run_distributed`` sets the
    torchrun environment; no launching process, so no pre-flight): rank 0's JSON lines. Run plainly, the command line
    starts these ranks itself: the README's ``tools/generate.py ... parallel.tp=2`` (tests/e2e/test_readme_commands.py)."""
    from megatron_sp.testing import run_distributed

    ranks = run_distributed(_tool_rank, world, init=False, argv=[*args, "train.preflight=false"],
                            stdin=stdin.encode())
    assert [code for code, _, _ in ranks] == [0] * world, [err for _, _, err in ranks]
    assert all(out == "" for _, out, _ in ranks[1:])  # rank 0 prints every replica's completions
    return [json.loads(line) for line in ranks[0][1].splitlines()]


def test_cli_prompt_file_layouts_interactive_and_no_cache(checkpoint_dir: Path, tmp_path: Path) -> None:
    """A prompt file (text, and JSONL) decoded at tp2 × pp2, and by two data-parallel replicas sharing the prompts,
    gives the 1-rank tokens, greedy and sampled; --interactive and --no-cache give the same samples. On harness ranks
    (``tool_ranks``); the command line itself runs in the tests above and below."""
    texts = ["abc", "", "def main(x):", "xyz"]
    (tmp_path / "p.txt").write_text("abc\n\n\ndef main(x):\nxyz\n")  # blank lines are skipped ...
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))  # ... JSONL keeps ""
    sample = ["--json", "--max-new-tokens", "6", "--temperature", "0.9", "--top-k", "20", "--top-p", "0.9", "--seed", "11"]
    one = tool_ranks(1, "--load", str(checkpoint_dir), "--prompt-file", str(tmp_path / "p.jsonl"), *sample)
    assert [r["prompt"] for r in one] == texts and [r["index"] for r in one] == [0, 1, 2, 3]
    assert one[1]["prompt_ids"] == [256]  # an empty prompt starts a document
    assert tool_ranks(2, "--load", str(checkpoint_dir), "--prompt-file", str(tmp_path / "p.jsonl"), *sample,
                      "parallel.dp=2") == one
    interactive = tool_ranks(1, "--load", str(checkpoint_dir / "iter_0000002"), "--interactive", *sample, "--no-cache",
                             stdin="\n".join(texts) + "\n")
    assert interactive == one  # each prompt draws from its own generator: alone or in a batch, cached or not
    greedy = ["--json", "--max-new-tokens", "8", "--greedy"]
    want = tool_ranks(4, "--load", str(checkpoint_dir), "--prompt-file", str(tmp_path / "p.txt"), *greedy,
                      "parallel.tp=2", "parallel.pp=2", "--batch-size", "1")
    assert [r["prompt"] for r in want] == ["abc", "def main(x):", "xyz"]
    for r in want:
        ids = r["prompt_ids"]
        assert r["new_ids"] == new_ids(saved_model(), [ids], 8, 256)[0]  # the 1-rank library's tokens


@pytest.mark.parametrize("args,needle", [
    (["--load", "/nonexistent/ckpt", "--prompt", "x"], "--load"),
    (["--load", ".", "--prompt", "x"], "--load"),
    (["--load", "CKPT", "--prompt", "x", "--top-p", "1.5"], "--top-p"),
    (["--load", "CKPT", "--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
    (["--load", "CKPT", "--prompt", "x", "--greedy", "--temperature", "0.5"], "--greedy"),
    (["--load", "CKPT"], "--prompt"),
    (["--load", "CKPT", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be in 1..100000"),
    (["--load", "CKPT", "--prompt", "x", "--max-new-tokens", "1e9"], "--max-new-tokens"),
    (["--load", "CKPT", "--prompt", "x" * 49], "prompt 0 has 49 tokens, more than the model's seq_length 48"),
    (["--load", "CKPT", "--prompt-file", "EMPTY"], "holds no prompt"),
    (["--load", "CKPT", "--prompt-file", "/nonexistent/prompts.txt"], "--prompt-file"),
    (["--load", "CKPT", "--prompt", "x", "parallel.tp=3"], "parallel.tp"),
    (["--load", "CKPT", "--prompt", "x", "parallel.pp=3"], "parallel.pp"),
    (["--load", "CKPT", "--prompt", "x", "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
     "parallel.sequence_parallel=false"),
    (["--load", "CKPT", "--prompt", "x", "model.num_layers=4"], "the model is the checkpoint's"),
    (["--load", "CKPT", "--interactive", "parallel.tp=2"], "--interactive runs on one rank"),
    (["--load", "CKPT", "--prompt", "a\udcffb"], "--prompt is not UTF-8 text (an undecodable byte at position 1)"),
])
def test_cli_bad_input_is_one_line(checkpoint_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                   args: list[str], needle: str) -> None:
    """In this process: each is refused before any rank or process group starts."""
    (tmp_path / "empty.txt").write_text("\n\n")
    swap = {"CKPT": str(checkpoint_dir), "EMPTY": str(tmp_path / "empty.txt")}
    spec = importlib.util.spec_from_file_location("generate_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(tool)  # type: ignore[union-attr]
    try:
        code = tool.main([swap.get(a, a) for a in args])
    except SystemExit as exc:  # argparse's one line
        code = exc.code
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], out.err
    assert "Traceback" not in out.err and out.out == ""


def load_tool(name: str) -> object:
    spec = importlib.util.spec_from_file_location(f"{name}_tool", ROOT / "tools" / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(tool)  # type: ignore[union-attr]
    return tool


def test_tools_run_train_pys_preflight_and_need_no_data(checkpoint_dir: Path, capsys: pytest.CaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """64 ranks on a 2-core host with 10 GiB: generate.py and evaluate.py refuse the layout as train.py does, before
    any rank starts; evaluate on a checkpoint without data paths (imported) asks for --data."""
    from megatron_sp import device, launcher

    monkeypatch.setattr(device, "host_memory_available", lambda: 10 * 2**30)
    monkeypatch.setattr(device, "host_cores", lambda: 2)
    monkeypatch.setattr(launcher, "start_local", lambda *_, **__: pytest.fail("a rank was started"))
    for var in (*launcher.TORCHRUN_ENV, "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    refused = "this layout (tp1 pp1 cp1 dp64) needs ~"
    cases = [("generate", ["--prompt", "x", "parallel.dp=64"], refused),
             ("evaluate", ["parallel.dp=64", "train.global_batch_size=64"], refused),
             ("evaluate", [], "no data.paths (an imported checkpoint?); give --data PREFIX")]
    for name, args, needle in cases:
        assert load_tool(name).main(["--load", str(checkpoint_dir), *args]) == 2  # type: ignore[attr-defined]
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


def test_cli_interactive_plain_text_edges(checkpoint_dir: Path) -> None:
    """--interactive in plain text: a separator line between completions; a tiny temperature and nucleus decode the
    greedy tokens; a line of invalid UTF-8 is one error line naming it, after the completions before it."""
    proc = subprocess.run([sys.executable, str(TOOL), "--load", str(checkpoint_dir), "--interactive", "--max-new-tokens",
                           "4", "--temperature", "1e-39", "--top-p", "1e-300"], input=b"abc\nxyz\n\xff\n",
                          capture_output=True, timeout=300, cwd=ROOT)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.splitlines() == [
        "error: stdin line 3 is not UTF-8 text (an undecodable byte at position 0); give UTF-8 text"], err
    tokenizer = build_tokenizer(config.load(overrides=CKPT_CONFIG).tokenizer)
    greedy = new_ids(saved_model(), [tokenizer.encode("abc"), tokenizer.encode("xyz")], 4, tokenizer.eod)
    want = [t + tokenizer.decode(ids) for t, ids in zip(("abc", "xyz"), greedy, strict=True)]
    assert proc.stdout.decode() == f"{want[0]}\n{'-' * 40}\n{want[1]}\n"
