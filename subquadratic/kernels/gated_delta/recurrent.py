"""Gated delta rule (GDN): S_t = alpha_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t, o_t = q_t S_t.

The serial recurrence (`gdn_recurrent`, the oracle) and the single step (`gdn_step`, SSE's
decode). q, k: [B, T, H, Dk], v: [B, T, H, Dv]; S: [B, H, Dk, Dv]. Math in float32 (float64 for
float64 inputs); outputs in q's dtype, states in the compute dtype.
"""

from __future__ import annotations

from torch import Tensor

from ..linear_common import check_dense, read, recurrent


def gdn_step(S: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor) -> Tensor:
    """One gated-delta-rule write. S: [*, H, Dk, Dv], k: [*, H, Dk], v: [*, H, Dv],
    log_alpha, beta: [*, H] -> new S."""
    S = log_alpha.exp()[..., None, None] * S
    u = beta[..., None] * (v - read(k, S))  # [*, H, Dv]
    return S + k[..., :, None] * u[..., None, :]


def gdn_recurrent(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Serial gated delta rule (the oracle). q, k: [B, T, H, Dk], v: [B, T, H, Dv],
    log_alpha, beta: [B, T, H], state: [B, H, Dk, Dv]. Returns (o, final state)."""
    check_dense(q, k, v, log_alpha, beta, state, "log_alpha", per_key=False)
    o, S = recurrent(gdn_step, q, k, v, (log_alpha, beta), state)
    return o.to(q.dtype), S
