"""collate with packed documents: positions that restart after end-of-document tokens, and document ids."""
from __future__ import annotations

import numpy as np
import torch

from megatron_sp.config.loader import apply_override
from megatron_sp.config.schema import Config, DataConfig
from megatron_sp.data import collate

EOD = 0


def _samples() -> list[np.ndarray]:
    # s + 1 = 10 tokens per sample; tokens = sample[:-1] has eods at 2 and 5 (row 0), 0 (row 1), 8 (row 2),
    # none in row 3 (its only eod is the last label)
    return [np.array([5, 6, EOD, 7, 8, EOD, 9, 10, 11, 12]),
            np.array([EOD, 3, 4, 5, 6, 7, 8, 9, 10, 11]),
            np.array([1, 2, 3, 4, 5, 6, 7, 8, EOD, 13]),
            np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, EOD])]


def test_collate_reset_position_ids_and_document_ids() -> None:
    batch = collate(_samples(), eod=EOD, eod_mask_loss=False, reset_position_ids=True, reset_attention_mask=True)
    assert batch["position_ids"].tolist() == [
        [0, 1, 2, 0, 1, 2, 0, 1, 2],  # the eod is the last token of its document; the next token starts at 0
        [0, 0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 2, 3, 4, 5, 6, 7, 8],  # an eod as last token: nothing restarts inside the sample
        [0, 1, 2, 3, 4, 5, 6, 7, 8],  # an eod only among the labels does not count
    ]
    assert batch["document_ids"].tolist() == [
        [0, 0, 0, 1, 1, 1, 2, 2, 2],  # eods strictly before: the eod belongs to the document it ends
        [0, 1, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert batch["position_ids"].dtype == batch["document_ids"].dtype == torch.int64
    assert all(t.shape == (4, 9) for t in batch.values())
    # tokens, labels and the loss mask do not depend on the packing flags
    plain = collate(_samples(), eod=EOD, eod_mask_loss=False)
    for name in ("tokens", "labels", "loss_mask"):
        assert torch.equal(batch[name], plain[name])


def test_collate_flags_are_independent() -> None:
    positions_only = collate(_samples(), eod=EOD, eod_mask_loss=False, reset_position_ids=True)
    assert "document_ids" not in positions_only
    assert positions_only["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    ids_only = collate(_samples(), eod=EOD, eod_mask_loss=False, reset_attention_mask=True)
    assert ids_only["position_ids"].tolist() == [list(range(9))] * 4
    assert ids_only["document_ids"][0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_collate_defaults_unchanged() -> None:
    batch = collate(_samples(), eod=EOD, eod_mask_loss=True)
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert batch["position_ids"].tolist() == [list(range(9))] * 4
    assert batch["tokens"][0].tolist() == [5, 6, EOD, 7, 8, EOD, 9, 10, 11]
    assert batch["labels"][0].tolist() == [6, EOD, 7, 8, EOD, 9, 10, 11, 12]
    # Megatron's rule: the positions whose *input* is an eod leave the loss (the guess of the next
    # document's first token); the positions that predict an eod stay in it (the model learns to end)
    assert batch["loss_mask"][0].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert batch["loss_mask"][1].tolist() == [0.0] + [1.0] * 8  # an eod at position 0
    assert batch["loss_mask"][2].tolist() == [1.0] * 8 + [0.0]  # an eod as the last input token
    assert batch["loss_mask"][3].tolist() == [1.0] * 9  # an eod only among the labels is trained


def test_collate_matches_a_token_loop_on_random_samples() -> None:
    rng = np.random.default_rng(3)
    samples = list(rng.integers(0, 4, size=(6, 33)))  # EOD = 0 is frequent, runs of eods included
    batch = collate(samples, eod=EOD, eod_mask_loss=False, reset_position_ids=True, reset_attention_mask=True)
    for row, sample in enumerate(samples):
        position, document, positions, documents = 0, 0, [], []
        for token in sample[:-1]:
            positions.append(position)
            documents.append(document)
            position += 1
            if token == EOD:
                position, document = 0, document + 1
        assert batch["position_ids"][row].tolist() == positions
        assert batch["document_ids"][row].tolist() == documents


def test_data_config_packing_fields() -> None:
    cfg = Config()
    assert cfg.data.reset_position_ids is False and cfg.data.reset_attention_mask is False
    docs = {f.name: f.metadata.get("doc") for f in DataConfig.__dataclass_fields__.values()}
    assert docs["reset_position_ids"] and docs["reset_attention_mask"]
    apply_override(cfg, "data.reset_position_ids=true")
    apply_override(cfg, "data.reset_attention_mask=true")
    assert cfg.data.reset_position_ids is True and cfg.data.reset_attention_mask is True


def test_packing_metadata_at_document_edges_of_dataset_samples(tmp_path) -> None:
    """Through the GPT dataset: a document that starts inside a sample gets positions 0, 1, ... (its own
    token offsets) and its own document id; edges at the first and last token of a sample included."""
    from megatron_sp.data.gpt_dataset import GPTDataset
    from megatron_sp.data.indexed import IndexedDataset, IndexedDatasetWriter

    rng = np.random.default_rng(1)
    with IndexedDatasetWriter(tmp_path / "docs", np.int32) as writer:
        for d in range(1, 30):  # document d: d*100 + 1, d*100 + 2, ... then EOD
            n = int(rng.integers(1, 12))
            tokens = np.concatenate([d * 100 + 1 + np.arange(n), [EOD]])
            lengths = [1, n] if n > 1 and d % 3 == 0 else None  # some documents of two sequences
            writer.add_document(tokens, lengths)
        writer.add_document([])  # a document without tokens: no EOD, no edge
    ds = GPTDataset(IndexedDataset(tmp_path / "docs"), np.arange(30), 8, 120, seed=2, cache_dir=None, name="train")
    samples = [ds[i] for i in range(len(ds))]
    batch = collate(samples, eod=EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    edges = {"starts with eod": 0, "eod last input": 0, "doc starts at 0": 0}
    for row, sample in enumerate(samples):
        tokens = sample[:-1]
        positions, documents = batch["position_ids"][row].tolist(), batch["document_ids"][row].tolist()
        first_doc = -1 if tokens[0] == EOD else (int(tokens[0]) - 1) // 100  # the document at token 0, if any
        for p, token in enumerate(tokens.tolist()):
            if token == EOD:
                continue
            doc, offset = divmod(token - 1, 100)
            if doc != first_doc or (p == offset == 0):  # a document that starts inside the sample
                assert positions[p] == offset, (row, p)
            else:  # the partial first document counts from the sample's start
                assert positions[p] == p
            # same source document <=> same id (the eod belongs to the document it ends)
            assert documents[p] == sum(1 for t in tokens[:p] if t == EOD)
        assert batch["loss_mask"][row].tolist() == [0.0 if t == EOD else 1.0 for t in tokens]  # Megatron: input eods
        edges["starts with eod"] += int(tokens[0] == EOD)
        edges["eod last input"] += int(tokens[-1] == EOD)
        edges["doc starts at 0"] += int(tokens[0] % 100 == 1)
    assert all(edges.values()), edges  # every edge case occurred in these samples
