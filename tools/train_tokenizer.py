#!/usr/bin/env python
"""Train a BPE SentencePiece tokenizer on the text lines of JSONL corpora.

    python tools/train_tokenizer.py --input data/demo/corpus.jsonl --model-prefix data/demo/tokenizer \\
        --vocab-size 4096

Writes PREFIX.model and PREFIX.vocab (under temporary names, then renamed; existing ones are kept
unless --overwrite). The model round-trips any text exactly (identity
normalisation, whitespace kept, byte fallback), and the same input gives the same model.
Ids: 0 <unk>, 1 <s>, 2 </s> (end of document), 3 <pad>, then 256 byte pieces and the merges.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from pathlib import Path

if importlib.util.find_spec("megatron_sp") is None:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_sp.data.tokenizer import train_sentencepiece
from megatron_sp.errors import OneLineArgumentParser, UserError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="JSONL",
                        help="JSONL corpus file(s), plain or .gz, one document per line.")
    parser.add_argument("--model-prefix", required=True,
                        help="Output path without suffix: PREFIX.model and PREFIX.vocab are written.")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="Number of tokens, including 4 special and 256 byte pieces (default: %(default)s).")
    parser.add_argument("--json-key", default="text",
                        help="Key of the document text in each JSON line (default: %(default)s).")
    parser.add_argument("--max-lines", type=int, default=2_000_000,
                        help="Train on at most this many text lines, sampled deterministically (default: %(default)s).")
    parser.add_argument("--seed", type=int, default=1234,
                        help="Seed of the line sampling and of SentencePiece (default: %(default)s).")
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace existing PREFIX.model / PREFIX.vocab files (refused by default).")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        path = train_sentencepiece(args.input, args.model_prefix, args.vocab_size, json_key=args.json_key,
                                   max_lines=args.max_lines, seed=args.seed, overwrite=args.overwrite)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"wrote {path} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
