"""Softmax attention of one new token per row over a long key / value cache under a mask: the decode
step of a softmax layer over a static cache (whose empty slots a mask hides) or over a growing cache
with padding. Where the softmax layer's plan takes them (`modeling.base.plan_softmax`: CUDA under
"auto") it runs on Triton kernels split over the keys (`triton_decode.py`, two launches), reading
each key and value once for the G query heads of its KV head; Transformers' SDPA function instead
copies the keys and values G times whenever a mask is given, and SDPA itself parallelises a single
query row poorly. `decode_attention_reference` is the PyTorch form (the path off CUDA and the oracle),
the one-token case of `grouped_query_attention` (several new tokens under a mask: the G query heads
of a KV head as G T rows of it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_utils import TRITON_DTYPES
from .utils import KERNEL_PRECISIONS

#: The largest head dim the kernels take.
MAX_DIM = 256
#: The most query heads of a KV head the kernels take (one tile of rows).
MAX_GROUP = 64


def grouped_query_attention(q, k, v, mask: Tensor, scaling: float, dropout: float = 0.0) -> Tensor:
    """Masked SDPA of HQ query heads over H key / value heads without repeating the keys and values:
    the G = HQ / H query heads of a group (heads hG .. hG + G - 1, `repeat_kv`'s order) become G T rows
    of one head against its keys, under the mask [B, 1, T, S] (additive or bool) tiled G times along
    the rows (a stride-0 view at T = 1). Transformers' SDPA function copies the keys and values G times
    when a mask is given. Returns o [B, T, HQ, D] as Transformers' attention functions do."""
    import torch.nn.functional as F

    B, HQ, T, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = HQ // H
    mask = mask.expand(B, 1, T, S)[:, :, None].expand(B, 1, G, T, S).reshape(B, 1, G * T, S)
    o = F.scaled_dot_product_attention(q.reshape(B, H, G * T, D), k, v, attn_mask=mask, dropout_p=dropout,
                                       scale=scaling)
    return o.reshape(B, HQ, T, D).transpose(1, 2)  # SDPA may return a transposed layout (CUDA)


def decode_attention_reference(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float) -> Tensor:
    """`decode_attention` in PyTorch: `grouped_query_attention` at one token (no repeated keys)."""
    return grouped_query_attention(q, k, v, allowed[:, None, None, :], scaling).transpose(1, 2)


def decode_shapes_unsupported(q_shape: tuple[int, ...], k_shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
    """Why the kernels cannot take one token's queries q_shape [B, HQ, 1, D] over keys and values k_shape
    [B, H, S, D] of `dtype` (a plan's question: no tensor at hand), or None."""
    if dtype not in TRITON_DTYPES:
        return f"dtype {dtype} (one of {TRITON_DTYPES})"
    if len(q_shape) != 4 or q_shape[2] != 1 or len(k_shape) != 4 or q_shape[1] % k_shape[1]:
        return f"shapes {list(q_shape)} / {list(k_shape)} ([B, HQ, 1, D], [B, H, S, D])"
    if q_shape[-1] > MAX_DIM or q_shape[1] // k_shape[1] > MAX_GROUP:
        return f"head dim {q_shape[-1]} (at most {MAX_DIM}) or {q_shape[1] // k_shape[1]} query heads a KV head"
    return None


def decode_unsupported(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> str | None:
    """Why the kernels cannot take these inputs, or None."""
    if q.dtype not in TRITON_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype} / {k.dtype} / {v.dtype} (one of {TRITON_DTYPES}, alike)"
    if q.dim() != 4 or q.shape[2] != 1 or k.dim() != 4 or k.shape != v.shape or q.shape[1] % k.shape[1]:
        return f"shapes {list(q.shape)} / {list(k.shape)} / {list(v.shape)} ([B, HQ, 1, D], [B, H, S, D] twice)"
    if allowed.dtype != torch.bool or allowed.shape != (q.shape[0], k.shape[2]):
        return f"allowed {allowed.dtype} {list(allowed.shape)} (bool [B, S])"
    why = decode_shapes_unsupported(tuple(q.shape), tuple(k.shape), q.dtype)
    if why is None and any(x.stride(-1) != 1 for x in (q, k, v, allowed)):
        return "a tensor without unit stride in its last dim"
    return why


def decode_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float, kernel: bool = False,
                     precision: str = "auto") -> Tensor:
    """o [B, HQ, 1, D]: query q [B, HQ, 1, D] over keys / values k, v [B, H, S, D] (H divides HQ; query
    head i reads KV head i // (HQ / H)) where allowed [B, S] (bool) is true; every row must allow a key.
    `kernel`: the Triton kernels (on the CPU under Triton's interpreter), as the softmax layer's plan
    decides (`modeling.base.plan_softmax`'s "decode_kernel" path; a ValueError where they do not take
    these inputs), else `decode_attention_reference`; fp32 operands' dots are exact unless `precision`
    is "tf32" (a decode step reads memory far longer than it computes: exact costs nothing, and the
    step gives the values of the growing cache's SDPA). No gradients (a decode step)."""
    if not kernel:
        return decode_attention_reference(q, k, v, allowed, scaling)
    why = decode_unsupported(q, k, v, allowed)
    if why is not None:
        raise ValueError(f"the decode attention kernels do not take these inputs: {why}; call it with kernel=False")
    from .triton_decode import decode_triton

    return decode_triton(q, k, v, allowed.view(torch.uint8), float(scaling),
                         exact_decode_dots(q.dtype, precision))


def exact_decode_dots(dtype: torch.dtype, precision: str) -> bool:
    """Whether a decode step's kernel runs its fp32 dots exactly ("ieee"): fp32 operands unless
    `precision` asks for "tf32" (16-bit operands always run on the tensor cores)."""
    if precision not in KERNEL_PRECISIONS:
        raise ValueError(f"kernel_precision must be one of {', '.join(KERNEL_PRECISIONS)}; got {precision!r}")
    return dtype == torch.float32 and precision != "tf32"
