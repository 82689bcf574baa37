"""Text data for the whole package, below adaptation and evaluation: reading text files (plain text,
source code, jsonl, json, parquet), folders of them, or a Hub dataset already in the local cache,
through `datasets`; tokenising; packing documents into training rows and cutting a token stream
into evaluation windows; the training batches; the one error for data that cannot be used
(`DataError`); and the one dtype map (`DTYPE_NAMES`, `torch_dtype`).

Training rows (`tokenize_and_pack`): a row holds several documents back to back, each followed by the
end-of-text token, with `position_ids` restarting at each document and the label of each document's
first token ignored (the layout of Transformers' `DataCollatorWithFlattening`). The model keeps
packed documents apart (`modeling/packing.py`), so no document attends to another. A document longer
than what is left of a row continues in the next row as a new piece (positions restart there too).

Evaluation windows (`load_stream`, `windows`): the documents' tokens, each followed by the EOS id
when the tokenizer has one, in file order, as one stream cut into non-overlapping windows.

The module imports neither torch nor `datasets` at import time (the command line reads
`DTYPE_CHOICES` for its --help), only in the functions that use them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .checks import InputError, data_problem

if TYPE_CHECKING:
    import torch
    from datasets import Dataset

#: file suffixes read as tables (one document per record, from `text_field`); every other file is text
TABLE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
IGNORE_INDEX = -100
#: the dtypes weights are loaded or written in, by name (torch's names); `torch_dtype` gives the dtype
DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: what a --dtype accepts: "auto" (the checkpoint's own dtype) or one of DTYPE_NAMES
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)


class DataError(InputError):
    """Data that cannot be used (a file that does not exist or does not parse, no text, too few
    tokens): the message names the problem and the fix, printed as one line with exit status 2."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name in `DTYPE_NAMES`."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; use {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def _expand(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in
                                                                              p.relative_to(path).parts))
        if not files:
            raise DataError(f"{path} holds no files; give text, jsonl or parquet files or a folder of them")
        return files
    if path.is_file():
        return [path]
    return []


def load_texts(sources: str | os.PathLike | Sequence[str | os.PathLike], text_field: str = "text",
               text_unit: str = "document", split: str = "train") -> Dataset:
    """A `datasets.Dataset` with one column, `text`, one document per row.

    `sources`: a path or a list of them: files, folders (every file below, recursively) or the name
    of a Hub dataset already in the local cache. Text files give one document per file
    (`text_unit="document"`), per blank-line separated paragraph ("paragraph") or per line ("line");
    jsonl / json / parquet files give one per record, read from `text_field`."""
    try:
        from datasets import concatenate_datasets, load_dataset
    except ImportError as e:
        raise DataError(f"reading text data needs the datasets package ({e}); pip install datasets") from None
    sources = [str(sources)] if isinstance(sources, str | os.PathLike) else [str(s) for s in sources]
    if text_unit not in ("document", "paragraph", "line"):
        raise DataError(f"unknown text unit {text_unit!r}; use document, paragraph or line")
    if not sources:
        raise DataError("no data given; pass --data with text, jsonl or parquet files, folders, "
                        "or a cached Hub dataset")
    from datasets.utils.logging import disable_progress_bar, enable_progress_bar, is_progress_bar_enabled

    shown = is_progress_bar_enabled()
    disable_progress_bar()  # reading local files is quick; the packing below has its own bar
    try:
        return _load_texts(sources, text_field, text_unit, split, load_dataset, concatenate_datasets)
    finally:
        if shown:
            enable_progress_bar()


