"""Softmax attention of one new token per row over a long key / value cache under a mask: the decode
step of a softmax layer over a static cache (whose empty slots a mask hides) or over a growing cache
with padding. On CUDA it runs on Triton kernels split over the keys (`triton_decode.py`, two
launches), reading each key and value once for the G query heads of its KV head; Transformers'
SDPA function instead copies the keys and values G times whenever a mask is given, and SDPA itself
parallelises a single query row poorly. `decode_attention_reference` is the PyTorch form (the path off
CUDA and the oracle).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_utils import TRITON_DTYPES
from .utils import KERNEL_PRECISIONS, resolve_backend

#: The largest head dim the kernels take.
MAX_DIM = 256
#: The most query heads of a KV head the kernels take (one tile of rows).
MAX_GROUP = 64


def decode_attention_reference(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float) -> Tensor:
    """`decode_attention` in PyTorch (the G query heads of a KV head as G rows of one head: no repeated
    keys)."""
    import torch.nn.functional as F

    B, HQ, _, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = HQ // H
    mask = allowed[:, None, None, :].expand(B, 1, G, S)
    o = F.scaled_dot_product_attention(q.reshape(B, H, G, D), k, v, attn_mask=mask, scale=scaling)
    return o.reshape(B, HQ, 1, D)


def decode_unsupported(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> str | None:
    """Why the kernels cannot take these inputs, or None."""
    if q.dtype not in TRITON_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype} / {k.dtype} / {v.dtype} (one of {TRITON_DTYPES}, alike)"
    if q.dim() != 4 or q.shape[2] != 1 or k.dim() != 4 or k.shape != v.shape or q.shape[1] % k.shape[1]:
        return f"shapes {list(q.shape)} / {list(k.shape)} / {list(v.shape)} ([B, HQ, 1, D], [B, H, S, D] twice)"
    if allowed.dtype != torch.bool or allowed.shape != (q.shape[0], k.shape[2]):
        return f"allowed {allowed.dtype} {list(allowed.shape)} (bool [B, S])"
    if q.shape[-1] > MAX_DIM or q.shape[1] // k.shape[1] > MAX_GROUP:
        return f"head dim {q.shape[-1]} (at most {MAX_DIM}) or {q.shape[1] // k.shape[1]} query heads a KV head"
    if any(x.stride(-1) != 1 for x in (q, k, v, allowed)):
        return "a tensor without unit stride in its last dim"
    return None


def decode_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float, backend: str = "auto",
                     precision: str = "auto") -> Tensor:
    """o [B, HQ, 1, D]: query q [B, HQ, 1, D] over keys / values k, v [B, H, S, D] (H divides HQ; query
    head i reads KV head i // (HQ / H)) where allowed [B, S] (bool) is true; every row must allow a key.
    `backend` as every op's ("auto": the Triton kernels on CUDA); fp32 operands' dots are exact unless
    `precision` is "tf32" (a decode step reads memory far longer than it computes: exact costs nothing,
    and the step gives the values of the growing cache's SDPA). No gradients (a decode step)."""
    why = decode_unsupported(q, k, v, allowed)
    if resolve_backend(backend, q.device, op="decode attention", has_triton=True, has_naive=True,
                       unsupported=why) != "triton":
        return decode_attention_reference(q, k, v, allowed, scaling)
    from .triton_decode import decode_triton

    return decode_triton(q, k, v, allowed.view(torch.uint8), float(scaling),
                         exact_decode_dots(q.dtype, precision))


def exact_decode_dots(dtype: torch.dtype, precision: str) -> bool:
    """Whether a decode step's kernel runs its fp32 dots exactly ("ieee"): fp32 operands unless
    `precision` asks for "tf32" (16-bit operands always run on the tensor cores)."""
    if precision not in KERNEL_PRECISIONS:
        raise ValueError(f"kernel_precision must be one of {', '.join(KERNEL_PRECISIONS)}; got {precision!r}")
    return dtype == torch.float32 and precision != "tf32"
