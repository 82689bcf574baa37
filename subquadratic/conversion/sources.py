"""What the converter (`core`) and the GGUF reader (`gguf`) share: the dense model types conversion
reads (`SUPPORTED_SOURCES`) and the error it raises for input a user can fix (`ConversionError`)."""

from __future__ import annotations

from ..checks import InputError

SUPPORTED_SOURCES = ("llama", "mistral", "qwen2", "qwen3")


class ConversionError(InputError):
    """A problem with the user's input: printed as one line, exit code 2."""
