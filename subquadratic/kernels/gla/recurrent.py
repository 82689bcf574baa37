"""Gated linear attention (GLA): S_t = diag(exp g_t) S_{t-1} + k_t^T v_t, o_t = q_t S_t.

The serial recurrence (`gla_recurrent`, the oracle) and the single step (`gla_step`, SSE's
decode). q, k: [B, T, H, Dk], v: [B, T, H, Dv]; S: [B, H, Dk, Dv]. Math in float32 (float64 for
float64 inputs); outputs in q's dtype, states in the compute dtype.
"""

from __future__ import annotations

from torch import Tensor

from ..linear_common import check_dense, recurrent


def gla_step(S: Tensor, k: Tensor, v: Tensor, g: Tensor) -> Tensor:
    """One GLA write. S: [*, H, Dk, Dv], k, g: [*, H, Dk], v: [*, H, Dv] -> new S."""
    return g.exp()[..., None] * S + k[..., :, None] * v[..., None, :]


def gla_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Serial GLA (the oracle). q, k, g: [B, T, H, Dk], v: [B, T, H, Dv],
    state: [B, H, Dk, Dv]. Returns (o [B, T, H, Dv] in q.dtype, final state)."""
    check_dense(q, k, v, g, None, state, "g", per_key=True)
    o, S = recurrent(gla_step, q, k, v, (g,), state)
    return o.to(q.dtype), S
