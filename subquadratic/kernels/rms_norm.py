"""The decoder's RMSNorm, and the residual add before it, as one kernel each way.

Every decoder layer runs `x + h` then LlamaRMSNorm, and the model ends with one more norm: in PyTorch
about eight launches a norm (the casts, the square, the mean, the rsqrt, the products) over [tokens,
hidden] tensors, with as many host calls. `rms_norm` and `add_rms_norm` run each as one Triton kernel
forward and one backward (`triton_rms_norm.py`), computing in fp32 and rounding where LlamaRMSNorm
rounds: the normalised x to x's dtype, then its product with the weight to their promoted dtype (and
the residual sum to its dtype first). They give LlamaRMSNorm's values up to the last bit of the mean
and the rsqrt. `rms_norm_reference` / `add_rms_norm_reference` are those PyTorch forms (fp64 stays
fp64): the fallback and the tests' oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_utils import TRITON_DTYPES
from .utils import acc_dtype, fused_kernel, run_function

#: The largest hidden size the kernels take (one block per row).
MAX_DIM = 16384


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)) in fp32 (fp64 for fp64 x), rounded to x's dtype
    before the product."""
    h = x.to(acc_dtype(x))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_reference(x: Tensor, h: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + h, rms_norm_reference(x + h)): a residual add and the norm after it."""
    s = x + h
    return s, rms_norm_reference(s, weight, eps)


def rms_norm_unsupported(x: Tensor, weight: Tensor, h: Tensor | None = None) -> str | None:
    """Why the kernels cannot take these inputs, or None."""
    if x.dtype not in TRITON_DTYPES or weight.dtype not in TRITON_DTYPES or (h is not None and h.dtype != x.dtype):
        return f"dtypes {x.dtype} / {weight.dtype} (of {TRITON_DTYPES}; the residual's as x's)"
    D = x.shape[-1]
    if D > MAX_DIM or weight.shape != (D,) or (h is not None and h.shape != x.shape):
        return f"shapes {list(x.shape)} / weight {list(weight.shape)} (weight [D], D <= {MAX_DIM}; residual as x)"
    return None


def rms_norm(x: Tensor, weight: Tensor, eps: float, backend: str = "auto") -> Tensor:
    """LlamaRMSNorm(x) with this weight [D] and eps, the values of `rms_norm_reference`. backend: "auto" runs
    the Triton kernels on CUDA for inputs they take (`rms_norm_unsupported`), else the PyTorch form;
    "triton" the kernels on any device Triton runs on (the CPU interpreter in tests) or a ValueError;
    "torch" the PyTorch form. Differentiable in x and weight."""
    if fused_kernel(backend, x.device, "rms-norm", rms_norm_unsupported(x, weight)):
        from .triton_rms_norm import RMSNormFn

        return run_function(RMSNormFn, x, None, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: Tensor, h: Tensor, weight: Tensor, eps: float, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """(x + h, LlamaRMSNorm(x + h)), the values of `add_rms_norm_reference`: x, h [..., D] of one dtype;
    backends as `rms_norm`'s. Differentiable in x, h and weight (through both outputs)."""
    if fused_kernel(backend, x.device, "rms-norm", rms_norm_unsupported(x, weight, h)):
        from .triton_rms_norm import RMSNormFn

        return run_function(RMSNormFn, x, h, weight, eps)
    return add_rms_norm_reference(x, h, weight, eps)
