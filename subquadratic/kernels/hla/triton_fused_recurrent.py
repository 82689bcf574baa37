"""Triton fused recurrent HLA (decode): the serial recurrence of `hla_recurrent` in one launch.

One program per (block of value columns, batch x head) keeps its part of the state in registers
and walks the T new tokens (T = 1 for a decode step), reading each token once and writing the
state once at the end:

  hla2: S [D, D] whole (ktilde_t = S_t q_t needs all of it), F[:, cols], eta;
  ahla: P[:, cols] and R[:, cols] (the columns of u_t = q_t^T P_t feed the same columns of R), z, eta.

The state that comes back is new tensors (the input state is not modified); S, eta and z are
written by the programs of the first column block. Forward only: when gradients are needed the
call goes to the chunked kernels, which give the same values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton_launch import jit
from ..triton_utils import TRITON_DTYPES as DTYPES
from ..triton_utils import block_size, cdiv
from ..utils import import_triton, new_output
from .recurrent import HLAState, check_inputs, init_state

triton, tl = import_triton()

#: value columns per program and warps of the decode kernels
BV_DECODE = 32
WARPS_DECODE = 4


@jit
def _clamp_signed(x, eps):
    return tl.where(x >= 0, tl.maximum(x, eps), tl.minimum(x, -eps))


@jit
def _hla2_recurrent(
    q, k, v, la, S0, F0, E0, o, S1, F1, E1, eps,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NORM: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kk = m_k[:, None] & m_k[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    b_S = tl.load(S0 + i_bh * K * K + o_k[:, None] * K + o_k[None, :], mask=m_kk, other=0.0)
    b_F = tl.load(F0 + i_bh * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
    if NORM:
        b_e = tl.load(E0 + i_bh * K + o_k, mask=m_k, other=0.0)
    for t in range(0, T):
        row = (i_b * T + t) * H + i_h
        b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_a = tl.exp(tl.load(la + row).to(tl.float32))
        b_S = b_S * b_a + b_k[:, None] * b_k[None, :]
        b_kt = tl.sum(b_S * b_q[None, :], 1)  # S_t q_t
        b_F = b_F * (b_a * b_a) + b_kt[:, None] * b_v[None, :]
        b_o = tl.sum(b_q[:, None] * b_F, 0)
        if NORM:
            b_e = b_e * (b_a * b_a) + b_kt
            b_o = b_o / _clamp_signed(tl.sum(b_q * b_e, 0), eps)
        tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(F1 + i_bh * K * V + o_k[:, None] * V + o_v[None, :], b_F, mask=m_kv)
    if i_v == 0:
        tl.store(S1 + i_bh * K * K + o_k[:, None] * K + o_k[None, :], b_S, mask=m_kk)
        if NORM:
            tl.store(E1 + i_bh * K + o_k, b_e, mask=m_k)


@jit
def _ahla_recurrent(
    q, k, v, la, P0, R0, Z0, E0, o, P1, R1, Z1, E1, eps,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NORM: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off = i_bh * K * V + o_k[:, None] * V + o_v[None, :]
    b_P = tl.load(P0 + off, mask=m_kv, other=0.0)
    b_R = tl.load(R0 + off, mask=m_kv, other=0.0)
    if NORM:
        b_z = tl.load(Z0 + i_bh * K + o_k, mask=m_k, other=0.0)
        b_e = tl.load(E0 + i_bh * K + o_k, mask=m_k, other=0.0)
    for t in range(0, T):
        row = (i_b * T + t) * H + i_h
        b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_a = tl.exp(tl.load(la + row).to(tl.float32))
        b_P = b_P * b_a + b_k[:, None] * b_v[None, :]
        b_u = tl.sum(b_q[:, None] * b_P, 0)
        b_R = b_R * b_a + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_q[:, None] * b_R, 0)
        if NORM:
            b_z = b_z * b_a + b_k
            b_e = b_e * b_a + b_k * tl.sum(b_q * b_z, 0)
            b_o = b_o / _clamp_signed(tl.sum(b_q * b_e, 0), eps)
        tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(P1 + off, b_P, mask=m_kv)
    tl.store(R1 + off, b_R, mask=m_kv)
    if NORM:
        if i_v == 0:
            tl.store(Z1 + i_bh * K + o_k, b_z, mask=m_k)
            tl.store(E1 + i_bh * K + o_k, b_e, mask=m_k)


def hla_recurrent_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor,
    state: HLAState | None = None,
    normalize: bool = False,
    eps: float = 1e-6,
    variant: str = "hla2",
) -> tuple[Tensor, HLAState]:
    """HLA recurrence on one fused Triton kernel, same contract as `hla_recurrent`.

    q, k: [B, T, H, D]; v: [B, T, H, Dv]; log_alpha: [B, T, H] (<= 0). Returns o: [B, T, H, Dv]
    in q.dtype and the state after the last token (new fp32 tensors). Inputs in DTYPES, forward
    only: `hla_attention` / `hla_triton` send fp64 inputs to the PyTorch forms and calls that need
    gradients to `hla_chunked_triton`.
    """
    check_inputs(q, k, v, log_alpha, variant)
    if q.dtype not in DTYPES:
        raise ValueError(f"the HLA Triton kernels take {DTYPES} inputs, got {q.dtype}; use hla_attention")
    tensors = [q, k, v, log_alpha] + ([] if state is None else [x for x in vars(state).values() if x is not None])
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        raise ValueError("the fused recurrent HLA kernel is forward only; hla_chunked_triton has the backward")
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    st = init_state(state, B, H, D, Dv, variant, normalize, torch.float32, q.device)
    if T == 0:
        return v.new_zeros(B, 0, H, Dv, dtype=q.dtype), st
    new = new_output
    q, k, v, la = q.contiguous(), k.contiguous(), v.contiguous(), log_alpha.contiguous()
    S0, F0 = st.S.contiguous(), st.F.contiguous()
    o = new((B, T, H, Dv), q.device, q.dtype)
    S1, F1 = new(S0.shape, q.device), new(F0.shape, q.device)
    BK, BV = block_size(D, 1), min(BV_DECODE, block_size(Dv, 1))
    grid = (cdiv(Dv, BV), B * H)
    E0 = st.eta.contiguous() if normalize else None
    E1 = new(E0.shape, q.device) if normalize else None
    if variant == "hla2":
        _hla2_recurrent[grid](q, k, v, la, S0, F0, E0, o, S1, F1, E1, eps, T, H, D, Dv, BK, BV, normalize,
                              num_warps=WARPS_DECODE)
        return o, HLAState(S=S1, F=F1, eta=E1)
    Z0 = st.z.contiguous() if normalize else None
    Z1 = new(Z0.shape, q.device) if normalize else None
    _ahla_recurrent[grid](q, k, v, la, S0, F0, Z0, E0, o, S1, F1, Z1, E1, eps, T, H, D, Dv, BK, BV, normalize,
                          num_warps=WARPS_DECODE)
    return o, HLAState(S=S1, F=F1, eta=E1, z=Z1)
