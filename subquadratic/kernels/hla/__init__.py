"""Pure-PyTorch second-order Higher-order Linear Attention (HLA) and asymmetric HLA.

`hla_naive` is the O(T^3) definition, `hla_recurrent` the streaming serial
recurrence (the oracle at every length and the decode step), `hla_chunked` the
chunked form (training / prefill). All take q, k: [B, T, H, D], v: [B, T, H, Dv],
log_alpha: [B, T, H] and share `HLAState`. Model code calls `hla_attention`, the
one dispatch function; Triton kernels (`triton_chunk.py`, `triton_fused_recurrent.py`)
are not written yet.
"""

from __future__ import annotations

from torch import Tensor

from ..utils import resolve_backend
from .chunk import hla_chunked
from .naive import hla_naive
from .recurrent import HLAState, clamp_signed, hla_recurrent

__all__ = ["HLAState", "clamp_signed", "hla_attention", "hla_chunked", "hla_naive", "hla_recurrent"]


def hla_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor,
    state: HLAState | None = None,
    *,
    chunk_size: int = 64,
    normalize: bool = False,
    eps: float = 1e-6,
    variant: str = "hla2",
    backend: str = "auto",
) -> tuple[Tensor, HLAState]:
    """HLA of T new tokens continuing `state` (None: start of sequence).

    q, k: [B, T, H, D]; v: [B, T, H, Dv]; log_alpha: [B, T, H] (<= 0). Returns o [B, T, H, Dv] in
    q.dtype and the state after the last token (fp32, fp64 for fp64 inputs). Backends as in
    `kernels.utils`: "torch" takes the recurrence for decode (T == 1) and the chunked form for
    longer inputs, "naive" the recurrence at every length; no Triton kernels yet ("auto" = "torch").
    """
    kw = {"normalize": normalize, "eps": eps, "variant": variant}
    path = resolve_backend(backend, q.device, op="HLA", has_triton=False, has_naive=True)
    if path == "naive" or q.shape[1] == 1:
        return hla_recurrent(q, k, v, log_alpha, state, **kw)
    return hla_chunked(q, k, v, log_alpha, state, chunk_size=chunk_size, **kw)
