"""Gated delta rule (GDN) in PyTorch: `recurrent.py` (serial oracle and step), `chunk.py` (dense and
variable-length chunked forms). Used by SSE (`kernels/sse`) as one of its bases."""

from __future__ import annotations

from .chunk import gdn_chunk_terms, gdn_chunked, gdn_varlen
from .recurrent import gdn_recurrent, gdn_step

__all__ = ["gdn_chunk_terms", "gdn_chunked", "gdn_recurrent", "gdn_step", "gdn_varlen"]
