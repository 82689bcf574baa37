"""The output norm and gate of the linear mixers in one pass: RMSNorm_w(x) * SiLU(gate).

HLA (per-head weight [H, D]) and SSE (one weight [D] for every head) end each layer with
`(x * rsqrt(mean(x^2) + eps) * w).to(x.dtype) * silu(gate)` over the head dim, eleven elementwise
launches in PyTorch (the casts, the square, the mean, the rsqrt, the products, the SiLU).
`norm_gate` runs it as one Triton kernel forward and one backward (dx, dgate and the rows' weight
gradients, summed per head), computing in fp32 and rounding where the PyTorch form rounds (the
normalised x and SiLU(gate) to x's dtype before their product), so it gives the PyTorch form's
values up to the last bit of the rsqrt and the sigmoid. `norm_gate_reference` is that PyTorch form
(fp64 stays fp64): the fallback off CUDA and the tests' oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .triton_utils import TRITON_DTYPES, block_size
from .utils import acc_dtype, new_output, triton_available

#: Rows per program; the head dim is one block (at most MAX_DIM).
ROWS = 16
MAX_DIM = 256


def norm_gate_reference(x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """RMSNorm_weight(x) * SiLU(gate) in PyTorch: x, gate [..., H, D], weight [H, D] or [D]; the norm
    in fp32 (fp64 for fp64 x), rounded to x's dtype, times SiLU(gate) in x's dtype."""
    xf = x.to(acc_dtype(x))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.to(xf.dtype)).to(x.dtype) * F.silu(gate)


def _kernels():
    from .utils import import_triton

    triton, tl = import_triton()

    @triton.jit
    def fwd(X, W, GATE, Y, n_rows, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.arange(0, BD)
        m = (rows < n_rows)[:, None] & (cols < D)[None, :]
        off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(X + off, mask=m, other=0.0).to(tl.float32)
        g = tl.load(GATE + off, mask=m, other=0.0).to(tl.float32)
        w = tl.load(W + (rows % H)[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)  # [BR]
        n = (x * r[:, None] * w).to(Y.dtype.element_ty).to(tl.float32)  # rounded as the PyTorch form rounds
        s = (g * tl.sigmoid(g)).to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + off, (n * s).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def bwd(X, W, GATE, DY, DX, DG, DW, n_rows, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
            BR: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.arange(0, BD)
        m = (rows < n_rows)[:, None] & (cols < D)[None, :]
        off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(X + off, mask=m, other=0.0).to(tl.float32)
        g = tl.load(GATE + off, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + off, mask=m, other=0.0).to(tl.float32)
        w = tl.load(W + (rows % H)[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)  # [BR]
        xhat = x * r[:, None]
        sig = tl.sigmoid(g)
        dn = dy * g * sig  # d out / d norm(x) = silu(g)
        dg = dy * xhat * w * sig * (1.0 + g * (1.0 - sig))
        dxhat = dn * w
        dx = r[:, None] * (dxhat - xhat * (tl.sum(dxhat * xhat, 1) / D)[:, None])
        tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=m)
        tl.store(DG + off, dg.to(DG.dtype.element_ty), mask=m)
        tl.store(DW + off, dn * xhat, mask=m)  # each row's weight gradient, fp32

    return triton, fwd, bwd


_KERNELS: tuple | None = None


def _get():
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _kernels()
    return _KERNELS


class _NormGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps):
        triton, fwd, _ = _get()
        D = x.shape[-1]
        H = weight.shape[0] if weight.dim() == 2 else 1
        xc, gc = x.contiguous(), gate.contiguous()
        n_rows = xc.numel() // D
        y = new_output(x.shape, x.device, x.dtype)
        fwd[(triton.cdiv(n_rows, ROWS),)](xc, weight.contiguous(), gc, y, n_rows, eps, H, D, block_size(D, 1), ROWS,
                                          num_warps=4)
        ctx.save_for_backward(xc, weight, gc)
        ctx.eps, ctx.H = eps, H
        return y

    @staticmethod
    def backward(ctx, dy):
        triton, _, bwd = _get()
        x, weight, gate = ctx.saved_tensors
        D, H = x.shape[-1], ctx.H
        n_rows = x.numel() // D
        dx = new_output(x.shape, x.device, x.dtype)
        dg = new_output(gate.shape, x.device, gate.dtype)
        dw_rows = new_output(x.shape, x.device)  # fp32
        bwd[(triton.cdiv(n_rows, ROWS),)](x, weight.contiguous(), gate, dy.contiguous(), dx, dg, dw_rows, n_rows,
                                          ctx.eps, H, D, block_size(D, 1), ROWS, num_warps=4)
        dw = dw_rows.view(-1, H, D).sum(0).reshape(weight.shape).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, dg, None


def norm_gate_unsupported(x: Tensor, weight: Tensor, gate: Tensor) -> str | None:
    """Why the kernel cannot take these inputs, or None."""
    if x.dtype not in TRITON_DTYPES or gate.dtype != x.dtype:
        return f"dtypes {x.dtype} / {gate.dtype} (one of {TRITON_DTYPES}, alike)"
    D = x.shape[-1]
    if D > MAX_DIM or gate.shape != x.shape:
        return f"shapes {list(x.shape)} / {list(gate.shape)} (alike, head dim <= {MAX_DIM})"
    if weight.dim() == 2 and (x.dim() < 2 or tuple(weight.shape) != tuple(x.shape[-2:])):
        return f"weight {list(weight.shape)} for x {list(x.shape)} ([H, D] of x's last two dims, or [D])"
    if weight.dim() == 1 and weight.shape[0] != D:
        return f"weight {list(weight.shape)} for head dim {D}"
    return None


def norm_gate_takes_kernel(x: Tensor, weight: Tensor, gate: Tensor) -> bool:
    """Whether `norm_gate(..., backend="auto")` runs the Triton kernels on these inputs (CUDA, Triton
    installed, inputs it takes)."""
    return x.is_cuda and triton_available() and norm_gate_unsupported(x, weight, gate) is None


def norm_gate(x: Tensor, weight: Tensor, gate: Tensor, eps: float, backend: str = "auto") -> Tensor:
    """RMSNorm_weight(x) * SiLU(gate), the values of `norm_gate_reference` (module docstring).

    x, gate: [..., H, D] of one dtype; weight: [H, D] (per head) or [D]. backend: "auto" runs the
    Triton kernels on CUDA for inputs they take (`norm_gate_unsupported`), else the PyTorch form;
    "triton" the kernels on any device Triton runs on (the CPU interpreter in tests) or a
    ValueError; "torch" the PyTorch form. Differentiable in x, weight and gate."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch'; got {backend!r}")
    why = norm_gate_unsupported(x, weight, gate)
    if backend == "triton" and why is not None:
        raise ValueError(f"the norm-gate kernel does not take these inputs: {why}; use backend='auto'")
    if backend == "triton" or (backend == "auto" and norm_gate_takes_kernel(x, weight, gate)):
        return _NormGate.apply(x, weight, gate, eps)
    return norm_gate_reference(x, weight, gate, eps)
