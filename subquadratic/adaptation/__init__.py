"""Adapting converted models: the data pipeline (`data.py`) and `subquadratic adapt` (`train.py`)."""

from .data import DataError, load_texts, pack_rows, tokenize_and_pack
from .train import AdaptConfig, AdaptError, adapt, kl_to_teacher

__all__ = ["AdaptConfig", "AdaptError", "DataError", "adapt", "kl_to_teacher", "load_texts", "pack_rows",
           "tokenize_and_pack"]
