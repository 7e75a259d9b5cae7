#!/usr/bin/env python
"""Tokenize JSONL corpora into Megatron indexed datasets (PREFIX_{key}_document.bin/.idx, byte-compatible with
megatron-core), or convert samples packed the Hugging Face way (--packed-samples) for data.packing=position_ids.

    python tools/preprocess_data.py --input data/demo/corpus.jsonl --output-prefix data/demo/demo \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/demo/tokenizer.model --append-eod --workers 2
    python tools/preprocess_data.py --packed-samples --seq-length 2048 --input packed.jsonl \
        --output-prefix data/hf/chat --tokenizer-type hf --tokenizer-model path/to/tokenizer.json

The outputs appear only once all are complete; existing ones are kept unless --overwrite. Details: docs/data.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

if importlib.util.find_spec("megatron_sp") is None:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_sp.config.schema import TokenizerConfig
from megatron_sp.data.packed import convert_packed_jsonl
from megatron_sp.data.preprocess import DISK_FULL, preprocess_jsonl
from megatron_sp.data.tokenizer import build_tokenizer
from megatron_sp.errors import OneLineArgumentParser, UserError, one_line, write_failure

TOKENIZER_TYPES = {
    "SentencePieceTokenizer": "sentencepiece",
    "sentencepiece": "sentencepiece",
    "HuggingFaceTokenizer": "hf",
    "hf": "hf",
    "ByteTokenizer": "byte",
    "byte": "byte",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="JSONL",
                        help="JSONL file(s), plain or .gz, one JSON object (document) per line.")
    parser.add_argument("--output-prefix", required=True,
                        help="Output prefix: writes OUTPUT_PREFIX_{key}_document.bin/.idx for each JSON key.")
    parser.add_argument("--tokenizer-type", required=True, choices=sorted(TOKENIZER_TYPES),
                        help="SentencePieceTokenizer (or sentencepiece): needs --tokenizer-model; "
                             "HuggingFaceTokenizer (or hf): a tokenizers tokenizer.json as --tokenizer-model; "
                             "ByteTokenizer (or byte): UTF-8 bytes, 258 ids.")
    parser.add_argument("--tokenizer-model", default=None,
                        help="SentencePiece .model file (made by tools/train_tokenizer.py), or the HF tokenizer.json "
                             "(or its directory).")
    parser.add_argument("--eod-token", default=None,
                        help="The end-of-document token, when the tokenizer's default is not the one wanted "
                             "(the tokenizer.eod_token config key).")
    parser.add_argument("--json-keys", nargs="+", default=None,
                        help="JSON keys to tokenize, one dataset per key (default: text).")
    parser.add_argument("--append-eod", action="store_true",
                        help="Append the end-of-document token to every document (wanted for GPT pretraining; "
                             "off by default, as in Megatron).")
    parser.add_argument("--split-sentences", action="store_true",
                        help="Write each sentence as its own sequence (documents keep their sentences together); "
                             "outputs are named OUTPUT_PREFIX_{key}_sentence. A rule-based splitter (no NLTK).")
    parser.add_argument("--workers", type=int, default=1,
                        help="Tokenizer processes; the output does not depend on it (default: %(default)s).")
    parser.add_argument("--packed-samples", action="store_true",
                        help="The input holds pre-packed samples (input_ids, position_ids, optional labels per line, "
                             "as Hugging Face / Axolotl pack them) instead of text: write OUTPUT_PREFIX_packed "
                             "(+ _positions, _labels) for data.packing=position_ids. Needs --seq-length.")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="With --packed-samples: the model.seq_length to train with; a sample holds at most "
                             "seq-length + 1 tokens and shorter ones are padded to that (a padding document, "
                             "labels -100).")
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace existing OUTPUT_PREFIX_{key}_{level}.bin/.idx files (refused by default).")
    parser.add_argument("--log-interval", type=int, default=1000,
                        help="Log progress (documents, docs/s, MB/s) every this many documents "
                             "(default: %(default)s; 0: only the summary).")
    args = parser.parse_args(argv)
    if TOKENIZER_TYPES[args.tokenizer_type] in ("sentencepiece", "hf") and not args.tokenizer_model:
        parser.error(f"--tokenizer-model is required with --tokenizer-type {args.tokenizer_type}")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1 (the number of tokenizer processes), got {args.workers}; "
                     "use --workers 1 to tokenize in this process")
    if args.log_interval < 0:
        parser.error(f"--log-interval must be >= 0, got {args.log_interval}")
    if args.packed_samples:
        text_only = [flag for flag, given in (("--json-keys", args.json_keys is not None),
                                              ("--append-eod", args.append_eod),
                                              ("--split-sentences", args.split_sentences)) if given]
        if text_only:
            parser.error(f"{', '.join(text_only)} tokenize text and do not apply to --packed-samples (the samples "
                         f"are token ids already); drop them")
        if args.seq_length is None or args.seq_length < 1:
            parser.error("--packed-samples needs --seq-length N >= 1: the model.seq_length to train with (a sample "
                         "holds at most N + 1 tokens)")
    elif args.seq_length is not None:
        parser.error("--seq-length applies to --packed-samples only; drop it (text is cut into samples at training)")
    if args.json_keys is None:
        args.json_keys = ["text"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        tokenizer = build_tokenizer(TokenizerConfig(type=TOKENIZER_TYPES[args.tokenizer_type],
                                                    model=args.tokenizer_model, eod_token=args.eod_token))
        if args.packed_samples:
            stats = convert_packed_jsonl(args.input, args.output_prefix, args.seq_length, tokenizer.vocab_size,
                                         tokenizer.pad, overwrite=args.overwrite, log_interval=args.log_interval)
            print(f"samples {stats['samples']} of {args.seq_length + 1} tokens ({stats['padded']} padded, "
                  f"{stats['pad_tokens']} padding tokens), {stats['seconds']:.1f} s")
            for prefix in stats["outputs"]:
                print(f"wrote {prefix}.bin and {prefix}.idx")
            return 0
        stats = preprocess_jsonl(args.input, args.output_prefix, tokenizer, json_keys=args.json_keys,
                                 append_eod=args.append_eod, workers=args.workers,
                                 split_sentences=args.split_sentences, log_interval=args.log_interval,
                                 overwrite=args.overwrite)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a full disk under --packed-samples (the text path reports its own): outputs removed
        if e.errno not in DISK_FULL:
            raise
        need = 3 * sum(Path(p).stat().st_size for p in args.input)  # ≤ one id per 2 input bytes, 3 files of ≤ 4 bytes
        print(f"error: nothing was written: {one_line(write_failure(f'{args.output_prefix}_packed.bin', e, need))}",
              file=sys.stderr)
        return 1
    seconds = max(stats["seconds"], 1e-9)
    print(f"docs {stats['docs']}, tokens {stats['tokens']}, {stats['docs'] / seconds:.1f} docs/s, "
          f"{stats['bytes'] / 1e6 / seconds:.2f} MB/s, {seconds:.1f} s")
    for prefix in stats["outputs"]:
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
