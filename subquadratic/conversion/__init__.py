"""Checkpoint conversion: the shared streaming converter (`core`); each family's `Converter` lives in
its folder (`subquadratic/families/<family>/conversion.py`) and is named in its registration."""

from .core import (
    SUPPORTED_SOURCES,
    ConversionError,
    ConversionWarning,
    Converter,
    convert,
    fresh_mixer_tensors,
    push_to_hub,
)

__all__ = ["SUPPORTED_SOURCES", "ConversionError", "ConversionWarning", "Converter", "convert", "fresh_mixer_tensors",
           "push_to_hub"]
