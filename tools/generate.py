#!/usr/bin/env python
"""Generate text from a checkpoint written by train.py, under any layout.

    python tools/generate.py --load checkpoints/demo --prompt "def main(" --max-new-tokens 64 --greedy
    python tools/generate.py --load checkpoints/demo --prompt-file prompts.txt --temperature 0.8 --top-p 0.95 --json
    python tools/generate.py --load checkpoints/demo --prompt-file prompts.jsonl parallel.tp=2 parallel.pp=2
    python tools/generate.py --load checkpoints/demo --interactive < prompts.txt

A checkpoint of any layout loads into any generation layout (its files are layout-free): ``section.key=value``
overrides set it as for train.py (``parallel.tp``, ``parallel.pp``, ``parallel.cp`` to prefill long prompts split
over ranks, ``parallel.dp`` for replicas that share the prompts); run plainly it starts the local ranks the layout
needs, or runs under torchrun. The model and tokenizer come from the config in the checkpoint's meta.json. The
prompts are decoded in batches (``--batch-size``; under pipeline parallelism several micro-batches keep the stages
busy), each stopping at its own end-of-document or ``--max-new-tokens``, or when it fills the model's seq_length.
Decoding is greedy unless a sampling flag is given; a sampled prompt draws from its own generator (``--seed`` and
its number), so its tokens do not depend on the layout or on the other prompts. An empty prompt starts from the end-
of-document token. Details: docs/generation.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

if importlib.util.find_spec("megatron_sp") is None:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if str(Path(__file__).resolve().parent) not in sys.path:  # inference_setup beside this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference_setup import load_tokenizer, loaded_stage, run_tool

from megatron_sp.config import Config
from megatron_sp.config.loader import MAX_NEW_TOKENS  # past the context window every token re-runs it
from megatron_sp.data.tokenizer import Tokenizer
from megatron_sp.errors import ConfigError, DataError, OneLineArgumentParser
from megatron_sp.model.inference import Completion, Sampling, generate_batch
from megatron_sp.mpu import comm

SEPARATOR = "-" * 40  # plain-text output: the line between two prompts' completions (--json: one object a line)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog="generate.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, metavar="DIR",
                        help="Checkpoint directory: a checkpoint.save directory (uses 'latest') or an iter_* dir.")
    parser.add_argument("--prompt", help="Text to continue.")
    parser.add_argument("--prompt-file", metavar="FILE",
                        help="Prompts, one per line (blank lines skipped), or JSONL with a 'text' key per line.")
    parser.add_argument("--interactive", action="store_true",
                        help="Read prompts from stdin, one per line, until EOF; print each completion at once (1 rank).")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="Generate at most this many tokens per prompt (default: %(default)s).")
    parser.add_argument("--greedy", action="store_true", help="Argmax decoding (the default without sampling flags).")
    parser.add_argument("--temperature", type=float, help="Sample with this softmax temperature (0: greedy).")
    parser.add_argument("--top-k", type=int, help="Sample among the k most likely tokens (0: all).")
    parser.add_argument("--top-p", type=float, help="Nucleus sampling: the most likely tokens up to this mass (0, 1].")
    parser.add_argument("--seed", type=int, default=1234, help="Seed of the sampling (default: %(default)s).")
    parser.add_argument("--batch-size", type=int, metavar="B",
                        help="Prompts decoded together (default: all of a replica's, split in pp micro-batches).")
    parser.add_argument("--json", action="store_true",
                        help="Print one JSON object per prompt: index, prompt, prompt_ids, new_ids, text, stop.")
    parser.add_argument("--no-cache", action="store_true",
                        help="Re-run the whole context for every token instead of using the KV cache.")
    parser.add_argument("--tokenizer-model", metavar="FILE",
                        help="SentencePiece .model to use instead of the path saved in the checkpoint's config.")
    parser.add_argument("overrides", nargs="*", help="the layout as dotted overrides, e.g. parallel.tp=2 parallel.pp=2")
    args = parser.parse_intermixed_args(argv)  # the ranks get an override appended
    sampling = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                         ("--top-p", args.top_p)) if value is not None]
    if args.greedy and sampling:
        parser.error(f"--greedy cannot be combined with {', '.join(sampling)}")
    if sum(x is not None and x is not False for x in (args.prompt, args.prompt_file, args.interactive)) != 1:
        parser.error("give exactly one of --prompt TEXT, --prompt-file FILE or --interactive")
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        parser.error(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS} (tokens per prompt), got {args.max_new_tokens}")
    if args.temperature is not None and not args.temperature >= 0:
        parser.error(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 0:
        parser.error(f"--top-k must be >= 0 (0: no limit), got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    greedy = not sampling or args.temperature == 0
    args.sampling = Sampling(greedy=greedy, seed=args.seed) if greedy else Sampling(
        greedy=False, temperature=1.0 if args.temperature is None else args.temperature, top_k=args.top_k or 0,
        top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed)
    return args


def read_prompts(path: str) -> list[str]:
    """``--prompt-file``: one prompt per line (blank lines skipped), or JSONL objects with a ``text`` string."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"--prompt-file: cannot read '{file}' ({exc.__class__.__name__}: {exc})") from None
    prompts: list[str] = []
    jsonl = file.suffix == ".jsonl" or next((ln for ln in lines if ln.strip()), "").lstrip().startswith("{")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(line)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"--prompt-file: '{file}' line {number} is not JSON ({exc.msg}); write one object with a "
                            "'text' string per line, or plain text one prompt per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise DataError(f"--prompt-file: '{file}' line {number} has no 'text' string")
        prompts.append(row["text"])
    if not prompts:
        raise DataError(f"--prompt-file: '{file}' holds no prompt; write one per line")
    return prompts


