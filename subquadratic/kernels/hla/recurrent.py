"""Streaming (token-by-token) HLA: the oracle for decode, plus the state type.

This module owns `HLAState`, the signed denominator clamp and the serial
recurrences of second-order HLA (``variant="hla2"``) and asymmetric HLA
(``variant="ahla"``). Everything here is a plain Python loop over time; the
chunked form in `chunk.py` must reproduce it exactly (up to rounding).

hla2, per head (alpha_t = exp(log_alpha_t) in (0, 1]):
    S_t   = alpha_t S_{t-1} + k_t k_t^T              S: [D, D]
    F_t   = alpha_t^2 F_{t-1} + (S_t q_t) v_t^T       F: [D, Dv]
    o_t   = q_t^T F_t
  normalised:  eta_t = alpha_t^2 eta_{t-1} + S_t q_t  eta: [D]
               o_t   = (q_t^T F_t) / clamp_signed(q_t^T eta_t, eps)

ahla (linear attention applied twice, same decay alpha in both stages):
    P_t = alpha_t P_{t-1} + k_t v_t^T ;  u_t = q_t^T P_t     (u = LA(q, k, v))
    R_t = alpha_t R_{t-1} + k_t u_t^T ;  o_t = q_t^T R_t     (o = LA(q, k, u))
  normalised: the same two stages run on a value of ones give the
  denominator, o_t = num_t / clamp_signed(den_t, eps):
    z_t = alpha_t z_{t-1} + k_t ;        uz_t = q_t . z_t
    eta_t = alpha_t eta_{t-1} + k_t uz_t ; den_t = q_t . eta_t
  (only the final ratio is normalised, not the intermediate u).

Padding: a token with k = 0, v = 0, log_alpha = 0 leaves S, F (hla2) and P, R,
z, eta (ahla) unchanged exactly. The normalised hla2 denominator is the one
exception: eta gains S_t q_t, so such a token must also have q = 0 to leave
eta unchanged (with q = k = v = 0, log_alpha = 0 every state is unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..utils import acc_dtype

VARIANTS = ("hla2", "ahla")


@dataclass
class HLAState:
    """Recurrent state of one HLA layer (float32, or float64 for float64 inputs).

    hla2: S [B, H, D, D] (decayed sum of k k^T), F [B, H, D, Dv],
          eta [B, H, D] (normalised form only, else None), z None.
    ahla: S [B, H, D, Dv] (first linear-attention state P), F [B, H, D, Dv]
          (second state R); normalised form only: z [B, H, D] (normaliser of
          S) and eta [B, H, D] (normaliser of F), else None.
    """

    S: Tensor
    F: Tensor
    eta: Tensor | None = None
    z: Tensor | None = None


def clamp_signed(x: Tensor, eps: float) -> Tensor:
    """Keep the sign of x and enforce |x| >= eps; sign(0) counts as +."""
    return torch.where(x >= 0, x.clamp_min(eps), x.clamp_max(-eps))


def check_inputs(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(
            f"q and k must both be [B, T, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"v must be [B, T, H, Dv] matching q {tuple(q.shape)}; got {tuple(v.shape)}"
        )
    if log_alpha.shape != q.shape[:3]:
        raise ValueError(
            f"log_alpha must be [B, T, H] = {tuple(q.shape[:3])} (one scalar per head); "
            f"got {tuple(log_alpha.shape)}"
        )


def init_state(
    state: HLAState | None,
    B: int,
    H: int,
    D: int,
    Dv: int,
    variant: str,
    normalize: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> HLAState:
    """Zero state when `state` is None, else `state` cast to `dtype` after shape checks."""
    s_shape = (B, H, D, D) if variant == "hla2" else (B, H, D, Dv)
    f_shape = (B, H, D, Dv)
    if state is None:
        opts = {"dtype": dtype, "device": device}
        return HLAState(
            S=torch.zeros(s_shape, **opts),
            F=torch.zeros(f_shape, **opts),
            eta=torch.zeros(B, H, D, **opts) if normalize else None,
            z=torch.zeros(B, H, D, **opts) if normalize and variant == "ahla" else None,
        )
    if tuple(state.S.shape) != s_shape or tuple(state.F.shape) != f_shape:
        raise ValueError(
            f"state does not fit variant={variant!r}: expected S {s_shape}, F {f_shape}; "
            f"got S {tuple(state.S.shape)}, F {tuple(state.F.shape)}"
        )
    eta = z = None
    if normalize:
        if state.eta is None or (variant == "ahla" and state.z is None):
            raise ValueError(
                "normalize=True needs a state from a normalised run (eta"
                + (" and z" if variant == "ahla" else "")
                + " set); got a state without it"
            )
        eta = state.eta.to(dtype)
        z = state.z.to(dtype) if variant == "ahla" else None
    return HLAState(S=state.S.to(dtype), F=state.F.to(dtype), eta=eta, z=z)


def hla_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor,
    state: HLAState | None = None,
    normalize: bool = False,
    eps: float = 1e-6,
    variant: str = "hla2",
) -> tuple[Tensor, HLAState]:
    """Serial HLA recurrence (see the module docstring for the exact update).

    q, k: [B, T, H, D]; v: [B, T, H, Dv]; log_alpha: [B, T, H] (<= 0).
    Returns o: [B, T, H, Dv] in q.dtype and the state after the last token;
    passing that state to the next call continues the sequence exactly.
    """
    check_inputs(q, k, v, log_alpha, variant)
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    out_dtype, cd = q.dtype, acc_dtype(q)
    st = init_state(state, B, H, D, Dv, variant, normalize, cd, q.device)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    alpha = log_alpha.to(cd).exp()  # [B, T, H]
    S, F, eta, z = st.S, st.F, st.eta, st.z

    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # [B, H, D], [B, H, D], [B, H, Dv]
        a = alpha[:, t, :, None]  # [B, H, 1]
        if variant == "hla2":
            S = a[..., None] * S + k_t[..., :, None] * k_t[..., None, :]
            kt = torch.einsum("bhde,bhe->bhd", S, q_t)  # S_t q_t: [B, H, D]
            F = (a * a)[..., None] * F + kt[..., :, None] * v_t[..., None, :]
            o_t = torch.einsum("bhd,bhdv->bhv", q_t, F)
            if normalize:
                eta = a * a * eta + kt
                o_t = o_t / clamp_signed((q_t * eta).sum(-1, keepdim=True), eps)
        else:
            S = a[..., None] * S + k_t[..., :, None] * v_t[..., None, :]
            u_t = torch.einsum("bhd,bhdv->bhv", q_t, S)  # first linear attention
            F = a[..., None] * F + k_t[..., :, None] * u_t[..., None, :]
            o_t = torch.einsum("bhd,bhdv->bhv", q_t, F)
            if normalize:
                z = a * z + k_t
                uz = (q_t * z).sum(-1, keepdim=True)  # [B, H, 1]
                eta = a * eta + k_t * uz
                o_t = o_t / clamp_signed((q_t * eta).sum(-1, keepdim=True), eps)
        outs.append(o_t)

    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, Dv)  # [B, T, H, Dv]
    return o.to(out_dtype), HLAState(S, F, eta, z)
