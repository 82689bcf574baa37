"""Sparse State Expansion (SSE) in PyTorch, on the linear-attention bases of `kernels/gla` and
`kernels/gated_delta`.

Forms: `recurrent.sse_recurrent` (the serial oracle and the decode step: only the selected
partitions are read and written), `masked.sse_masked` ((N+1)-heads form, a second reference),
`varlen.sse_varlen` (sorted variable-length form); `router.py` holds the router (`router_topk`) and
the load-balancing loss (`sse_aux_loss`). Model code calls one dispatch function, `sse_attention`;
Triton kernels (`triton_chunk.py`, `triton_fused_recurrent.py`) are not written yet.
"""

from __future__ import annotations

from torch import Tensor

from ..utils import resolve_backend
from .masked import sse_masked
from .recurrent import SSEState, sse_recurrent
from .router import router_topk, sse_aux_loss
from .varlen import sse_varlen

__all__ = [
    "SSEState", "router_topk", "sse_attention", "sse_aux_loss", "sse_masked", "sse_recurrent", "sse_varlen",
]


def sse_attention(q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, g1: Tensor,
                  g2: Tensor, probs: Tensor, sel: Tensor, state: SSEState | None = None, *,
                  base: str = "gla", beta: Tensor | None = None, chunk_size: int = 64,
                  backend: str = "auto", inplace: bool = False) -> tuple[Tensor, SSEState]:
    """SSE of the new tokens from `state` (None: zeros); shapes as in `recurrent.py`. Returns
    (o [B, T, H, Dv] in q1's dtype, new state). Backends as in `kernels.utils`: "torch" takes the
    recurrent step for one token (decode) and the sorted variable-length form otherwise, "naive" the
    serial recurrence at every length; no Triton kernels yet ("auto" = "torch"). `inplace=True`
    (inference with a cache) lets the recurrent step write the new states into `state`'s tensors,
    touching only the selected rows of `state.parts`; the chunked form ignores it."""
    path = resolve_backend(backend, q1.device, op="SSE", has_triton=False, has_naive=True)
    if path == "naive" or q1.shape[1] == 1:
        return sse_recurrent(q1, k1, q2, k2, v, g1, g2, probs, sel, state, base=base, beta=beta,
                             inplace=inplace and state is not None)
    return sse_varlen(q1, k1, q2, k2, v, g1, g2, probs, sel, state, chunk_size, base=base, beta=beta)
