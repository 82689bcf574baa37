"""Sliding-window softmax attention with attention sinks over causal rows, on Triton kernels
(`triton_window.py`): query t of a row sees key j when j <= t and (t - j < window or j < sinks), the
row's index being the position (every token real, or padding only after the real ones, whose outputs
the caller drops). That is the attention of a window branch (`modeling/window.py`) and of the sliding
layers of converted Mistral / Qwen models at prefill and in training: O(T W) work and memory, no mask
tensor, forward and backward. `modeling.base.banded_window_attention` is the PyTorch form the model
runs where the kernels do not apply (the CPU, padding before real tokens, a window ring holding earlier
keys, attention dropout).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_utils import TRITON_DTYPES
from .utils import resolve_precision

#: The largest head dim the kernels take.
MAX_DIM = 256
#: The most sinks the kernels take (one tile of keys).
MAX_SINKS = 64
#: The most rows x query heads of a call (the kernels' second grid dimension).
MAX_ROWS_X_HEADS = 65535


def window_unsupported(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int) -> str | None:
    """Why the kernels cannot take these inputs, or None. q [B, HQ, T, D], k, v [B, H, T, D]."""
    if q.dtype not in TRITON_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype} / {k.dtype} / {v.dtype} (one of {TRITON_DTYPES}, alike)"
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        return f"shapes {list(q.shape)} / {list(k.shape)} / {list(v.shape)} ([B, HQ, T, D], [B, H, T, D] twice)"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads over {k.shape[1]} KV heads"
    if q.shape[-1] > MAX_DIM:
        return f"head dim {q.shape[-1]} (at most {MAX_DIM})"
    if q.shape[0] * q.shape[1] > MAX_ROWS_X_HEADS:
        return f"{q.shape[0]} rows x {q.shape[1]} query heads (at most {MAX_ROWS_X_HEADS}: a grid dimension)"
    if window < 1 or not 0 <= sinks <= MAX_SINKS:
        return f"window {window}, sinks {sinks} (window >= 1, 0 <= sinks <= {MAX_SINKS})"
    return None


def window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, scaling: float, sinks: int = 0,
                     precision: str = "auto") -> Tensor:
    """Softmax attention of causal rows over a sliding window of `window` keys plus the first `sinks`
    (module docstring). q [B, HQ, T, D], k, v [B, H, T, D] (H divides HQ; any strides with unit stride
    in D); `precision` of fp32 operands' dots ("auto": TF32 on CUDA, exact elsewhere; "tf32"; "ieee").
    Returns o [B, T, HQ, D] in q's dtype, as Transformers' attention functions do; differentiable in
    q, k and v."""
    why = window_unsupported(q, k, v, window, sinks)
    if why is not None:
        raise ValueError(f"window_attention does not take these inputs: {why}")
    from .triton_window import WindowAttention

    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    ieee = q.dtype == torch.float32 and resolve_precision(precision, q.device) == "ieee"
    return WindowAttention.apply(q, k, v, window, sinks, float(scaling), ieee)
