"""Data pipeline at scale: preprocessing throughput against megatron-core, random sample access, loader overhead.

Method: docs/benchmarks.md; megatron-core is optional (``.[compat]``), without it its columns are empty.
Run from the repo root:  python tools/bench/data.py [--workers 1,2] [--max-bytes 4000000] ...
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from common import gpt_config, ints, parser
from megatron_sp.config.schema import TokenizerConfig
from megatron_sp.data.corpus import make_demo_corpus
from megatron_sp.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype, data_file_paths
from megatron_sp.data.preprocess import preprocess_jsonl
from megatron_sp.data.tokenizer import Tokenizer, build_tokenizer, train_sentencepiece


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, vocab=4096, seq=256, steps=12)
    p.add_argument("--workers", default="1,2", help="comma-separated preprocessing worker counts")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="size of the demo corpus")
    p.add_argument("--repeats", type=int, default=3, help="preprocessing runs per worker count and side")
    p.add_argument("--accesses", type=int, default=20_000, help="random samples / documents read")
    p.add_argument("--work-dir", default=None, help="keep the corpus, tokenizer and outputs here (default: temp)")
    return p.parse_args(argv)


def import_megatron() -> Any:
    """megatron-core's indexed_dataset module, or None when it is not installed or does not import."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import megatron.core.datasets.indexed_dataset as mc
        except Exception:  # any import failure means "not available here"
            return None
    return mc


class MegatronEncoder:
    """Megatron-LM's ``tools/preprocess_data.py`` ``Encoder`` (one key, no sentence splitting), our tokenizer."""

    tokenizer: Tokenizer | None = None

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def initializer(self) -> None:
        MegatronEncoder.tokenizer = self._tokenizer

    def encode(self, json_line: str) -> tuple[list[int], list[int]]:
        tokenizer = MegatronEncoder.tokenizer
        assert tokenizer is not None
        doc_ids = tokenizer.encode(json.loads(json_line)["text"])
        if doc_ids:
            doc_ids.append(tokenizer.eod)
        return doc_ids, [len(doc_ids)] if doc_ids else []


def megatron_preprocess(mc: Any, corpus: Path, prefix: Path, tokenizer: Tokenizer, workers: int) -> dict[str, float]:
    """Megatron-LM's preprocessing loop: a pool of ``workers`` over the file's lines, one builder per key."""
    start = time.perf_counter()
    encoder = MegatronEncoder(tokenizer)
    docs = 0
    with open(corpus, encoding="utf-8") as fin, multiprocessing.Pool(workers, initializer=encoder.initializer) as pool:
        builder = mc.IndexedDatasetBuilder(str(prefix) + ".bin", dtype=mc.DType.optimal_dtype(tokenizer.vocab_size))
        for doc, lengths in pool.imap(encoder.encode, fin, 32):
            builder.add_document(doc, lengths)
            docs += 1
        builder.finalize(str(prefix) + ".idx")
    return {"docs": docs, "bytes": corpus.stat().st_size, "seconds": time.perf_counter() - start}


def bench_preprocess(args: argparse.Namespace, mc: Any, work: Path, corpus: Path, tokenizer: Tokenizer) -> list[dict]:
    """Best-of-``repeats`` docs/s and MB/s per worker count, ours vs megatron, alternating runs."""
    rows = []
    for workers in ints(args.workers):
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.repeats):
            runs = {"ours": lambda w=workers: preprocess_jsonl([corpus], work / "ours", tokenizer, workers=w,
                                                               log_interval=0)}
            if mc is not None:
                runs["megatron"] = lambda w=workers: megatron_preprocess(mc, corpus, work / "megatron_text_document",
                                                                         tokenizer, w)
            for name, run in runs.items():
                stats = run()
                if name not in best or stats["seconds"] < best[name]["seconds"]:
                    best[name] = {k: float(stats[k]) for k in ("docs", "bytes", "seconds")}
        if mc is not None:
            for ours, theirs in zip(data_file_paths(work / "ours_text_document"),
                                    data_file_paths(work / "megatron_text_document"), strict=True):
                assert ours.read_bytes() == theirs.read_bytes(), f"{ours} and {theirs} differ"
        row: dict[str, Any] = {"workers": workers}
        for name, stats in best.items():
            row[f"{name}_docs_per_s"] = stats["docs"] / stats["seconds"]
            row[f"{name}_mb_per_s"] = stats["bytes"] / 1e6 / stats["seconds"]
            row[f"{name}_seconds"] = stats["seconds"]
        if "megatron" in best:
            row["ratio"] = best["megatron"]["seconds"] / best["ours"]["seconds"]
        rows.append(row)
    return rows


