"""Pure-PyTorch Sparse State Expansion (SSE) kernels.

`gla` owns the linear-attention bases (gated linear attention and the gated
delta rule): serial oracles, single steps, dense and variable-length chunked
forms. `sse` owns the SSE operator on top of them (`sse_recurrent` oracle /
decode, `sse_masked` (N+1)-heads form, `sse_varlen` sorted-segments form), the
router (`router_topk`) and the load-balancing loss (`sse_aux_loss`).
"""

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
    "gdn_chunked",
    "gdn_recurrent",
    "gdn_step",
    "gdn_varlen",
    "gla_chunked",
    "gla_recurrent",
    "gla_step",
    "gla_varlen",
    "router_topk",
    "sse_aux_loss",
    "sse_masked",
    "sse_recurrent",
    "sse_varlen",
]
