#!/usr/bin/env python
"""Generate text from a checkpoint written by train.py.

    python tools/generate.py --load checkpoints/demo --prompt "def main(" --max-new-tokens 64 --greedy
    python tools/generate.py --load checkpoints/demo/iter_0000150 --prompt "import " --temperature 0.8 \\
        --top-p 0.95 --seed 7 --json
    python tools/generate.py --load checkpoints/demo --interactive < prompts.txt

A checkpoint of any parallel layout loads into this one process (its files are layout-free); the
model and tokenizer come from the config in its meta.json. Decoding is greedy unless a sampling
flag is given. An empty prompt starts from the end-of-document token.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

if importlib.util.find_spec("megatron_sp") is None:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from megatron_sp import checkpointing
from megatron_sp.config import ModelConfig, TokenizerConfig
from megatron_sp.config.loader import MAX_NEW_TOKENS  # past the context window every token re-runs it
from megatron_sp.data.tokenizer import Tokenizer, build_tokenizer
from megatron_sp.errors import DataError, OneLineArgumentParser, UserError
from megatron_sp.model import GPTModel, generate
from megatron_sp.model.moe import load_expert_bias

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, metavar="DIR",
                        help="Checkpoint directory: a checkpoint.save directory (uses 'latest') or an iter_* dir.")
    parser.add_argument("--prompt", help="Text to continue (or --interactive).")
    parser.add_argument("--interactive", action="store_true",
                        help="Read prompts from stdin, one per line, until EOF; print one completion each.")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="Generate at most this many tokens; stops early at end-of-document (default: %(default)s).")
    parser.add_argument("--greedy", action="store_true", help="Argmax decoding (the default without sampling flags).")
    parser.add_argument("--temperature", type=float, help="Sample with this softmax temperature (> 0; default 1.0).")
    parser.add_argument("--top-k", type=int, help="Sample among the k most likely tokens (0: all).")
    parser.add_argument("--top-p", type=float, help="Nucleus sampling: the most likely tokens up to this mass (0, 1].")
    parser.add_argument("--seed", type=int, default=1234, help="Seed of the sampling (default: %(default)s).")
    parser.add_argument("--json", action="store_true",
                        help="Print one JSON object per prompt: prompt, prompt_ids, new_ids, text.")
    parser.add_argument("--no-cache", action="store_true",
                        help="Re-run the whole context for every token instead of using the KV cache.")
    parser.add_argument("--tokenizer-model", metavar="FILE",
                        help="SentencePiece .model to use instead of the path saved in the checkpoint's config.")
    args = parser.parse_args(argv)
    sampling = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                         ("--top-p", args.top_p)) if value is not None]
    if args.greedy and sampling:
        parser.error(f"--greedy cannot be combined with {', '.join(sampling)}")
    if (args.prompt is None) == (not args.interactive):
        parser.error("give exactly one of --prompt TEXT or --interactive")
    if not 0 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        parser.error(f"--max-new-tokens must be in 0..{MAX_NEW_TOKENS} (tokens per prompt), got {args.max_new_tokens}")
    if args.temperature is not None and not args.temperature > 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 0:
        parser.error(f"--top-k must be >= 0 (0: no limit), got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    args.sample = bool(sampling)
    return args


def _section(config: dict[str, Any], name: str, cls: type, path: Path) -> Any:
    """``cls`` built from the saved config section ``name`` (strict: an unknown key is an error)."""
    values = config.get(name)
    if not isinstance(values, dict):
        raise DataError(f"checkpoint file '{path}': the saved config has no '{name}' section")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise DataError(f"checkpoint file '{path}': unknown key '{name}.{unknown[0]}' in the saved config (written by "
                        "a different version?)")
    return cls(**values)


def load_checkpoint(load: str, tokenizer_model: str | None = None) -> tuple[GPTModel, Tokenizer, Path]:
    """The eval-mode 1-rank model, the tokenizer and the checkpoint directory of ``--load``."""
    root = Path(load)
    if not root.is_dir():
        raise DataError(f"--load: '{root}' is not a directory; give a checkpoint.save directory or an iter_* "
                        "directory inside it")
    try:
        ckpt = checkpointing.resolve(root)
    except DataError as exc:
        raise DataError(str(exc).replace("checkpoint.load:", "--load:", 1)) from None
    meta = checkpointing.read_meta(ckpt)
    config = meta.get("config")
    if not isinstance(config, dict):
        raise DataError(f"checkpoint file '{ckpt / 'meta.json'}' holds no config")
    model_cfg = _section(config, "model", ModelConfig, ckpt / "meta.json")
    tok_cfg = _section(config, "tokenizer", TokenizerConfig, ckpt / "meta.json")
    if tokenizer_model is not None:
        tok_cfg = dataclasses.replace(tok_cfg, type="sentencepiece", model=tokenizer_model)
    if tok_cfg.type.lower().startswith("sentencepiece") and tok_cfg.model and not Path(tok_cfg.model).is_file():
        flag = "--tokenizer-model" if tokenizer_model is not None else "the checkpoint's tokenizer.model"
        raise DataError(f"{flag}: SentencePiece model '{tok_cfg.model}' not found (pass --tokenizer-model FILE)")
    tokenizer = build_tokenizer(tok_cfg)
    vocab = model_cfg.vocab_size or model_cfg.padded_vocab_size
    if vocab is None or tokenizer.vocab_size > vocab:
        raise DataError(f"tokenizer {tokenizer!r} has {tokenizer.vocab_size} ids but the checkpoint's model has "
                        f"vocab_size {vocab}: not the tokenizer it was trained with")
    try:
        model = GPTModel(model_cfg, seed=0)
    except ValueError as exc:
        raise DataError(f"checkpoint file '{ckpt / 'meta.json'}': bad model config ({exc})") from None
    checkpointing.load_model_state(model, ckpt, None)
    load_expert_bias(model, meta.get("moe_expert_bias"))  # aux-loss-free balancing: routing as in training
    return model.eval(), tokenizer, ckpt


def complete(model: GPTModel, tokenizer: Tokenizer, prompt: str, args: argparse.Namespace,
             generator: torch.Generator) -> dict[str, Any]:
    """One completion of ``prompt`` as the ``--json`` object."""
    prompt_ids = tokenizer.encode(prompt)
    context = prompt_ids or [tokenizer.eod]  # an empty prompt starts a new document
    sampling = {"greedy": True}
    if args.sample:
        sampling = {"greedy": False, "temperature": 1.0 if args.temperature is None else args.temperature,
                    "top_k": args.top_k or 0, "top_p": 1.0 if args.top_p is None else args.top_p}
    out = generate(model, context, args.max_new_tokens, tokenizer.eod, generator=generator,
                   use_cache=not args.no_cache, **sampling)
    new_ids = out[len(context):]
    return {"prompt": prompt, "prompt_ids": prompt_ids, "new_ids": new_ids, "text": tokenizer.decode(new_ids)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model, tokenizer, _ = load_checkpoint(args.load, args.tokenizer_model)
        generator = torch.Generator().manual_seed(args.seed)
        prompts = (line.rstrip("\n") for line in sys.stdin) if args.interactive else iter([args.prompt])
        for prompt in prompts:
            result = complete(model, tokenizer, prompt, args, generator)
            print(json.dumps(result) if args.json else prompt + result["text"], flush=True)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
