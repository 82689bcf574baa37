"""SSE as (N+1) heads of the chunked base: every partition is an extra head with k = p k2,
q = p q2, g = g2 where selected and 0 elsewhere. Costs N T; simple, a second reference."""

from __future__ import annotations

import torch
from torch import Tensor

from ..utils import acc_dtype
from .recurrent import SSEState, setup


def _expand(x: Tensor, sel: Tensor, w: Tensor | None = None) -> Tensor:
    """x: [B, T, H, *] -> [B, T, N * H, *]: x (times w) where sel, else 0.
    sel, w: [B, T, N]."""
    B, T, N = sel.shape
    tail = (1,) * (x.dim() - 2)
    xs = x[:, :, None] if w is None else w.view(B, T, N, *tail) * x[:, :, None]
    zero = torch.zeros((), dtype=xs.dtype, device=xs.device)
    xs = torch.where(sel.view(B, T, N, *tail), xs, zero)
    return xs.reshape(B, T, N * x.shape[2], *x.shape[3:])


def sse_masked(q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, g1: Tensor,
               g2: Tensor, probs: Tensor, sel: Tensor, state: SSEState | None = None,
               chunk_size: int = 64, *, base: str = "gla",
               beta: Tensor | None = None) -> tuple[Tensor, SSEState]:
    """SSE as the shared branch plus N masked extra heads of the chunked base.
    Cost grows with N T. Returns (o [B, T, H, Dv], state)."""
    ops, extra, state = setup(q1, k1, q2, k2, v, g1, g2, probs, sel, state, base, beta)
    B, T, H, Dk = q1.shape
    N, Dv = probs.shape[-1], v.shape[-1]
    dt = acc_dtype(q1)
    o_shared, S0 = ops.chunked(q1, k1, v, g1, *extra, state=state.shared, chunk_size=chunk_size)
    p = probs.to(dt)
    heads = [_expand(q2.to(dt), sel, p), _expand(k2.to(dt), sel, p),
             v.to(dt)[:, :, None].expand(B, T, N, H, Dv).reshape(B, T, N * H, Dv),
             _expand(g2.to(dt), sel), *(_expand(x.to(dt), sel) for x in extra)]
    o_parts, parts = ops.chunked(*heads, state=state.parts.reshape(B, N * H, Dk, Dv),
                                 chunk_size=chunk_size)
    o = o_shared.to(dt) + o_parts.view(B, T, N, H, Dv).sum(2)
    return o.to(q1.dtype), SSEState(S0, parts.view(B, N, H, Dk, Dv))
