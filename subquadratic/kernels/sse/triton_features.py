"""The Triton kernels of `sse_gla_features` (module `features.py`): one program per ROWS rows of
[rows, D] (row r = (b * T + t) * H + h; the decay biases' row r % H), forward and backward. The
backward recomputes the sigmoids and the keys' softmax from the saved inputs; the biases' gradients
are the decay gradients summed over the tokens by the caller."""

from __future__ import annotations

import torch

from ..triton_utils import block_size, rows_per_program, token_stride
from ..utils import import_triton, new_output

triton, tl = import_triton()


#: Elements of each tensor a program takes (fourteen tensors live in the backward).
ELEMENTS = 1024


@triton.jit
def _ld(X, off, m):
    return tl.load(X + off, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _softmax(k, m_d):
    """Softmax over the valid columns of each row (fp32)."""
    k = tl.where(m_d[None, :], k, float("-inf"))
    e = tl.exp(k - tl.max(k, 1)[:, None])
    return e / tl.sum(e, 1)[:, None]


@triton.jit
def _logsigmoid(z):
    """min(z, 0) - log1p(exp(-|z|)), log1p(u) as log(1 + u) * u / ((1 + u) - 1) (exact to rounding for
    the small u of strongly positive z, where log(1 + u) alone loses the digits)."""
    u = tl.exp(-tl.abs(z))
    w = 1.0 + u
    lp = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
    return tl.minimum(z, 0.0) - lp


@triton.jit
def _tile(n_rows, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """This program's element offsets [BR, BD], mask, bias offsets and column mask."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m_d = cols < D
    m = (rows < n_rows)[:, None] & m_d[None, :]
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    off_b = (rows % H)[:, None] * D + cols[None, :]
    return off, m, off_b, m_d


@triton.jit
def _strided(off, S, H: tl.constexpr, D: tl.constexpr):
    """Offsets `off` of contiguous [tokens, H, D] rows moved to rows S elements apart per token."""
    return (off // (H * D)) * S + off % (H * D)


@triton.jit
def sse_features_fwd(Q1, K1, Q2, K2, V, Z1, Z2, B1, B2, OQ1, OK1, OQ2, OK2, OV, G1, G2, n_rows, inv_norm,
                     S_Q1, S_K1, S_Q2, S_K2, S_V, S_Z1, S_Z2,
                     H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """The inputs' tokens S_* elements apart (a token's H x D entries contiguous: column slices of a
    packed projection), the outputs contiguous."""
    off, m, off_b, m_d = _tile(n_rows, H, D, BD, BR)
    dt = OQ1.dtype.element_ty
    x = _ld(Q1, _strided(off, S_Q1, H, D), m)
    tl.store(OQ1 + off, (x * tl.sigmoid(x)).to(dt), mask=m)
    x = _ld(Q2, _strided(off, S_Q2, H, D), m)
    tl.store(OQ2 + off, (x * tl.sigmoid(x)).to(dt), mask=m)
    x = _ld(V, _strided(off, S_V, H, D), m)
    tl.store(OV + off, (x * tl.sigmoid(x)).to(dt), mask=m)
    tl.store(OK1 + off, _softmax(_ld(K1, _strided(off, S_K1, H, D), m), m_d).to(dt), mask=m)
    tl.store(OK2 + off, _softmax(_ld(K2, _strided(off, S_K2, H, D), m), m_d).to(dt), mask=m)
    z = _ld(Z1, _strided(off, S_Z1, H, D), m) + _ld(B1, off_b, m)
    tl.store(G1 + off, _logsigmoid(z) * inv_norm, mask=m)
    z = _ld(Z2, _strided(off, S_Z2, H, D), m) + _ld(B2, off_b, m)
    tl.store(G2 + off, _logsigmoid(z) * inv_norm, mask=m)


@triton.jit
def _silu_bwd(X, DY, DX, off, m):
    x = _ld(X, off, m)
    s = tl.sigmoid(x)
    tl.store(DX + off, (_ld(DY, off, m) * s * (1.0 + x * (1.0 - s))).to(DX.dtype.element_ty), mask=m)


@triton.jit
def _softmax_bwd(K, DY, DK, off, m, m_d):
    y = _softmax(_ld(K, off, m), m_d)
    dy = _ld(DY, off, m)
    tl.store(DK + off, (y * (dy - tl.sum(dy * y, 1)[:, None])).to(DK.dtype.element_ty), mask=m)


@triton.jit
def _decay_bwd(Z, B, DG, DZ, off, m, off_b, inv_norm):
    z = _ld(Z, off, m) + _ld(B, off_b, m)
    tl.store(DZ + off, _ld(DG, off, m) * inv_norm * tl.sigmoid(-z), mask=m)


@triton.jit
def sse_features_bwd(Q1, K1, Q2, K2, V, Z1, Z2, B1, B2, DOQ1, DOK1, DOQ2, DOK2, DOV, DG1, DG2,
                     DQ1, DK1, DQ2, DK2, DV, DZ1, DZ2, n_rows, inv_norm,
                     H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    off, m, off_b, m_d = _tile(n_rows, H, D, BD, BR)
    _silu_bwd(Q1, DOQ1, DQ1, off, m)
    _silu_bwd(Q2, DOQ2, DQ2, off, m)
    _silu_bwd(V, DOV, DV, off, m)
    _softmax_bwd(K1, DOK1, DK1, off, m, m_d)
    _softmax_bwd(K2, DOK2, DK2, off, m, m_d)
    _decay_bwd(Z1, B1, DG1, DZ1, off, m, off_b, inv_norm)
    _decay_bwd(Z2, B2, DG2, DZ2, off, m, off_b, inv_norm)


class SSEFeatures(torch.autograd.Function):
    """`sse_gla_features` on the kernels: q1, k1, q2, k2, v [B, T, H, D] of one dtype, z1, z2
    [B, T, H * D], bias1, bias2 [H * D], the normalizer; differentiable in every tensor. `grad` False
    (no gradient will be asked for): the inputs are read in place where their tokens are rows of one
    stride (`token_stride`) and nothing is saved."""

    @staticmethod
    def forward(ctx, q1, k1, q2, k2, v, z1, z2, bias1, bias2, normalizer, grad=True):
        B, T, H, D = q1.shape
        xs = (q1, k1, q2, k2, v, z1, z2, bias1, bias2)
        # without gradients the inputs are read where they are when their tokens are rows of one stride
        # (slices of a packed projection's output: `modeling.projections`); else made contiguous, as the
        # backward reads them
        xs = [t if not grad and i < 7 and token_stride(t) is not None else t.contiguous() for i, t in enumerate(xs)]
        n_rows = B * T * H
        outs = [new_output(q1.shape, q1.device, q1.dtype) for _ in range(5)]
        gs = [new_output(q1.shape, q1.device) for _ in range(2)]  # fp32
        BD = block_size(D, 1)
        BR = rows_per_program(BD, ELEMENTS)
        if n_rows:
            sse_features_fwd[(triton.cdiv(n_rows, BR),)](*xs, *outs, *gs, n_rows, 1.0 / normalizer,
                                                         *(token_stride(t) for t in xs[:7]), H, D, BD, BR, num_warps=4)
        if grad:
            ctx.save_for_backward(*xs)
        ctx.normalizer = normalizer
        return (*outs, *gs)

    @staticmethod
    def backward(ctx, *grads):
        xs = ctx.saved_tensors
        q1, z1, bias1 = xs[0], xs[5], xs[7]
        B, T, H, D = q1.shape
        n_rows = B * T * H
        dxs = [new_output(q1.shape, q1.device, q1.dtype) for _ in range(5)]
        dzs = [new_output(q1.shape, q1.device) for _ in range(2)]  # fp32: the biases' gradients sum them
        BD = block_size(D, 1)
        BR = rows_per_program(BD, ELEMENTS)
        if n_rows:
            sse_features_bwd[(triton.cdiv(n_rows, BR),)](*xs, *(g.contiguous() for g in grads), *dxs, *dzs, n_rows,
                                                         1.0 / ctx.normalizer, H, D, BD, BR, num_warps=4)
        dbs = [dz.view(-1, H * D).sum(0).to(bias1.dtype) if ctx.needs_input_grad[7 + i] else None
               for i, dz in enumerate(dzs)]
        dzs = [dz.view(B, T, H * D).to(z1.dtype) for dz in dzs]
        return (*dxs, *dzs, *dbs, None, None)
