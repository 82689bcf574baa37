"""Gated delta rule (GDN): the chunked PyTorch forms (training / prefill), dense
[B, T, H, D] (`gdn_chunked`) and variable-length packed [M, H, D] with `cu_seqlens` (`gdn_varlen`:
one sequence per segment, each with its own initial state; SSE runs its partitions through it).
Chunk layout and carry: `linear_common`. Equal to `gdn_recurrent` up to rounding.

GDN chunking is the WY / UT-transform form of DeltaNet: within a chunk, with
Gamma_t = exp(b_t) and w_t = beta_t (v_t - k_t alpha_t S_{t-1}),
    (I + A) W = beta V - (beta Gamma K) S_0,  A[t, s] = beta_t (k_t . k_s) Gamma_t / Gamma_s (s < t)
solved with a unit-lower-triangular solve, then
    o_t = Gamma_t q_t S_0 + sum_{s<=t} (Gamma_t / Gamma_s)(q_t . k_s) w_s
    S_C = Gamma_C S_0 + sum_s (Gamma_C / Gamma_s) k_s^T w_s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..linear_common import check_dense, dense, suffix_sum, varlen


def gdn_chunk_terms(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor):
    """The chunk terms (trans, inject, out) of the gated delta rule for `linear_common`'s carry
    (SSE's fixed-shape segments use them too). q, k: [Nc, H, C, Dk], v: [Nc, H, C, Dv],
    log_alpha, beta: [Nc, H, C]."""
    C = q.shape[2]
    b = log_alpha.cumsum(2)                               # [Nc, H, C]
    b_last = b[:, :, -1]                                  # [Nc, H]
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    # exp(b_t - b_s) for s <= t, 0 above the diagonal (masked before exp)   [Nc, H, C, C]
    decay = (b[..., :, None] - b[..., None, :]).masked_fill(upper, float("-inf")).exp()
    A = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    IA = A + eye                                          # unit lower triangular
    rhs = torch.cat([beta[..., None] * v, (beta * b.exp())[..., None] * k], dim=-1)
    sol = torch.linalg.solve_triangular(IA, rhs, upper=False, unitriangular=True)
    U, Wk = sol.split([v.shape[-1], k.shape[-1]], dim=-1)  # W = U - Wk S_0
    Aqk = (q @ k.transpose(-1, -2)) * decay               # [Nc, H, C, C], incl. diagonal
    q_dec = q * b.exp()[..., None]
    k_dec = k * suffix_sum(log_alpha, 2).exp()[..., None]  # [Nc, H, C, Dk]
    eye_k = torch.eye(k.shape[-1], dtype=q.dtype, device=q.device)
    M = b_last.exp()[..., None, None] * eye_k - k_dec.transpose(-1, -2) @ Wk  # [Nc, H, Dk, Dk]
    inject = k_dec.transpose(-1, -2) @ U                  # [Nc, H, Dk, Dv]

    def trans(sl: slice, S: Tensor) -> Tensor:
        return M[sl] @ S

    def out(S_before: Tensor) -> Tensor:
        W = U - Wk @ S_before
        return q_dec @ S_before + Aqk @ W

    return trans, inject, out


def gdn_varlen(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor, *,
               cu_seqlens: Tensor, initial_state: Tensor | None = None,
               chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule over packed variable-length segments.
    q, k: [M, H, Dk], v: [M, H, Dv], log_alpha, beta: [M, H]; otherwise as `gla_varlen`."""
    return varlen(gdn_chunk_terms, q, k, v, (log_alpha, beta), cu_seqlens, initial_state,
                   chunk_size)


def gdn_chunked(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor,
                state: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked (WY / UT-transform) gated delta rule, equal to `gdn_recurrent` up to
    rounding. q, k: [B, T, H, Dk], v: [B, T, H, Dv], log_alpha, beta: [B, T, H]."""
    check_dense(q, k, v, log_alpha, beta, state, "log_alpha", per_key=False)
    return dense(gdn_chunk_terms, q, k, v, (log_alpha, beta), state, chunk_size)