def bench_writers(mc: Any, work: Path, dataset: IndexedDataset, repeats: int) -> dict[str, float]:
    """MB/s of tokens written: the same documents through each writer (best of ``repeats``)."""
    docs = [np.asarray(dataset.get_document(d)) for d in range(dataset.num_documents)] * 8  # ~16 MB per write
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    flat = np.concatenate(docs)
    total_mb = flat.nbytes / 1e6
    dtype = dataset.dtype

    def ours_per_document() -> None:
        with IndexedDatasetWriter(work / "w_ours", dtype) as writer:
            for doc in docs:
                writer.add_document(doc)

    def ours_packed() -> None:
        with IndexedDatasetWriter(work / "w_packed", dtype) as writer:
            starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
            for k in range(0, len(docs), 16):  # 16 documents per chunk, as a worker returns them
                part = lengths[k:k + 16]
                writer.add_packed(flat[starts[k]:starts[k + len(part)]], part, np.ones(len(part), dtype=np.int64))

    def megatron() -> None:
        builder = mc.IndexedDatasetBuilder(str(work / "w_mc") + ".bin", dtype=dtype.type)
        for doc in docs:
            builder.add_document(doc, [len(doc)])
        builder.finalize(str(work / "w_mc") + ".idx")

    writers = {"ours": ours_per_document, "ours_packed": ours_packed}
    if mc is not None:
        writers["megatron"] = megatron
    best = {name: float("inf") for name in writers}
    for _ in range(repeats):
        for name, write in writers.items():
            t = time.perf_counter()
            write()
            best[name] = min(best[name], time.perf_counter() - t)
    return {f"{name}_mb_per_s": total_mb / seconds for name, seconds in best.items()}


def bench_access(args: argparse.Namespace, mc: Any, prefix: Path) -> dict[str, float]:
    """Random GPT samples per second; random documents per second (ours and megatron-core's reader)."""
    from megatron_sp.data.gpt_dataset import GPTDataset

    ours = IndexedDataset(prefix)
    n_samples = 4 * ours.num_tokens // args.seq
    ds = GPTDataset(ours, np.arange(ours.num_documents), args.seq, n_samples, seed=1, cache_dir=None, name="bench")
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(ds), size=args.accesses)
    t = time.perf_counter()
    for i in picks:
        ds[int(i)]
    seconds = time.perf_counter() - t
    result = {"samples_per_s": args.accesses / seconds,
              "sample_mb_per_s": args.accesses * (args.seq + 1) * ours.dtype.itemsize / 1e6 / seconds}
    docs = rng.integers(0, ours.num_documents, size=args.accesses)
    readers = {"ours": lambda d: ours.get_document(int(d))}
    if mc is not None:
        theirs = mc.IndexedDataset(str(prefix))
        readers["megatron"] = lambda d: theirs[int(d)]  # one sequence per document
    for name, read in readers.items():
        t = time.perf_counter()
        for d in docs:
            np.asarray(read(d)).sum()  # touch the tokens
        result[f"{name}_documents_per_s"] = args.accesses / (time.perf_counter() - t)
    return result


