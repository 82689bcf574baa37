"""The output norm and gate of the linear mixers in one pass, RMSNorm_w(x) * SiLU(gate), and SPLA's
residual norm added to the sparse output, o + RMSNorm_w(x) (`add_norm`).

HLA (per-head weight [H, D]) and SSE (one weight [D] for every head) end each layer with
`(x * rsqrt(mean(x^2) + eps) * w).to(x.dtype) * silu(gate)` over the head dim, eleven elementwise
launches in PyTorch (the casts, the square, the mean, the rsqrt, the products, the SiLU).
`norm_gate` runs it as one Triton kernel forward and one backward (`triton_norm_gate.py`: dx,
dgate and the rows' weight gradients, summed per head), computing in fp32 and rounding where the
PyTorch form rounds (the normalised x and SiLU(gate) to x's dtype before their product), so it
gives the PyTorch form's values up to the last bit of the rsqrt and the sigmoid.
`norm_gate_reference` is that PyTorch form (fp64 stays fp64): the fallback off CUDA and the tests' oracle.

`add_norm` is SPLA's o + RMSNorm_gamma(o_rla) (`modeling.fused.HeadNorm.add`; nine launches forward in
PyTorch, more backward, over [tokens, heads, D] tensors) on the same row kernels: one forward, one
backward (dx and the rows' weight gradients; do is dy), the norm rounded to x's dtype before the add
as `add_norm_reference` rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .triton_utils import TRITON_DTYPES
from .utils import acc_dtype, fused_kernel, run_function

#: The largest head dim the kernel takes (one block per row).
MAX_DIM = 256


def norm_gate_reference(x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """RMSNorm_weight(x) * SiLU(gate) in PyTorch: x, gate [..., H, D], weight [H, D] or [D]; the norm
    in fp32 (fp64 for fp64 x), rounded to x's dtype, times SiLU(gate) in x's dtype."""
    xf = x.to(acc_dtype(x))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.to(xf.dtype)).to(x.dtype) * F.silu(gate)


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


def norm_gate(x: Tensor, weight: Tensor, gate: Tensor, eps: float, backend: str = "auto") -> Tensor:
    """RMSNorm_weight(x) * SiLU(gate), the values of `norm_gate_reference` (module docstring).

    x, gate: [..., H, D] of one dtype; weight: [H, D] (per head) or [D]. backend: "auto" runs the
    Triton kernels on CUDA for inputs they take (`norm_gate_unsupported`), else the PyTorch form;
    "triton" the kernels on any device Triton runs on (the CPU interpreter in tests) or a
    ValueError; "torch" the PyTorch form. Differentiable in x, weight and gate."""
    if fused_kernel(backend, x.device, "norm-gate", norm_gate_unsupported(x, weight, gate)):
        from .triton_norm_gate import NormGate

        return run_function(NormGate, x, weight, gate, eps)
    return norm_gate_reference(x, weight, gate, eps)


def add_norm_reference(o: Tensor, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """o + RMSNorm_weight(x) in PyTorch (x, o [..., H, D], weight [H, D] or [D]): the norm in fp32 (fp64
    for fp64 x), rounded to x's dtype, then added to o (in their promoted dtype)."""
    xf = x.to(acc_dtype(x))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return o + (xf * weight.to(xf.dtype)).to(x.dtype)


def add_norm(o: Tensor, x: Tensor, weight: Tensor, eps: float, backend: str = "auto") -> Tensor:
    """o + RMSNorm_weight(x), the values of `add_norm_reference`: o, x [..., H, D] of one dtype,
    weight [H, D] or [D]; backends as `norm_gate`'s. Differentiable in o, x and weight."""
    if fused_kernel(backend, x.device, "add-norm", norm_gate_unsupported(x, weight, o)):
        from .triton_norm_gate import AddNorm

        return run_function(AddNorm, o, x, weight, eps)
    return add_norm_reference(o, x, weight, eps)
