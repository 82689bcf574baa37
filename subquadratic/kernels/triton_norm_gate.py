"""The Triton kernels of `norm_gate` (RMSNorm_w(x) * SiLU(gate) over the head dim, module
`norm_gate.py`): one program per ROWS rows of [rows, D] (row r's weight row r % H), forward and
backward (dx, dgate and each row's weight gradient, summed per head by the caller)."""

from __future__ import annotations

import torch

from .triton_utils import block_size
from .utils import import_triton, new_output

triton, tl = import_triton()

#: Rows per program; the head dim is one block.
ROWS = 16


@triton.jit
def _rows(X, W, GATE, n_rows, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """This program's rows: offsets, mask, x, gate and weight in fp32, and rsqrt(mean(x^2) + eps)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows < n_rows)[:, None] & (cols < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(X + off, mask=m, other=0.0).to(tl.float32)
    g = tl.load(GATE + off, mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + (rows % H)[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)  # [BR]
    return off, m, x, g, w, r


@triton.jit
def norm_gate_fwd(X, W, GATE, Y, n_rows, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                  BR: tl.constexpr):
    off, m, x, g, w, r = _rows(X, W, GATE, n_rows, eps, H, D, BD, BR)
    n = (x * r[:, None] * w).to(Y.dtype.element_ty).to(tl.float32)  # rounded as the PyTorch form rounds
    s = (g * tl.sigmoid(g)).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + off, (n * s).to(Y.dtype.element_ty), mask=m)


@triton.jit
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


class NormGate(torch.autograd.Function):
    """RMSNorm_weight(x) * SiLU(gate) on the kernels: x, gate [..., H, D] of one dtype, weight [H, D]
    or [D]; differentiable in x, weight and gate."""

    @staticmethod
    def forward(ctx, x, weight, gate, eps):
        D = x.shape[-1]
        H = weight.shape[0] if weight.dim() == 2 else 1
        xc, gc, wc = x.contiguous(), gate.contiguous(), weight.contiguous()
        n_rows = xc.numel() // D
        y = new_output(x.shape, x.device, x.dtype)
        norm_gate_fwd[(triton.cdiv(n_rows, ROWS),)](xc, wc, gc, y, n_rows, eps, H, D, block_size(D, 1), ROWS,
                                                    num_warps=4)
        ctx.save_for_backward(xc, wc, gc)
        ctx.eps, ctx.H, ctx.weight_shape, ctx.weight_dtype = eps, H, weight.shape, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, gate = ctx.saved_tensors
        D, H = x.shape[-1], ctx.H
        n_rows = x.numel() // D
        dx = new_output(x.shape, x.device, x.dtype)
        dg = new_output(gate.shape, x.device, gate.dtype)
        dw_rows = new_output(x.shape, x.device)  # fp32
        norm_gate_bwd[(triton.cdiv(n_rows, ROWS),)](x, weight, gate, dy.contiguous(), dx, dg, dw_rows, n_rows,
                                                    ctx.eps, H, D, block_size(D, 1), ROWS, num_warps=4)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = dw_rows.view(-1, H, D).sum(0).reshape(ctx.weight_shape).to(ctx.weight_dtype)
        return dx, dw, dg, None