def bench_loader(args: argparse.Namespace, prefix: Path, tokenizer: Tokenizer) -> dict[str, float]:
    """Seconds a demo-sized step waits for its batch, as a fraction of the step, for 0 and 1 loader workers."""
    import torch

    from megatron_sp.data.gpt_dataset import GPTDataset
    from megatron_sp.data.loader import BatchLoader, rank_collate
    from megatron_sp.model import GPTModel

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = gpt_config(args, tokenizer.vocab_size, arch="neox", num_layers=4, hidden_size=256, num_heads=4)
    model = GPTModel(cfg.model, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gbs, dp, micro = 16, 2, 4  # configs/demo.yml: this rank's 8 samples in 2 micro-batches
    indexed = IndexedDataset(prefix)
    warmup = 2
    ds = GPTDataset(indexed, np.arange(indexed.num_documents), args.seq, (args.steps + warmup) * gbs * 2, seed=1,
                    cache_dir=None, name="bench")
    collate_fn = rank_collate(tokenizer.eod, False, True, True)

    def step(batch: dict[str, torch.Tensor]) -> None:
        optimizer.zero_grad(set_to_none=True)
        for k in range(0, batch["tokens"].shape[0], micro):
            mb = {key: v[k:k + micro] for key, v in batch.items()}
            loss = model(mb["tokens"], position_ids=mb["position_ids"], labels=mb["labels"],
                         document_ids=mb["document_ids"]).mean()
            loss.backward()
        optimizer.step()

    result: dict[str, float] = {}
    for workers in (0, 1):
        loader = BatchLoader(ds, 0, gbs, 0, dp, collate_fn, num_workers=workers, prefetch_factor=2)
        waits, steps = [], []
        for k in range(warmup + args.steps):
            t0 = time.perf_counter()
            batch = next(loader)
            t1 = time.perf_counter()
            step(batch)
            t2 = time.perf_counter()
            if k >= warmup:
                waits.append(t1 - t0)
                steps.append(t2 - t0)
        loader.close()
        result[f"workers{workers}_wait_ms"] = 1e3 * float(np.median(waits))
        result[f"workers{workers}_step_ms"] = 1e3 * float(np.median(steps))
        result[f"workers{workers}_fraction"] = float(np.median(waits) / np.median(steps))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the three parts, print the table and the JSON line; returns the report."""
    args = parse_args(argv)
    mc = import_megatron()
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus = work / "corpus.jsonl"
        if not corpus.is_file():
            make_demo_corpus(corpus, max_bytes=args.max_bytes)
        model = work / "tokenizer.model"
        if not model.is_file():
            train_sentencepiece([corpus], work / "tokenizer", args.vocab)
        tokenizer = build_tokenizer(TokenizerConfig(type="sentencepiece", model=str(model)))
        preprocess = bench_preprocess(args, mc, work, corpus, tokenizer)
        prefix = work / "ours_text_document"
        dataset = IndexedDataset(prefix)
        writers = bench_writers(mc, work, dataset, args.repeats)
        access = bench_access(args, mc, prefix)
        loader = bench_loader(args, prefix, tokenizer)
    report = {"bench": "data", "config": vars(args), "megatron_core": mc is not None,
              "corpus": {"documents": dataset.num_documents, "tokens": dataset.num_tokens,
                         "bytes": int(preprocess[0]["ours_mb_per_s"] * preprocess[0]["ours_seconds"] * 1e6),
                         "dtype": str(best_dtype(tokenizer.vocab_size))},
              "preprocess": preprocess, "writers": writers, "access": access, "loader": loader}
    print_report(report)
    return report


def print_report(r: dict[str, Any]) -> None:
    """The table, then the JSON line."""
    na = "-"
    c = r["corpus"]
    print(f"corpus: {c['documents']} documents, {c['bytes'] / 1e6:.1f} MB, {c['tokens']} tokens ({c['dtype']})")
    print(f"{'preprocess':<12} {'ours docs/s':>11} {'ours MB/s':>9} {'megatron docs/s':>15} {'megatron MB/s':>13} "
          f"{'ours/megatron':>13}")
    for row in r["preprocess"]:
        mega = (f"{row['megatron_docs_per_s']:15.1f} {row['megatron_mb_per_s']:13.2f} {row['ratio']:12.2f}x"
                if "ratio" in row else f"{na:>15} {na:>13} {na:>13}")
        print(f"{row['workers']:>2} worker(s) {row['ours_docs_per_s']:11.1f} {row['ours_mb_per_s']:9.2f} {mega}")
    w = r["writers"]
    mega = f"{w['megatron_mb_per_s']:.0f}" if "megatron_mb_per_s" in w else na
    print(f"writers (token MB/s): ours per document {w['ours_mb_per_s']:.0f}, ours packed {w['ours_packed_mb_per_s']:.0f}, "
          f"megatron-core builder {mega}")
    a = r["access"]
    mega = f"{a['megatron_documents_per_s']:.0f}" if "megatron_documents_per_s" in a else na
    print(f"random access: {a['samples_per_s']:.0f} GPT samples/s ({a['sample_mb_per_s']:.1f} MB/s); documents/s "
          f"ours {a['ours_documents_per_s']:.0f}, megatron-core {mega}")
    lo = r["loader"]
    for workers in (0, 1):
        print(f"loader, {workers} worker(s): waits {lo[f'workers{workers}_wait_ms']:.3f} ms of a "
              f"{lo[f'workers{workers}_step_ms']:.0f} ms demo step = {100 * lo[f'workers{workers}_fraction']:.3f}% "
              f"(goal < 2%)")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
