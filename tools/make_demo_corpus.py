#!/usr/bin/env python
"""Write the demo JSONL corpus: the Python standard library's own .py files, one document each.

    python tools/make_demo_corpus.py --output data/demo/corpus.jsonl --max-bytes 4000000

No download is needed; the same Python version always produces the same file. An existing --output is
kept unless --overwrite (the file is written under a temporary name, then renamed).
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

from megatron_sp.data.corpus import make_demo_corpus
from megatron_sp.errors import OneLineArgumentParser, UserError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="data/demo/corpus.jsonl",
                        help="JSONL file to write, one {\"text\": source} object per line (default: %(default)s).")
    parser.add_argument("--max-bytes", type=int, default=4_000_000,
                        help="Upper bound on the file size; a file that would overflow it is skipped "
                             "(default: %(default)s).")
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace an existing --output file (refused by default).")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        path = make_demo_corpus(args.output, max_bytes=args.max_bytes, overwrite=args.overwrite)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
