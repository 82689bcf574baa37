"""O(T^3) definition of HLA: the ground truth the other forms are tested against.

Materialises the full [T, T, T] weight tensor, so use it only on short
sequences (tests run it in float64). With A_t = sum_{s<=t} log alpha_s:

hla2:  o_t = sum_{j<=t} sum_{i<=j} w(i,j,t) (q_t.k_i)(q_j.k_i) v_j
       w(i,j,t) = exp((A_j - A_i) + 2 (A_t - A_j))
       (alpha over (i, j], alpha^2 over (j, t])
ahla:  o_t = sum_{j<=t} sum_{i<=j} exp(A_t - A_i) (q_t.k_j)(q_j.k_i) v_i
       i.e. u = LA(q, k, v), o = LA(q, k, u), both with decay alpha.
normalize=True divides by the same double sum with v replaced by 1, through
the signed clamp of `recurrent.clamp_signed`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .recurrent import check_inputs, clamp_signed


def hla_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor,
    variant: str = "hla2",
    normalize: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """HLA by its definition, in q.dtype. q, k: [B, T, H, D]; v: [B, T, H, Dv];
    log_alpha: [B, T, H]. Returns o: [B, T, H, Dv]."""
    check_inputs(q, k, v, log_alpha, variant)
    T = q.shape[1]
    A = log_alpha.to(q.dtype).cumsum(1).transpose(1, 2)  # [B, H, T]
    qk = torch.einsum("bthd,bshd->bhts", q, k.to(q.dtype))  # q_t . k_s: [B, H, T, T]

    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    valid = causal[:, :, None] & causal[None, :, :]  # [t, j, i]: i <= j <= t
    At, Aj, Ai = A[..., :, None, None], A[..., None, :, None], A[..., None, None, :]
    if variant == "hla2":
        log_w = (Aj - Ai) + 2 * (At - Aj)
        pair = qk[..., :, None, :] * qk[..., None, :, :]  # (q_t.k_i)(q_j.k_i)
        value_index = "j"
    else:
        log_w = (At - Ai).expand(-1, -1, T, T, T)
        pair = qk[..., :, :, None] * qk[..., None, :, :]  # (q_t.k_j)(q_j.k_i)
        value_index = "i"
    coef = log_w.masked_fill(~valid, float("-inf")).exp() * pair  # [B, H, t, j, i]

    o = torch.einsum(f"bhtji,b{value_index}hv->bthv", coef, v.to(q.dtype))
    if normalize:
        den = coef.sum((-1, -2)).transpose(1, 2)[..., None]  # [B, T, H, 1]
        o = o / clamp_signed(den, eps)
    return o
