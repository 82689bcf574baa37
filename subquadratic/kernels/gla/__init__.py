"""Gated linear attention (GLA) and the chunked linear-attention kernels.

PyTorch: `recurrent.py` (serial oracle and step), `chunk.py` (dense and variable-length chunked
forms), used by SSE (`kernels/sse`) as one of its bases. Triton (CUDA; imported when used, not
here): `triton_chunk.chunk_linear_attention`, one chunked kernel family for no decay, per-head and
per-key decay, dense or varlen, with GQA (`triton_chunk_h.py` the state walk, `triton_chunk_o.py`
the output, both with their backward), which SSE's GLA branches (`gla_varlen_triton`), HLA's two
linear-attention stages and SPLA's causal linear term run on."""

from __future__ import annotations

from .chunk import gla_chunk_terms, gla_chunked, gla_varlen
from .recurrent import gla_recurrent, gla_step

__all__ = ["gla_chunk_terms", "gla_chunked", "gla_recurrent", "gla_step", "gla_varlen"]
