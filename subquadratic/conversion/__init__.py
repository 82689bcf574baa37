"""Checkpoint conversion: the shared streaming converter (`core`) and one module per target family
(its `Converter`, named in the family's registration)."""

from .core import SUPPORTED_SOURCES, ConversionError, Converter, convert, fresh_mixer_tensors, push_to_hub

__all__ = ["SUPPORTED_SOURCES", "ConversionError", "Converter", "convert", "fresh_mixer_tensors", "push_to_hub"]