def _load_texts(sources, text_field, text_unit, split, load_dataset, concatenate_datasets):
    parts = []
    for source in sources:
        files = _expand(source)
        if not files:
            if (problem := data_problem(source)) is not None:
                raise DataError(problem)
            try:
                ds = load_dataset(source, split=split)
            except Exception as e:
                raise DataError(f"{source} is not a local file or folder, and loading it as a Hub dataset failed "
                                f"({type(e).__name__}: {' '.join(str(e).split())[:160]}); give a path, or download "
                                "the dataset first (datasets.load_dataset with the network)") from None
            parts.append(_text_column(ds, text_field, source))
            continue
        tables = [f for f in files if f.suffix in TABLE_BUILDERS]
        texts = [f for f in files if f.suffix not in TABLE_BUILDERS]
        for builder in sorted({TABLE_BUILDERS[f.suffix] for f in tables}):
            chosen = [str(f) for f in tables if TABLE_BUILDERS[f.suffix] == builder]
            try:
                ds = load_dataset(builder, data_files=chosen, split="train")
            except Exception as e:
                raise DataError(f"cannot read {chosen[0]}{' ...' if len(chosen) > 1 else ''} as {builder} "
                                f"({type(e).__name__}: {' '.join(str(e).split())[:160]}); fix the file or leave "
                                "it out") from None
            parts.append(_text_column(ds, text_field, source))
        if texts:
            ds = load_dataset("text", data_files=[str(f) for f in texts], split="train",
                              sample_by="document" if text_unit == "document" else text_unit)
            parts.append(ds)
    ds = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    ds = ds.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True)
    if len(ds) == 0:
        raise DataError(f"no text found in {', '.join(sources)}; give files that hold text")
    return ds


def _text_column(ds, text_field: str, source: str):
    if text_field not in ds.column_names:
        raise DataError(f"{source} has no column {text_field!r} (columns: {', '.join(ds.column_names)}); "
                        "name the text column with --text-field")
    ds = ds.select_columns([text_field])
    return ds.rename_column(text_field, "text") if text_field != "text" else ds


def pack_rows(documents: list[list[int]], seq_len: int) -> dict[str, list[list[int]]]:
    """Documents (token ids, end token included) -> rows of exactly `seq_len`: input_ids, position_ids
    restarting at each piece, labels with each piece's first token ignored. The tokens left after the
    last full row are dropped."""
    rows = {"input_ids": [], "position_ids": [], "labels": []}
    ids, pos, labels = [], [], []
    for doc in documents:
        while doc:
            room = seq_len - len(ids)
            piece, doc = doc[:room], doc[room:]
            ids += piece
            pos += range(len(piece))
            labels += [IGNORE_INDEX, *piece[1:]]
            if len(ids) == seq_len:
                rows["input_ids"].append(ids)
                rows["position_ids"].append(pos)
                rows["labels"].append(labels)
                ids, pos, labels = [], [], []
    return rows


