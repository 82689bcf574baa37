"""`subquadratic.data`: packing, the training batches, evaluation windows, the dtype names, and one
clear DataError for every kind of unusable data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from subquadratic.data import (
    DTYPE_CHOICES,
    DTYPE_NAMES,
    IGNORE_INDEX,
    DataError,
    batches,
    load_stream,
    load_texts,
    pack_rows,
    torch_dtype,
    windows,
)


def test_pack_rows_restart_positions_and_ignore_each_first_label():
    rows = pack_rows([[1, 2, 3], [4, 5, 6, 7, 8], [9]], seq_len=4)
    assert rows["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8]]  # the tail [9] does not fill a row
    assert rows["position_ids"] == [[0, 1, 2, 0], [0, 1, 2, 3]]  # the second document continues as a piece
    assert rows["labels"] == [[IGNORE_INDEX, 2, 3, IGNORE_INDEX], [IGNORE_INDEX, 6, 7, 8]]


def rows_of(n: int):
    """n packed rows (a torch-format Dataset, as `tokenize_and_pack` returns) whose tokens are the row's index."""
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [[i] * 3 for i in range(n)]}).with_format("torch")


def drawn(stream, k: int) -> list[list[int]]:
    return [next(stream)["input_ids"][:, 0].tolist() for _ in range(k)]


def test_batches_split_each_epoch_between_processes_and_resume_where_they_stopped():
    rows = rows_of(10)  # 2 processes x 2 rows: 2 micro-batches per epoch, 2 rows left out of each epoch
    a, b = (drawn(batches(rows, 2, seed=3, rank=r, world=2), 6) for r in (0, 1))
    for epoch in range(3):
        seen = [i for mb in (a[2 * epoch: 2 * epoch + 2] + b[2 * epoch: 2 * epoch + 2]) for i in mb]
        assert len(set(seen)) == 8  # no row twice within an epoch, across both processes
    assert a[:2] != a[2:4]  # a fresh permutation each epoch
    assert drawn(batches(rows, 2, seed=3, skip=3, rank=1, world=2), 3) == b[3:]  # resuming mid-epoch
    assert drawn(batches(rows, 2, seed=4, rank=0, world=2), 2) != a[:2]  # the seed decides the order


def test_rows_short_of_one_batch_are_an_error_before_any_batch_is_drawn():
    with pytest.raises(DataError, match="the data makes 3 packed rows, fewer than one batch of 2 x 2"):
        batches(rows_of(3), 2, seed=0, world=2)


def test_too_few_tokens_for_a_window_is_an_error():
    assert windows(torch.arange(10), 4, max_windows=1).tolist() == [[0, 1, 2, 3]]
    with pytest.raises(DataError, match="fewer than one window of 64"):
        windows(torch.arange(10), 64)


@pytest.mark.parametrize(("name", "content", "field", "expect"), [
    ("missing.jsonl", None, "text", "does not exist; check the path"),
    ("empty.txt", "  \n", "text", "no text found"),
    ("a.jsonl", '{"body": "x"}\n', "text", "has no column 'text' (columns: body); name the text column"),
    ("a.jsonl", "{not json\n", "text", "cannot read"),
])
def test_bad_data_files_are_one_clear_error(tmp_path, name, content, field, expect):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=expect.replace("(", r"\(").replace(")", r"\)")) as e:
        load_texts(tmp_path / name, field)
    assert str(tmp_path / name) in str(e.value) and "\n" not in str(e.value)


def test_a_missing_held_out_file_names_the_file():
    with pytest.raises(DataError, match="missing.txt does not exist; give a text"):
        load_stream("missing.txt", tokenizer=None)


def test_one_dtype_map():
    assert DTYPE_CHOICES == ("auto", *DTYPE_NAMES)
    assert [torch_dtype(n) for n in DTYPE_NAMES] == [torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(ValueError, match="unknown dtype 'float64'; use float32, bfloat16, float16"):
        torch_dtype("float64")


def test_the_module_imports_neither_torch_nor_datasets():
    """The command line reads DTYPE_CHOICES for --help and runs the checks that need no model before
    anything heavy: importing `subquadratic.data` and `subquadratic.checks` leaves torch, datasets and
    Transformers unimported."""
    import subquadratic

    code = ("import sys; import subquadratic.data, subquadratic.checks; "
            "print(sorted({'torch', 'datasets', 'transformers'} & set(sys.modules)))")
    root = str(Path(subquadratic.__file__).parent.parent)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
