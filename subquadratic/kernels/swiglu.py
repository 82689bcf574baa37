"""The SwiGLU MLP's gate, SiLU(gate) * up, in one pass over a packed projection's output.

Without gradients the MLP's gate and up projections run as one matmul (`modeling.projections`), so
gate and up are column slices of one [B, T, 2 I] output: strided views on which PyTorch's SiLU and
product fall back to their unvectorised kernels (at 8k tokens of Llama-3.2-1B's MLP they took 2.5x
the time of the same ops on contiguous tensors). `silu_mul` reads both slices where they are and
writes the product once (`triton_swiglu.py`), rounding where the PyTorch form rounds (SiLU(gate) to
the inputs' dtype before the product), so it gives that form's values up to the last bit of the
sigmoid. Forward only: with gradients the projections are not packed and the PyTorch form runs.
`silu_mul_reference` is that form: the fallback and the tests' oracle.
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


def silu_mul_takes_kernel(gate: Tensor, up: Tensor, backend: str = "auto") -> bool:
    """Whether `silu_mul(gate, up, backend)` runs the Triton kernel on these inputs."""
    return fused_kernel(backend, gate.device, "silu-mul", silu_mul_unsupported(gate, up))


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
