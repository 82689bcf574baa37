"""Gated linear attention (GLA) in PyTorch: `recurrent.py` (serial oracle and step), `chunk.py` (dense and
variable-length chunked forms). Used by SSE (`kernels/sse`) as one of its bases."""

from __future__ import annotations

from .chunk import gla_chunk_terms, gla_chunked, gla_varlen
from .recurrent import gla_recurrent, gla_step

__all__ = ["gla_chunk_terms", "gla_chunked", "gla_recurrent", "gla_step", "gla_varlen"]
