"""Training data for `adapt`: text from local files (plain text, source code, jsonl, json, parquet),
folders of them, or a Hub dataset already in the local cache, read through `datasets`, tokenised and
packed into rows of `seq_len` tokens.

A row holds several documents back to back, each followed by the end-of-text token, with
`position_ids` restarting at each document and the label of each document's first token ignored
(the layout of Transformers' `DataCollatorWithFlattening`). The model keeps packed documents apart
(`modeling/packing.py`), so no document attends to another. A document longer than what is left of
a row continues in the next row as a new piece (positions restart there too).
"""

from __future__ import annotations

from pathlib import Path

#: file suffixes read as tables (one document per record, from `text_field`); every other file is text
TABLE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
IGNORE_INDEX = -100


class DataError(ValueError):
    """Training or evaluation data that cannot be read: the message names the problem and the fix."""


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


def load_texts(sources: list[str], text_field: str = "text", text_unit: str = "document",
               split: str = "train"):
    """A `datasets.Dataset` with one column, `text`, one document per row.

    `sources`: files, folders (every file below, recursively) or the name of a Hub dataset already in
    the local cache. Text files give one document per file (`text_unit="document"`), per blank-line
    separated paragraph ("paragraph") or per line ("line"); jsonl / json / parquet files give one per
    record, read from `text_field`."""
    try:
        from datasets import concatenate_datasets, load_dataset
    except ImportError as e:
        raise DataError(f"reading training data needs the datasets package ({e}); pip install datasets") from None
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
            if Path(source).expanduser().exists():
                raise DataError(f"{source} is neither a readable file nor a folder")
            if source.startswith(("/", ".", "~")) or Path(source).suffix:
                raise DataError(f"{source} does not exist; check the path")
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
                                f"({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
            parts.append(_text_column(ds, text_field, source))
        if texts:
            ds = load_dataset("text", data_files=[str(f) for f in texts], split="train",
                              sample_by="document" if text_unit == "document" else text_unit)
            parts.append(ds)
    ds = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    ds = ds.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True)
    if len(ds) == 0:
        raise DataError(f"no text found in {', '.join(sources)}")
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


def tokenize_and_pack(texts, tokenizer, seq_len: int, num_proc: int | None = None):
    """The documents of `texts` (a Dataset with a `text` column) as packed rows of `seq_len` tokens."""
    if seq_len < 2:
        raise DataError(f"--seq-len must be at least 2, got {seq_len}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no end-of-text token; set tokenizer.eos_token in the model folder")

    def pack(batch):
        docs = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return pack_rows([d + [eos] for d in docs], seq_len)

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
