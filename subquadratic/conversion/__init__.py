"""Checkpoint conversion: the shared streaming converter (`core`) and one module per target family."""

from . import hla, spla, sse  # noqa: F401  (registers the families)
from .core import FAMILIES, SUPPORTED_SOURCES, ConversionError, convert, push_to_hub

__all__ = ["FAMILIES", "SUPPORTED_SOURCES", "ConversionError", "convert", "push_to_hub"]
