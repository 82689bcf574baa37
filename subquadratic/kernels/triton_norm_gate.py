"""The Triton kernels of `norm_gate` (RMSNorm_w(x) * SiLU(gate) over the head dim, module
`norm_gate.py`) and of `add_norm` (o + RMSNorm_w(x)): one program per ROWS rows of [rows, D] (row
r's weight row r % H), forward and backward (dx, dgate and each row's weight gradient, summed per
head by the caller)."""

from __future__ import annotations

import torch

from .triton_launch import jit
from .triton_rms_norm import rms_inverse
from .triton_utils import block_size, cdiv, read_in_place
from .utils import import_triton, new_output, records

triton, tl = import_triton()

#: Rows per program; the head dim is one block.
ROWS = 16


@jit
def _xw(X, W, n_rows, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """This program's rows: their indices, the columns, offsets, mask, x and weight in fp32, and
    rsqrt(mean(x^2) + eps)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows < n_rows)[:, None] & (cols < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(X + off, mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + (rows % H)[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    return rows, cols, off, m, x, w, rms_inverse(x, eps, D)


@jit
def _rows(X, W, GATE, n_rows, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """This program's rows: offsets, mask, x, gate (contiguous, as x) and weight in fp32, and
    rsqrt(mean(x^2) + eps)."""
    rows, cols, off, m, x, w, r = _xw(X, W, n_rows, eps, H, D, BD, BR)
    g = tl.load(GATE + off, mask=m, other=0.0).to(tl.float32)
    return off, m, x, g, w, r


@jit
def norm_gate_rows(x, g, w, r, dtype: tl.constexpr):
    """RMSNorm_w(x) * SiLU(g) of rows x, g, w [rows, BD] (fp32) with r = `rms_inverse(x)`, in `dtype`,
    rounded as the PyTorch form rounds (the normalised x and the gate's SiLU each in `dtype` before their
    product)."""
    n = (x * r[:, None] * w).to(dtype).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
    return (n * s).to(dtype)


@jit
def norm_gate_fwd(X, W, GATE, Y, n_rows, eps, S_G, NH, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                  BR: tl.constexpr):
    """The gate's tokens (NH rows each, contiguous) S_G elements apart: a column slice of a packed
    projection read where it is (S_G = NH * D: contiguous)."""
    rows, cols, off, m, x, w, r = _xw(X, W, n_rows, eps, H, D, BD, BR)
    r64 = rows.to(tl.int64)
    g = tl.load(GATE + ((r64 // NH) * S_G + (r64 % NH) * D)[:, None] + cols[None, :], mask=m, other=0.0)
    tl.store(Y + off, norm_gate_rows(x, g.to(tl.float32), w, r, Y.dtype.element_ty), mask=m)


@jit
def norm_gate_bwd(X, W, GATE, DY, DX, DG, DW, n_rows, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                  BR: tl.constexpr):
    off, m, x, g, w, r = _rows(X, W, GATE, n_rows, eps, H, D, BD, BR)
    dy = tl.load(DY + off, mask=m, other=0.0).to(tl.float32)
    xhat = x * r[:, None]
    sig = tl.sigmoid(g)
    dn = dy * g * sig  # d out / d norm(x) = dy silu(g)
    dg = dy * xhat * w * sig * (1.0 + g * (1.0 - sig))
    dxhat = dn * w
    dx = r[:, None] * (dxhat - xhat * (tl.sum(dxhat * xhat, 1) / D)[:, None])
    tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=m)
    tl.store(DG + off, dg.to(DG.dtype.element_ty), mask=m)
    tl.store(DW + off, dn * xhat, mask=m)  # each row's weight gradient, fp32


def _launch(kernel, x, weight, eps, *tensors, extra: tuple = ()) -> int:
    """One program per ROWS rows of x [..., D] (contiguous): kernel(*tensors, n_rows, eps, *extra, H, D, BD,
    ROWS); returns H, the rows of the weight (1 for a weight [D])."""
    D = x.shape[-1]
    H = weight.shape[0] if weight.dim() == 2 else 1
    n_rows = x.numel() // D
    kernel[(cdiv(n_rows, ROWS),)](*tensors, n_rows, eps, *extra, H, D, block_size(D, 1), ROWS, num_warps=4)
    return H


def _weight_grad(ctx, dw_rows):
    """The weight's gradient: the rows' fp32 gradients [rows, D] summed per weight row."""
    return dw_rows.view(-1, ctx.H, dw_rows.shape[-1]).sum(0).reshape(ctx.weight_shape).to(ctx.weight_dtype)


class NormGate(torch.autograd.Function):
    """RMSNorm_weight(x) * SiLU(gate) on the kernels: x, gate [..., H, D] of one dtype, weight [H, D]
    or [D]; differentiable in x, weight and gate."""

    @staticmethod
    def forward(ctx, x, weight, gate, eps):
        xc, wc = x.contiguous(), weight.contiguous()
        NH = x.shape[-2]
        # without gradients a [B, T, H, D] gate whose tokens are rows of one stride (a column slice of a
        # packed projection) is read where it is; the backward reads a contiguous one
        gc, S_G = read_in_place(gate) if not records(ctx) and gate.dim() == 4 else (gate.contiguous(), NH * x.shape[-1])
        y = new_output(x.shape, x.device, x.dtype)
        ctx.H = _launch(norm_gate_fwd, xc, wc, eps, xc, wc, gc, y, extra=(S_G, NH))
        ctx.save_for_backward(xc, wc, gc)
        ctx.eps, ctx.weight_shape, ctx.weight_dtype = eps, weight.shape, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, gate = ctx.saved_tensors
        dx = new_output(x.shape, x.device, x.dtype)
        dg = new_output(gate.shape, x.device, gate.dtype)
        dw_rows = new_output(x.shape, x.device)  # fp32
        _launch(norm_gate_bwd, x, weight, ctx.eps, x, weight, gate, dy.contiguous(), dx, dg, dw_rows)
        return dx, _weight_grad(ctx, dw_rows) if ctx.needs_input_grad[1] else None, dg, None


@jit
def add_norm_fwd(X, W, OUT_SP, Y, n_rows, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                 BR: tl.constexpr):
    off, m, x, o, w, r = _rows(X, W, OUT_SP, n_rows, eps, H, D, BD, BR)
    n = (x * r[:, None] * w).to(X.dtype.element_ty).to(tl.float32)  # rounded as the PyTorch form rounds
    tl.store(Y + off, (o + n).to(Y.dtype.element_ty), mask=m)


@jit
def add_norm_bwd(X, W, DY, DX, DW, n_rows, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                 BR: tl.constexpr):
    off, m, x, dy, w, r = _rows(X, W, DY, n_rows, eps, H, D, BD, BR)
    xhat = x * r[:, None]
    dxhat = dy * w
    dx = r[:, None] * (dxhat - xhat * (tl.sum(dxhat * xhat, 1) / D)[:, None])
    tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=m)
    tl.store(DW + off, dy * xhat, mask=m)  # each row's weight gradient, fp32


class AddNorm(torch.autograd.Function):
    """o + RMSNorm_weight(x) on the kernels: o, x [..., H, D] of one dtype, weight [H, D] or [D];
    differentiable in o, x and weight."""

    @staticmethod
    def forward(ctx, o, x, weight, eps):
        xc, oc, wc = x.contiguous(), o.contiguous(), weight.contiguous()
        y = new_output(x.shape, x.device, x.dtype)
        ctx.H = _launch(add_norm_fwd, xc, wc, eps, xc, wc, oc, y)
        ctx.save_for_backward(xc, wc)
        ctx.eps, ctx.weight_shape, ctx.weight_dtype, ctx.o_dtype = eps, weight.shape, weight.dtype, o.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = new_output(x.shape, x.device, x.dtype)
        dw_rows = new_output(x.shape, x.device)  # fp32
        _launch(add_norm_bwd, x, weight, ctx.eps, x, weight, dy.contiguous(), dx, dw_rows)
        return dy.to(ctx.o_dtype), dx, _weight_grad(ctx, dw_rows) if ctx.needs_input_grad[2] else None, None
