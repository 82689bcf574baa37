"""Held-out text for perplexity and KL: a text, jsonl / json or parquet file read with `datasets`, turned
into one token stream, then cut into non-overlapping windows.

The stream is each document's tokens (no special tokens added) followed by the tokenizer's EOS id
when it has one, documents in file order; a .txt file is one document.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

#: File suffixes `load_texts` reads, and the `datasets` builder of each.
BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class EvaluationError(Exception):
    """A problem with the user's input to an evaluation: printed as one line, exit code 2."""


def load_texts(path: str | Path, text_field: str = "text") -> list[str]:
    """The documents of a held-out file: a .txt file is one document; .jsonl / .json / .parquet give the
    `text_field` column of every row."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise EvaluationError(f"data file {path} does not exist; give a .txt, .jsonl, .json or .parquet file")
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise EvaluationError(f"data file {path} has suffix {path.suffix or '(none)'}; use one of "
                              f"{', '.join(BUILDERS)}")
    try:
        import datasets
    except ImportError:
        raise EvaluationError("reading --data needs the datasets package: pip install datasets "
                              "(or pip install 'subquadratic[eval]')") from None
    kw = {"sample_by": "document"} if builder == "text" else {}
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory() as cache:  # nothing left behind in the datasets cache
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache,
                                       keep_in_memory=True, **kw)
            if text_field not in ds.column_names:
                raise EvaluationError(f"data file {path} has no column {text_field!r} (columns: "
                                      f"{', '.join(ds.column_names)}); pass --text-field NAME")
            texts = [t for t in ds[text_field] if t]
    except EvaluationError:
        raise
    except Exception as e:  # malformed json, a parquet file that is not one
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)[:160]
        raise EvaluationError(f"could not read {path} ({first}); check that it is valid {builder}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    if not texts:
        raise EvaluationError(f"data file {path} has no text")
    return texts


def token_stream(texts: list[str], tokenizer) -> torch.Tensor:
    """[N] int64: the documents' tokens, each followed by the EOS id when the tokenizer has one."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for piece in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(piece)
        ids.extend(eos)
    return torch.tensor(ids, dtype=torch.long)


def windows(ids: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """[n, seq_len]: the first n non-overlapping windows of the stream, n = min(N // seq_len, max_windows)."""
    n = ids.numel() // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise EvaluationError(f"the data has {ids.numel()} tokens, fewer than one window of {seq_len}; "
                              "give a longer file or a shorter --seq-len")
    return ids[: n * seq_len].view(n, seq_len)


def load_stream(path: str | Path, tokenizer, text_field: str = "text") -> torch.Tensor:
    """`token_stream(load_texts(path, text_field), tokenizer)`."""
    return token_stream(load_texts(path, text_field), tokenizer)
