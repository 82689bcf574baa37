"""Recall rows (`adapt --recall-share`): a share of the packed rows made one document each, with
passages copied further on; the rest untouched; deterministic per seed."""

from __future__ import annotations

import random

import pytest
import torch
from datasets import Dataset

from subquadratic.data import IGNORE_INDEX, RECALL_COPIES, pack_rows, recall_row, with_recall_rows


def _rows(n_docs: int = 80, T: int = 512):
    docs = [list(range(1000 + 300 * i, 1000 + 300 * i + 250)) for i in range(n_docs)]  # distinct tokens
    return Dataset.from_dict(pack_rows(docs, T)).with_format("torch")


def test_a_recall_row_is_one_document_with_passages_copied_far_on():
    T = 2048
    ids = list(range(10_000, 10_000 + T))  # distinct: every repeated token is a copy
    row = recall_row(ids, random.Random(0))
    assert row["position_ids"] == list(range(T)) and row["labels"] == [IGNORE_INDEX, *row["input_ids"][1:]]
    out = row["input_ids"]
    assert len(out) == T
    moved = [t for t in range(T) if out[t] != ids[t]]  # positions written by a copy
    assert moved, "no passage was copied"
    # each written token is an earlier token of the row (what a copy means), from at least 32 back
    distances = {t - (out[t] - 10_000) for t in moved}
    assert min(distances) >= 32 and max(distances) < T
    runs = 1 + sum(1 for a, b in zip(moved, moved[1:], strict=False) if b != a + 1)
    assert 1 <= runs <= RECALL_COPIES


def test_with_recall_rows_takes_its_share_and_keeps_the_rest():
    rows = _rows()
    assert with_recall_rows(rows, 0.0, 0) is rows
    mixed = with_recall_rows(rows, 0.5, 0)
    again = with_recall_rows(rows, 0.5, 0)
    changed = [i for i in range(len(rows)) if not torch.equal(rows[i]["input_ids"], mixed[i]["input_ids"])]
    assert 0.2 * len(rows) <= len(changed) <= 0.8 * len(rows)
    for i in range(len(rows)):
        assert torch.equal(mixed[i]["input_ids"], again[i]["input_ids"])  # the same seed: the same rows
        if i not in changed:
            for k in ("input_ids", "position_ids", "labels"):
                assert torch.equal(mixed[i][k], rows[i][k])
        else:
            assert torch.equal(mixed[i]["position_ids"], torch.arange(rows[i]["input_ids"].numel()))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in
               zip(with_recall_rows(rows, 1.0, 1), with_recall_rows(rows, 1.0, 1), strict=True))
    assert not all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in
                   zip(with_recall_rows(rows, 1.0, 1), with_recall_rows(rows, 1.0, 2), strict=True))


def test_recall_share_out_of_range_is_one_line():
    from subquadratic.adaptation import AdaptConfig
    from subquadratic.adaptation.train import AdaptError

    cfg = AdaptConfig(student="a", output_dir="b", data=["c"], recall_share=1.5)
    with pytest.raises(AdaptError, match=r"--recall-share must lie in 0..1, got 1.5"):
        cfg.check()
