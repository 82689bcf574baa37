"""Held-out text for perplexity and KL: a text, jsonl / json or parquet file read with `datasets`, turned
into one token stream, then cut into non-overlapping windows.

The stream is each document's tokens (no special tokens added) followed by the tokenizer's EOS id
when it has one, documents in file order; a .txt file is one document.
"""

from __future__ import annotations

from pathlib import Path

import torch


class EvaluationError(Exception):
    """A problem with the user's input to an evaluation: printed as one line, exit code 2."""


def load_texts(path: str | Path, text_field: str = "text") -> list[str]:
    """The documents of a held-out file, read as `adapt` reads its data (`adaptation.data.load_texts`):
    a text or source file is one document; .jsonl / .json / .parquet give the `text_field` column of
    every row."""
    from ..adaptation.data import DataError
    from ..adaptation.data import load_texts as read

    path = Path(path).expanduser()
    if not path.is_file():
        raise EvaluationError(f"data file {path} does not exist; give a text, .jsonl, .json or .parquet file")
    try:
        return list(read([str(path)], text_field)["text"])
    except DataError as e:
        raise EvaluationError(str(e)) from None


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
