"""The SwiGLU MLP's gate, SiLU(gate) * up, in one pass over a packed projection's output.

Without gradients the MLP's gate and up projections run as one matmul (`modeling.projections`), so
gate and up are column slices of one [B, T, 2 I] output: strided views on which PyTorch's SiLU and
product fall back to their unvectorised kernels (at 8k tokens of Llama-3.2-1B's MLP they took 2.5x
the time of the same ops on contiguous tensors). `silu_mul` reads both slices where they are and
writes the product once (`triton_swiglu.py`), rounding where the PyTorch form rounds (SiLU(gate) to
the inputs' dtype before the product), so it gives that form's values up to the last bit of the
sigmoid. `silu_mul` has no gradients; `silu_mul_packed` takes the packed output itself and is
differentiable in it: its backward writes the gradients of both slices into one tensor, in one kernel
(PyTorch's backward is three elementwise kernels, and the split's backward one more copy to join
them), rounding where PyTorch's SiLU and product backward round. `silu_mul_reference` is that form: the
fallback and the tests' oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .triton_utils import TRITON_DTYPES, token_stride
from .utils import fused_kernel


def silu_mul_reference(gate: Tensor, up: Tensor) -> Tensor:
    """SiLU(gate) * up in PyTorch (LlamaMLP with hidden_act "silu")."""
    return F.silu(gate) * up


def silu_mul_unsupported(gate: Tensor, up: Tensor) -> str | None:
    """Why the kernel cannot take these inputs, or None."""
    if gate.dtype not in TRITON_DTYPES or up.dtype != gate.dtype:
        return f"dtypes {gate.dtype} / {up.dtype} (one of {TRITON_DTYPES}, alike)"
    if gate.dim() != 3 or gate.shape != up.shape:
        return f"shapes {list(gate.shape)} / {list(up.shape)} (alike, [B, T, I])"
    if token_stride(gate) is None or token_stride(up) is None:
        return "each token's entries must be contiguous, the tokens one stride apart"
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return "inputs that need gradients (the kernel has no backward)"
    return None


def silu_mul(gate: Tensor, up: Tensor, backend: str = "auto") -> Tensor:
    """SiLU(gate) * up [B, T, I] (contiguous), the values of `silu_mul_reference`. gate, up: [B, T, I]
    of one dtype whose tokens are one stride apart (column slices of a packed output, or contiguous).
    backend: "auto" runs the Triton kernel on CUDA for inputs it takes (`silu_mul_unsupported`), else
    the PyTorch form; "triton" the kernel on any device Triton runs on (the CPU interpreter in tests)
    or a ValueError; "torch" the PyTorch form. No gradients through the kernel."""
    if fused_kernel(backend, gate.device, "silu-mul", silu_mul_unsupported(gate, up)):
        from .triton_swiglu import silu_mul_triton

        return silu_mul_triton(gate, up)
    return silu_mul_reference(gate, up)


def silu_mul_packed_unsupported(y: Tensor, g0: int, u0: int, width: int) -> str | None:
    """Why `silu_mul_packed` cannot take these inputs on the kernel, or None."""
    if y.dtype not in TRITON_DTYPES:
        return f"dtype {y.dtype} (one of {TRITON_DTYPES})"
    if y.dim() != 3:
        return f"shape {list(y.shape)} ([B, T, C])"
    C = y.shape[-1]
    if not (0 <= g0 and 0 <= u0 and max(g0, u0) + width <= C and abs(g0 - u0) >= width):
        return f"columns {g0} / {u0} of width {width} (two disjoint slices of the {C} columns)"
    if token_stride(y) is None:
        return "each token's entries must be contiguous, the tokens one stride apart"
    return None


def silu_mul_packed(y: Tensor, g0: int, u0: int, width: int, backend: str = "auto") -> Tensor:
    """SiLU(gate) * up [B, T, width] for gate = y[..., g0:g0 + width], up = y[..., u0:u0 + width] of y
    [B, T, C] (a packed projection's output): the values of `silu_mul_reference` on the two slices,
    differentiable in y. backend as `silu_mul`'s; the kernels forward and backward where taken."""
    gate, up = y[..., g0:g0 + width], y[..., u0:u0 + width]
    if fused_kernel(backend, y.device, "silu-mul", silu_mul_packed_unsupported(y, g0, u0, width)):
        from .triton_swiglu import SiluMulPacked

        if torch.is_grad_enabled() and y.requires_grad:
            return SiluMulPacked.apply(y, g0, u0, width)
        from .triton_swiglu import silu_mul_triton

        return silu_mul_triton(gate, up)
    return silu_mul_reference(gate, up)
