"""Adapting converted models: `subquadratic adapt` (`train.py`), on the data of `subquadratic.data`."""

from .train import AdaptConfig, AdaptError, adapt, kl_to_teacher

__all__ = ["AdaptConfig", "AdaptError", "adapt", "kl_to_teacher"]
