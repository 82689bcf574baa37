"""Triton chunked HLA (training / prefill): forward and backward, same contract as `hla_chunked`.

Both variants are compositions of one op, the chunked decayed linear attention

    LA_a(q, k, v; X0):  X_t = exp(a_t) X_{t-1} + k_t v_t^T,   o_t = q_t^T X_t     (X_0 = X0)

with a per-token, per-head log decay a_t <= 0: the shared chunked linear-attention kernels of
`kernels/gla` with a per-head decay (`gla.triton_chunk.chunk_linear_attention`, forward and
backward). Since S_t = alpha_t S_{t-1} + k_t k_t^T, the data-dependent key of hla2,
ktilde_t = S_t q_t, is itself LA_{log alpha}(q, k, k; S_0) (the value is k), and F is LA with decay
alpha^2 on (q, ktilde, v):

    hla2:  ktilde, S_T = LA_{la}(q, k, k; S_0);   o, F_T = LA_{2 la}(q, ktilde, v; F_0)   (g_scale 2)
    ahla:  u, S_T = LA_{la}(q, k, v; S_0);        o, F_T = LA_{la}(q, k, u; F_0)

The normalised forms run the second stage (ahla: both stages) on [v, 1], whose last column carries
eta (and z) and gives the denominator, exactly as `chunk.py` does. Gradients of the composition
come from autograd through the op. Everything is linear in T; no host synchronisation. Dots run on
the tensor cores in the input dtype (bf16 / fp16) with fp32 accumulation, or for fp32 inputs at
the precision asked ("ieee" exact, the default here; "tf32").
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..gla.triton_chunk import chunk_linear_attention
from ..triton_utils import TRITON_DTYPES as DTYPES
from .recurrent import HLAState, check_inputs, clamp_signed, init_state


def hla_chunked_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor,
    state: HLAState | None = None,
    *,
    chunk_size: int = 64,
    normalize: bool = False,
    eps: float = 1e-6,
    variant: str = "hla2",
    precision: str = "ieee",
) -> tuple[Tensor, HLAState]:
    """Chunked HLA on the Triton kernels, same contract as `hla_chunked` (and differentiable in
    q, k, v, log_alpha and the initial state). Inputs in DTYPES; chunk_size: a power of two >= 16
    (`hla.triton_unsupported`; `hla_attention` sends other inputs to the PyTorch forms); the dots
    of fp32 inputs at `precision` ("ieee" exact or "tf32")."""
    check_inputs(q, k, v, log_alpha, variant)
    if q.dtype not in DTYPES:
        raise ValueError(f"the HLA Triton kernels take {DTYPES} inputs, got {q.dtype}; use hla_attention")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    dt = q.dtype
    if T == 0:
        return v.new_zeros(B, 0, H, Dv, dtype=dt), init_state(state, B, H, D, Dv, variant, normalize, torch.float32,
                                                              q.device)
    # zero initial states are not built: the kernels start from 0 without reading them
    st = None if state is None else init_state(state, B, H, D, Dv, variant, normalize, torch.float32, q.device)
    la = log_alpha.float()
    k, v = k.to(dt), v.to(dt)
    kw = {"chunk_size": chunk_size, "precision": precision}
    out_dt = torch.float32 if normalize else dt

    def init(name, col_name=None, transpose=False):  # one linear attention's initial state, [X, col] normalised
        if st is None:
            return None
        X, col = getattr(st, name), None if col_name is None else getattr(st, col_name)
        X = X.transpose(-1, -2) if transpose else X
        return torch.cat([X, col[..., None]], -1) if normalize and col is not None else X

    vv = torch.cat([v, v.new_ones(B, T, H, 1)], -1) if normalize else v
    if variant == "hla2":
        # ktilde_t = S_t q_t = q_t^T S_t^T: the linear attention carries S^T (S is symmetric unless
        # the initial state is not; the transposes keep the contract for any S_0)
        kt, S = chunk_linear_attention(q, k, k, la, initial_state=init("S", transpose=True), **kw)
        S = S.transpose(-1, -2)
        o, F = chunk_linear_attention(q, kt, vv, la, initial_state=init("F", "eta"), out_dtype=out_dt, g_scale=2.0,
                                      **kw)
        z = None
    else:
        u, S = chunk_linear_attention(q, k, vv, la, initial_state=init("S", "z"), **kw)
        o, F = chunk_linear_attention(q, k, u, la, initial_state=init("F", "eta"), out_dtype=out_dt, **kw)
        z = S[..., Dv] if normalize else None
        S = S[..., :Dv] if normalize else S
    eta = None
    if normalize:
        o = (o[..., :Dv] / clamp_signed(o[..., Dv:], eps)).to(dt)
        F, eta = F[..., :Dv], F[..., Dv]
    return o, HLAState(S=S, F=F, eta=eta, z=z)