def utf8_text(text: str | bytes, where: str) -> str:
    """``text`` (bytes from stdin, or an argument, whose undecodable bytes Python keeps as surrogates) as UTF-8 text;
    else one line naming ``where``."""
    try:
        if isinstance(text, bytes):
            return text.decode("utf-8")
        text.encode("utf-8")
        return text
    except UnicodeError as exc:
        raise DataError(f"{where} is not UTF-8 text (an undecodable byte at position {exc.start}); give UTF-8 text") from None


def encode(tokenizer: Tokenizer, prompts: list[str], seq_length: int) -> list[list[int]]:
    """Token ids of each prompt (an empty one: the end-of-document token); too long: one line, never truncated."""
    out = []
    for index, text in enumerate(prompts):
        ids = tokenizer.encode(text) or [tokenizer.eod]
        if len(ids) > seq_length:
            raise DataError(f"prompt {index} has {len(ids)} tokens, more than the model's seq_length {seq_length}: "
                            "shorten it (prompts are not truncated)")
        out.append(ids)
    return out


def check_layout(cfg: Config, args: argparse.Namespace) -> None:
    """What generation does not run (yet), each one line naming the override."""
    p = cfg.parallel
    if p.cp > 1 and p.sequence_parallel:
        raise ConfigError(f"parallel.cp: {p.cp} prefills into the KV cache, which sequence parallelism does not use; "
                          "set parallel.sequence_parallel=false")
    if p.virtual_stages > 1:
        raise ConfigError(f"parallel.virtual_stages: {p.virtual_stages}: generation runs one model chunk per stage; "
                          "set parallel.virtual_stages=1")
    if p.ep > 1:
        raise ConfigError(f"parallel.ep: {p.ep}: generation holds every expert on each rank; set parallel.ep=1 (or "
                          "parallel.expert_tp=<tp> to split the experts over tp)")
    if args.interactive and p.world_size > 1:  # type: ignore[operator]
        raise ConfigError("--interactive runs on one rank; use --prompt-file for a layout of several ranks")


def result(c: Completion, text: str, tokenizer: Tokenizer, as_json: bool, position: int) -> str:
    """The output of the ``position``-th prompt printed: a JSON line, or the prompt followed by its continuation (after
    a ``SEPARATOR`` line from the second one on)."""
    new = tokenizer.decode(c.new_ids)
    if as_json:
        return json.dumps({"index": c.index, "prompt": text, "prompt_ids": c.prompt_ids, "new_ids": c.new_ids,
                           "text": new, "stop": c.stop})
    return f"{SEPARATOR}\n{text}{new}" if position else text + new


def main(argv: list[str] | None = None) -> int:
    """``tools/generate.py``: returns the exit code; a user error is one ``error:`` line (exit code 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    prompts: list[str] = []
    ids: list[list[int]] = []

    def check(cfg: Config, before_ranks: bool) -> None:
        check_layout(cfg, args)
        tokenizer = load_tokenizer(cfg)  # a missing tokenizer file: one line before any rank starts
        if not args.interactive:
            prompts.extend(read_prompts(args.prompt_file) if args.prompt_file else [utf8_text(args.prompt, "--prompt")])
            ids.extend(encode(tokenizer, prompts, cfg.model.seq_length))

    def work(cfg: Config, ckpt: Path, meta: dict[str, Any]) -> str | None:
        with loaded_stage(cfg, ckpt, meta) as (state, model, tokenizer, _):
            def decode(batch: list[list[int]], indices: list[int]) -> list[Completion]:
                return generate_batch(model, batch, args.max_new_tokens, tokenizer.eod, args.sampling, args.batch_size,
                                      state, indices, use_cache=not args.no_cache)
            if args.interactive:
                for index, line in enumerate(sys.stdin.buffer):
                    text = utf8_text(line, f"stdin line {index + 1}").rstrip("\r\n")
                    (done,) = decode(encode(tokenizer, [text], cfg.model.seq_length), [index])
                    print(result(done, text, tokenizer, args.json, index), flush=True)
                return None
            mine = list(range(state.dp_rank, len(ids), state.dp_size))  # this replica's prompts
            done = decode([ids[i] for i in mine], mine)
            for c in done:
                c.generator = None  # (gathered below)
            every = sorted((c for part in comm.all_gather_object(done, state.groups["dp"]) for c in part),
                           key=lambda c: c.index)
            return "\n".join(result(c, prompts[c.index], tokenizer, args.json, k) for k, c in enumerate(every))

    tokenizer_keys = [f"tokenizer.model={args.tokenizer_model}", "tokenizer.type=sentencepiece"] \
        if args.tokenizer_model else []
    return run_tool(argv, args.load, [*args.overrides, *tokenizer_keys], work, check, batches=False)


if __name__ == "__main__":
    sys.exit(main())
