"""The Triton kernels of `swiglu.silu_mul` and `swiglu.silu_mul_packed`: one program per (token, block of
columns) of gate and up [tokens, W] (the tokens on the grid's first axis, the only one that takes more than
65535 programs: a 128k prompt), each read at its own token stride, the product written contiguous;
backward, the gradients of gate and up written into one gradient of the packed output."""

from __future__ import annotations

import torch

from .triton_launch import jit
from .triton_utils import cdiv, token_stride
from .utils import import_triton, new_output

triton, tl = import_triton()

#: Columns a program takes.
BLOCK = 1024


@jit
def silu_mul_fwd(G, U, Y, W, SG, SU, BC: tl.constexpr):
    """y = (SiLU(g) rounded to y's dtype) * u, in fp32, rounded once more."""
    col = tl.program_id(1) * BC + tl.arange(0, BC)
    tok = tl.program_id(0).to(tl.int64)
    m = col < W
    g = tl.load(G + tok * SG + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + tok * SU + col, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + tok * W + col, (s * u).to(Y.dtype.element_ty), mask=m)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate, up [B, T, W] whose tokens are one stride apart (`token_stride`)."""
    B, T, W = gate.shape
    y = new_output((B, T, W), gate.device, gate.dtype)
    if B * T and W:
        with torch.no_grad():
            silu_mul_fwd[(B * T, cdiv(W, BLOCK))](gate, up, y, W, token_stride(gate), token_stride(up), BLOCK,
                                                         num_warps=4)
    return y


@jit
def silu_mul_bwd(G, U, DY, DG, DU, W, SG, SU, SD, BC: tl.constexpr):
    """dg, du of y = (SiLU(g) rounded) * u from dy, rounded where PyTorch's SiLU and product backward
    round: du = dy * SiLU(g) rounded, dg = (dy * u rounded) * sigma(g) (1 + g (1 - sigma(g))); written at
    token stride SD (two column slices of one gradient tensor)."""
    col = tl.program_id(1) * BC + tl.arange(0, BC)
    tok = tl.program_id(0).to(tl.int64)
    m = col < W
    g = tl.load(G + tok * SG + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + tok * SU + col, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(DY + tok * W + col, mask=m, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    s = (g * sig).to(DU.dtype.element_ty).to(tl.float32)
    tl.store(DU + tok * SD + col, (dy * s).to(DU.dtype.element_ty), mask=m)
    ds = (dy * u).to(DG.dtype.element_ty).to(tl.float32)
    tl.store(DG + tok * SD + col, (ds * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=m)


class SiluMulPacked(torch.autograd.Function):
    """SiLU(y[..., g0:g0 + W]) * y[..., u0:u0 + W] for y [B, T, C] whose tokens are one stride apart (a
    packed projection's output), differentiable in y: the backward writes both slices' gradients into one
    [B, T, C] tensor (zero in the columns outside them), so no gradient of two slices is concatenated."""

    @staticmethod
    def forward(ctx, y, g0, u0, W):
        out = silu_mul_triton(y[..., g0:g0 + W], y[..., u0:u0 + W])
        ctx.save_for_backward(y)
        ctx.cols = g0, u0, W
        return out

    @staticmethod
    def backward(ctx, dout):
        (y,) = ctx.saved_tensors
        g0, u0, W = ctx.cols
        B, T, C = y.shape
        covered = sorted((g0, u0)) == [0, W] and C == 2 * W
        dy = torch.empty_like(y, memory_format=torch.contiguous_format) if covered else torch.zeros_like(
            y, memory_format=torch.contiguous_format)
        gate, up = y[..., g0:g0 + W], y[..., u0:u0 + W]
        if B * T and W:
            silu_mul_bwd[(B * T, cdiv(W, BLOCK))](gate, up, dout.contiguous(), dy[..., g0:], dy[..., u0:], W,
                                                  token_stride(gate), token_stride(up), C, BLOCK, num_warps=4)
        return dy, None, None, None
