"""Pure-PyTorch Sparse State Expansion (SSE) kernels.

`gla` owns the linear-attention bases (gated linear attention and the gated
delta rule): serial oracles, single steps, dense and variable-length chunked
forms. `sse` owns the SSE operator on top of them (`sse_recurrent` oracle /
decode, `sse_masked` (N+1)-heads form, `sse_varlen` sorted-segments form), the
router (`router_topk`) and the load-balancing loss (`sse_aux_loss`).

Model code calls one dispatch function, `sse_attention`: the Triton path on CUDA
when its kernels are registered in `TRITON_OPS`, else the recurrent step for a
single token (decode: only the selected partitions are read and written) and the
sorted variable-length form for longer inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .gla import (
    gdn_chunked,
    gdn_recurrent,
    gdn_step,
    gdn_varlen,
    gla_chunked,
    gla_recurrent,
    gla_step,
    gla_varlen,
)
from .sse import (
    SSEState,
    router_topk,
    sse_aux_loss,
    sse_masked,
    sse_recurrent,
    sse_varlen,
)

__all__ = [
    "SSEState",
    "TRITON_OPS",
    "gdn_chunked",
    "gdn_recurrent",
    "gdn_step",
    "gdn_varlen",
    "gla_chunked",
    "gla_recurrent",
    "gla_step",
    "gla_varlen",
    "router_topk",
    "resolve_backend",
    "sse_attention",
    "sse_aux_loss",
    "sse_masked",
    "sse_recurrent",
    "sse_varlen",
]

#: Triton implementations by op name, filled in where the Triton kernels are importable.
TRITON_OPS: dict = {}

_PYTORCH_FORMS = {"varlen": sse_varlen, "masked": sse_masked, "recurrent": sse_recurrent}


def resolve_backend(requested: str, device: torch.device, num_tokens: int) -> str:
    """The form that runs: "triton", "varlen", "masked" or "recurrent".

    "auto" -> Triton on CUDA when available, else "reference"; "reference" -> "recurrent" for a
    single token (decode) and "varlen" otherwise; the named forms are taken as they are."""
    if requested in _PYTORCH_FORMS:
        return requested
    if requested == "triton" or (requested == "auto" and device.type == "cuda" and TRITON_OPS):
        if device.type != "cuda" or not TRITON_OPS:
            raise RuntimeError("sse_backend='triton' needs a CUDA device and the Triton kernels; "
                               "use 'auto' or 'reference'")
        return "triton"
    if requested not in ("auto", "reference"):
        raise ValueError(f"unknown SSE backend {requested!r}; use auto, reference, triton, "
                         f"{', '.join(_PYTORCH_FORMS)}")
    return "recurrent" if num_tokens == 1 else "varlen"


def sse_attention(q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, g1: Tensor,
                  g2: Tensor, probs: Tensor, sel: Tensor, state: SSEState | None = None, *,
                  base: str = "gla", beta: Tensor | None = None, chunk_size: int = 64,
                  backend: str = "auto", inplace: bool = False) -> tuple[Tensor, SSEState]:
    """SSE of the new tokens from `state` (None: zeros); shapes as in `sse.py`. Returns
    (o [B, T, H, Dv] in q1's dtype, new state). `inplace=True` (inference with a cache) lets the
    recurrent step write the new states into `state`'s tensors, touching only the selected rows
    of `state.parts`; the other forms ignore it."""
    form = resolve_backend(backend, q1.device, q1.shape[1])
    if form == "triton":
        return TRITON_OPS["sse_attention"](q1, k1, q2, k2, v, g1, g2, probs, sel, state, base=base,
                                           beta=beta, chunk_size=chunk_size, inplace=inplace)
    if form == "recurrent":
        return sse_recurrent(q1, k1, q2, k2, v, g1, g2, probs, sel, state, base=base, beta=beta,
                             inplace=inplace and state is not None)
    return _PYTORCH_FORMS[form](q1, k1, q2, k2, v, g1, g2, probs, sel, state, chunk_size,
                                base=base, beta=beta)
