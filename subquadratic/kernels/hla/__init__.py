"""Pure-PyTorch second-order Higher-order Linear Attention (HLA) and asymmetric HLA.

`hla_naive` is the O(T^3) definition, `hla_recurrent` the streaming oracle
(decode), `hla_chunked` the chunked form (training / prefill). All take
q, k: [B, T, H, D], v: [B, T, H, Dv], log_alpha: [B, T, H] and share `HLAState`.
Model code calls `hla_attention`, the one dispatch function: a Triton kernel
will sit behind it on CUDA; until then it runs the reference forms.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunk import hla_chunked
from .naive import hla_naive
from .recurrent import HLAState, clamp_signed, hla_recurrent

__all__ = [
    "HLAState", "TRITON_OPS", "clamp_signed", "hla_attention", "hla_chunked", "hla_naive",
    "hla_recurrent", "resolve_backend",
]

#: Triton implementations by op name ("hla_chunked", "hla_recurrent"), filled in where importable.
TRITON_OPS: dict = {}


def resolve_backend(requested: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA when the Triton kernels are available, else 'reference';
    'reference' and 'recurrent' (serial oracle for every length) are taken as asked."""
    if requested in ("reference", "recurrent"):
        return requested
    if requested not in ("auto", "triton"):
        raise ValueError(f"backend must be 'auto', 'reference', 'recurrent' or 'triton', got {requested!r}")
    if device.type == "cuda" and TRITON_OPS:
        return "triton"
    if requested == "triton":
        raise RuntimeError("hla_backend='triton' needs a CUDA device and the Triton kernels; use 'auto' or 'reference'")
    return "reference"


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
    q.dtype and the state after the last token (fp32, fp64 for fp64 inputs). Decode (T == 1) takes
    the recurrence, longer inputs the chunked form; `backend="recurrent"` forces the recurrence.
    """
    kw = {"normalize": normalize, "eps": eps, "variant": variant}
    path = resolve_backend(backend, q.device)
    if path == "triton":
        op = "hla_recurrent" if q.shape[1] == 1 else "hla_chunked"
        if op == "hla_chunked":
            kw["chunk_size"] = chunk_size
        return TRITON_OPS[op](q, k, v, log_alpha, state, **kw)
    if path == "recurrent" or q.shape[1] == 1:
        return hla_recurrent(q, k, v, log_alpha, state, **kw)
    return hla_chunked(q, k, v, log_alpha, state, chunk_size=chunk_size, **kw)