def tokenize(texts: Sequence[str], tokenizer) -> list[list[int]]:
    """Each document's token ids (no special tokens added), followed by the end-of-text id when the
    tokenizer has one."""
    end = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return [ids + end for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def tokenize_and_pack(texts: Dataset, tokenizer, seq_len: int, num_proc: int | None = None) -> Dataset:
    """The documents of `texts` (a Dataset with a `text` column) as packed rows of `seq_len` tokens
    (columns input_ids, position_ids, labels; torch format)."""
    if seq_len < 2:
        raise DataError(f"--seq-len must be at least 2, got {seq_len}")
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no end-of-text token; set tokenizer.eos_token in the model folder")

    def pack(batch):
        return pack_rows(tokenize(batch["text"], tokenizer), seq_len)

    from datasets.utils.logging import disable_progress_bar, enable_progress_bar, is_progress_bar_enabled

    shown = is_progress_bar_enabled()
    if len(texts) < 2000:  # a bar only where tokenising takes a while
        disable_progress_bar()
    try:
        rows = texts.map(pack, batched=True, batch_size=256, remove_columns=texts.column_names, num_proc=num_proc,
                         desc="tokenising and packing")
    finally:
        if shown:
            enable_progress_bar()
    if len(rows) == 0:
        raise DataError(f"the data holds fewer than {seq_len} tokens, not one full row; give more text or a "
                        "smaller --seq-len")
    return rows.with_format("torch")


#: copied passages per recall row, and their lengths in tokens (uniform in [lo, hi])
RECALL_COPIES = 4
RECALL_PASSAGE = (32, 256)


def recall_row(ids: list[int], rng) -> dict[str, list[int]]:
    """A packed row made a recall row: one document (positions 0..T-1, every label but the first
    kept), in which RECALL_COPIES passages of RECALL_PASSAGE tokens are written again further on, at
    distances drawn log-uniformly between the passage's length and the row's, so that predicting
    them needs what came far back (a dense teacher copies them; a student learns to)."""
    import math

    ids = list(ids)
    T = len(ids)
    lo, hi = RECALL_PASSAGE
    for _ in range(RECALL_COPIES):
        P = rng.randint(min(lo, T // 4), max(min(hi, T // 4), 1))
        if P < 2 or T - P - 1 <= P:
            break
        d = int(math.exp(rng.uniform(math.log(P), math.log(T - P - 1))))
        s = rng.randint(1, T - P - d)
        ids[s + d:s + d + P] = ids[s:s + P]
    return {"input_ids": ids, "position_ids": list(range(T)), "labels": [IGNORE_INDEX, *ids[1:]]}


def with_recall_rows(rows, share: float, seed: int):
    """`rows` (packed rows) with the share `share` of them, chosen by a seeded draw per row index, made
    recall rows (`recall_row`); the rest as they were. share 0: `rows` itself."""
    if share <= 0:
        return rows
    import random

    def convert(batch, indices):
        out = {k: [] for k in ("input_ids", "position_ids", "labels")}
        for i, idx in enumerate(indices):
            rng = random.Random(f"{seed}-recall-{idx}")
            row = ({k: list(map(int, batch[k][i])) for k in out} if rng.random() >= share
                   else recall_row(list(map(int, batch["input_ids"][i])), rng))
            for k in out:
                out[k].append(row[k])
        return out

    return rows.with_format(None).map(convert, with_indices=True, batched=True, batch_size=64,
                                      desc="recall rows").with_format("torch")


def batches(rows, batch_size: int, seed: int, skip: int = 0, rank: int = 0, world: int = 1) -> Iterator[dict]:
    """Endless micro-batches of `rows` (packed rows, torch format) for training: each epoch a fresh
    permutation (seeded by seed + epoch), one share of `batch_size` rows per process (`rank` of
    `world`), the first `skip` micro-batches passed over (resuming). Rows that do not fill a batch of
    every process are an error here, before any batch is drawn."""
    per_epoch = len(rows) // (batch_size * world)
    if per_epoch == 0:
        raise DataError(f"the data makes {len(rows)} packed rows, fewer than one batch of {batch_size} x {world} "
                        "process(es); give more data, or lower --batch-size / --seq-len")
    return _epochs(rows, batch_size, seed, skip, rank, world, per_epoch)


def _epochs(rows, batch_size: int, seed: int, skip: int, rank: int, world: int, per_epoch: int) -> Iterator[dict]:
    import torch

    epoch = skip // per_epoch
    n = epoch * per_epoch  # micro-batches before this epoch
    while True:
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + epoch))
        for i in range(per_epoch):
            if n >= skip:
                start = (i * world + rank) * batch_size
                yield rows[order[start: start + batch_size]]
            n += 1
        epoch += 1


def token_stream(texts: Sequence[str], tokenizer) -> torch.Tensor:
    """[N] int64: the documents' tokens (`tokenize`), one after the other."""
    import torch

    return torch.tensor([i for ids in tokenize(texts, tokenizer) for i in ids], dtype=torch.long)


def load_stream(path: str | os.PathLike, tokenizer, text_field: str = "text") -> torch.Tensor:
    """[N] int64: the token stream (`token_stream`) of a held-out file, read as `load_texts` reads it:
    a text or source file is one document; .jsonl / .json / .parquet give the `text_field` column of
    every row."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; give a text, .jsonl, .json or .parquet file")
    return token_stream(load_texts(path, text_field)["text"], tokenizer)


def windows(ids: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """[n, seq_len]: the first n non-overlapping windows of the stream `ids` [N],
    n = min(N // seq_len, max_windows)."""
    n = ids.numel() // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise DataError(f"the data has {ids.numel()} tokens, fewer than one window of {seq_len}; "
                        "give a longer file or a shorter --seq-len")
    return ids[: n * seq_len].view(n, seq_len)
