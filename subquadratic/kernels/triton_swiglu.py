"""The Triton kernel of `swiglu.silu_mul`: one program per (block of columns, token) of gate and up
[tokens, W], each read at its own token stride, the product written contiguous."""

from __future__ import annotations

import torch

from .triton_launch import jit
from .triton_utils import token_stride
from .utils import import_triton, new_output

triton, tl = import_triton()

#: Columns a program takes.
BLOCK = 1024


@jit
def silu_mul_fwd(G, U, Y, W, SG, SU, BC: tl.constexpr):
    """y = (SiLU(g) rounded to y's dtype) * u, in fp32, rounded once more."""
    col = tl.program_id(0) * BC + tl.arange(0, BC)
    tok = tl.program_id(1).to(tl.int64)
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
            silu_mul_fwd[(triton.cdiv(W, BLOCK), B * T)](gate, up, y, W, token_stride(gate), token_stride(up), BLOCK,
                                                         num_warps=4)
    return y
