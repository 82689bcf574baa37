"""The Triton kernels of `rms_norm` / `add_rms_norm` (module `rms_norm.py`): the forward one program per
ROWS rows of [rows, D] (one block spans a row), the residual sum first where there is one; the backward
a fixed number of programs, each walking its share of the rows and keeping its part of the weight
gradient in registers (summed over the programs by the caller)."""

from __future__ import annotations

import torch

from .triton_launch import jit
from .triton_utils import block_size, cdiv, rows_per_program
from .utils import import_triton, new_output, promoted

triton, tl = import_triton()

#: Programs of the backward (each keeps one partial weight gradient [D]).
BWD_PROGRAMS = 512


def _warps(BD: int) -> int:
    return 4 if BD <= 2048 else 8 if BD <= 8192 else 16


@jit
def rms_inverse(x, eps, D: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each row of x [rows, BD] (fp32, zeros past D)."""
    return 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)


@jit
def rms_norm_fwd(X, H, W, S, Y, n_rows, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                 ADD: tl.constexpr):
    """y = w * round_x(x r), r = rsqrt(mean(x^2) + eps), rounded to y's dtype; with ADD, x is first the
    residual sum s = round(x + h), written to S."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows < n_rows)[:, None] & (cols < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(X + off, mask=m, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(H + off, mask=m, other=0.0).to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + off, x, mask=m)
    xf = x.to(tl.float32)
    r = rms_inverse(xf, eps, D)
    n = (xf * r[:, None]).to(X.dtype.element_ty).to(tl.float32)  # h.to(input_dtype)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(Y + off, (w[None, :] * n).to(Y.dtype.element_ty), mask=m)


@jit
def rms_norm_bwd(X, W, DY, DS, DX, DW, n_rows, per_program, eps, D: tl.constexpr, BD: tl.constexpr,
                 HAS_DS: tl.constexpr):
    """Rows [pid * per_program, (pid + 1) * per_program): dx = r (dn - xhat mean(dn xhat)) (+ ds, the
    residual stream's own gradient), dn = dy w; this program's weight gradient sum(dy round_x(xhat))."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    mc = cols < D
    w = tl.load(W + cols, mask=mc, other=0.0).to(tl.float32)
    dw = tl.zeros([BD], dtype=tl.float32)
    for i in range(0, per_program):
        row = pid * per_program + i
        m = mc & (row + tl.zeros([BD], dtype=tl.int32) < n_rows)  # a vector mask (the interpreter's too)
        off = row.to(tl.int64) * D + cols
        x = tl.load(X + off, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + off, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        xhat = x * r
        dn = dy * w
        dx = r * (dn - xhat * (tl.sum(dn * xhat, 0) / D))
        if HAS_DS:
            dx += tl.load(DS + off, mask=m, other=0.0).to(tl.float32)
        tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=m)
        dw += dy * xhat.to(X.dtype.element_ty).to(tl.float32)
    tl.store(DW + pid.to(tl.int64) * D + cols, dw, mask=mc)


class RMSNormFn(torch.autograd.Function):
    """LlamaRMSNorm(x) (h None) or (x + h, LlamaRMSNorm(x + h)) on the kernels: x, h [..., D] of one dtype,
    weight [D]; differentiable in x, h and weight."""

    @staticmethod
    def forward(ctx, x, h, weight, eps):
        D = x.shape[-1]
        xc, wc = x.contiguous(), weight.contiguous()
        add = h is not None
        hc = h.contiguous() if add else xc
        n_rows = xc.numel() // D
        dev = x.device
        y = new_output(x.shape, dev, promoted(weight.dtype, x.dtype))
        s = new_output(x.shape, dev, x.dtype) if add else y
        BD = block_size(D, 1)
        BR = rows_per_program(BD, 4096, 16)
        if n_rows:
            rms_norm_fwd[(cdiv(n_rows, BR),)](xc, hc, wc, s, y, n_rows, eps, D, BD, BR, add,
                                                     num_warps=_warps(BD * BR))
        ctx.save_for_backward(s if add else xc, wc)
        ctx.eps, ctx.add, ctx.weight_dtype = eps, add, weight.dtype
        ctx.set_materialize_grads(False)
        return (s, y) if add else y

    @staticmethod
    def backward(ctx, *grads):
        x, weight = ctx.saved_tensors
        ds, dy = grads if ctx.add else (None, grads[0])
        D = x.shape[-1]
        n_rows = x.numel() // D
        if dy is None:
            dy = torch.zeros_like(x)
        dx = new_output(x.shape, x.device, x.dtype)
        P = max(1, min(n_rows, BWD_PROGRAMS))
        per = cdiv(n_rows, P) if n_rows else 0
        P = cdiv(n_rows, per) if n_rows else 1
        dw = new_output((P, D), x.device)  # fp32 partial sums
        BD = block_size(D, 1)
        if n_rows:
            rms_norm_bwd[(P,)](x, weight, dy.contiguous(), x if ds is None else ds.contiguous(), dx, dw, n_rows, per,
                               ctx.eps, D, BD, ds is not None, num_warps=_warps(BD))
        else:
            dw.zero_()
        dweight = dw.sum(0).to(ctx.weight_dtype) if ctx.needs_input_grad[2] else None
        if ctx.add:
            return dx if ctx.needs_input_grad[0] else None, dx if ctx.needs_input_grad[1] else None, dweight, None
        return dx, None, dweight, None
