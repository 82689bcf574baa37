"""Sliding-window softmax attention with attention sinks over causal rows, on Triton kernels
(`triton_window.py`): query t of a row sees key j when j <= t and (t - j < window or j < sinks), the
row's index being the position (every token real, or padding only after the real ones, whose outputs
the caller drops). That is the attention of a window branch (`modeling/window.py`) and of the sliding
layers of converted Mistral / Qwen models at prefill and in training: O(T W) work and memory, no mask
tensor, forward and backward. `window_step` is a static cache's one-token step of a window branch (the
new key written into the window's ring, the query over the ring and the sinks) as one kernel, and
`fresh_ring` a first call's ring and sinks, filled from its keys / values in one kernel (each where
the window branch's plan takes it: `modeling.window.plan_window`). `modeling.base.banded_window_attention`
is the PyTorch form the model runs where the kernels do not apply (the CPU, padding before real tokens,
a window ring holding earlier keys, attention dropout).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .triton_utils import TRITON_DTYPES
from .utils import fused_kernel, resolve_precision, run_function

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
    if k.shape != v.shape:
        return f"shapes {list(q.shape)} / {list(k.shape)} / {list(v.shape)} ([B, HQ, T, D], [B, H, T, D] twice)"
    return window_shapes_unsupported(tuple(q.shape), tuple(k.shape), q.dtype, window, sinks)


def window_shapes_unsupported(q_shape: tuple[int, ...], k_shape: tuple[int, ...], dtype: torch.dtype, window: int,
                              sinks: int) -> str | None:
    """Why the kernels cannot take queries q_shape [B, HQ, T, D] over keys and values k_shape [B, H, T, D]
    of `dtype` (a plan's question: no tensor at hand), or None."""
    if dtype not in TRITON_DTYPES:
        return f"dtype {dtype} (one of {TRITON_DTYPES})"
    if len(q_shape) != 4 or len(k_shape) != 4 or k_shape[0] != q_shape[0] or k_shape[2:] != q_shape[2:]:
        return f"shapes {list(q_shape)} / {list(k_shape)} ([B, HQ, T, D], [B, H, T, D])"
    if q_shape[1] % k_shape[1]:
        return f"{q_shape[1]} query heads over {k_shape[1]} KV heads"
    if q_shape[-1] > MAX_DIM:
        return f"head dim {q_shape[-1]} (at most {MAX_DIM})"
    if q_shape[0] * q_shape[1] > MAX_ROWS_X_HEADS:
        return f"{q_shape[0]} rows x {q_shape[1]} query heads (at most {MAX_ROWS_X_HEADS}: a grid dimension)"
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
    return run_function(WindowAttention, q, k, v, window, sinks, float(scaling), ieee)


def window_step_reference(q, k, v, ring_k, ring_v, ring_pos, sink_k, sink_v, sink_pos, position, window: int,
                          scaling: float) -> Tensor:
    """`window_step` in PyTorch (the kernel's oracle, and the path off CUDA)."""
    import torch.nn.functional as F

    B, H, _, D = k.shape
    W = window
    pos = position[:, None]  # [B, 1]
    slot = pos % W
    index = slot.view(B, 1, 1, 1).expand(B, H, 1, D)
    ring_k.scatter_(2, index, k)
    ring_v.scatter_(2, index, v)
    ring_pos.scatter_(1, slot, pos)
    keys, values, key_pos = ring_k, ring_v, ring_pos
    n_sinks = 0 if sink_k is None else sink_k.shape[2]
    if n_sinks:  # the first tokens are also kept as sinks: written there while position < sinks
        s = pos.clamp(max=n_sinks - 1)
        first = pos < n_sinks  # [B, 1]
        index = s.view(B, 1, 1, 1).expand(B, H, 1, D)
        for buf, new in ((sink_k, k), (sink_v, v)):
            buf.scatter_(2, index, torch.where(first[:, :, None, None], new, buf.gather(2, index)))
        sink_pos.scatter_(1, s, torch.where(first, pos, sink_pos.gather(1, s)))
        keys, values = torch.cat([sink_k, keys], dim=2), torch.cat([sink_v, values], dim=2)
        key_pos = torch.cat([sink_pos, key_pos], dim=1)
    back = pos - key_pos  # [B, S]: how far back each key is
    sink_copy = torch.arange(key_pos.shape[1], device=q.device) < n_sinks
    allowed = (key_pos >= 0) & (back >= 0) & ((back < W) != sink_copy)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None, None], scale=scaling,
                                          enable_gqa=q.shape[1] != H)


def window_step_shapes_unsupported(q_shape: tuple[int, ...], k_shape: tuple[int, ...], dtype: torch.dtype,
                                   sinks: int) -> str | None:
    """Why the step kernel cannot take one token's queries q_shape [B, HQ, 1, D] over keys k_shape
    [B, H, 1, D] of `dtype` with `sinks` sinks (a plan's question: no tensor at hand), or None."""
    if dtype not in TRITON_DTYPES:
        return f"dtype {dtype} (one of {TRITON_DTYPES})"
    if len(q_shape) != 4 or len(k_shape) != 4 or q_shape[2] != 1 or q_shape[1] % k_shape[1]:
        return f"q {list(q_shape)} over k {list(k_shape)} (one token, H dividing HQ)"
    if q_shape[-1] > MAX_DIM or sinks > MAX_SINKS:
        return f"head dim {q_shape[-1]} (at most {MAX_DIM}) or more than {MAX_SINKS} sinks"
    return None


def window_step_unsupported(q: Tensor, k: Tensor, v: Tensor, ring_k: Tensor, ring_v: Tensor, sink_k: Tensor | None,
                            sink_v: Tensor | None) -> str | None:
    """Why the step kernel cannot take these inputs, or None."""
    tensors = (q, k, v, ring_k, ring_v) + (() if sink_k is None else (sink_k, sink_v))
    if q.dtype not in TRITON_DTYPES or any(x.dtype != q.dtype for x in tensors):
        return f"dtypes {[x.dtype for x in tensors]} (one of {TRITON_DTYPES}, alike)"
    why = window_step_shapes_unsupported(tuple(q.shape), tuple(k.shape), q.dtype,
                                         0 if sink_k is None else sink_k.shape[2])
    if why is None and any(x.stride(-1) != 1 for x in tensors):
        return "a tensor without unit stride in the head dim"
    return why


def window_step(q, k, v, ring_k, ring_v, ring_pos, sink_k, sink_v, sink_pos, position, window: int,
                scaling: float, kernel: bool = False, precision: str = "auto") -> Tensor:
    """One decode token of a sliding window with sinks over a ring, the step a captured decode replays:
    the new key / value (k, v [B, H, 1, D]) and position (`position` [B], each row's new token, real)
    go into ring slot position % W of ring_k, ring_v [B, H, W, D] / ring_pos [B, W] and, while position
    < sinks, into sink slot position of sink_k, sink_v [B, H, sinks, D] / sink_pos [B, sinks] (None:
    no sinks), in place; the query q [B, HQ, 1, D] attends over the ring's keys 0 <= position - p < W
    and the sinks W or more back (slots of position -1 are empty). Returns o [B, HQ, 1, D]. `kernel`:
    the Triton kernel (one launch; on the CPU under Triton's interpreter), as the window branch's plan
    decides (`modeling.window.WindowPlan.step_kernel`; a ValueError where the kernel does not take
    these inputs), else `window_step_reference`; fp32 dots exact unless `precision` is "tf32"
    (`decode_attention.exact_decode_dots`); no gradients (a decode step)."""
    if not kernel:
        return window_step_reference(q, k, v, ring_k, ring_v, ring_pos, sink_k, sink_v, sink_pos, position, window,
                                     scaling)
    why = window_step_unsupported(q, k, v, ring_k, ring_v, sink_k, sink_v)
    if why is not None:
        raise ValueError(f"the window decode step kernel does not take these inputs: {why}; call it with kernel=False")
    from .decode_attention import exact_decode_dots
    from .triton_window import window_step_triton

    return window_step_triton(q, k, v, ring_k, ring_v, ring_pos, sink_k, sink_v, sink_pos, position, window,
                              float(scaling), exact_decode_dots(q.dtype, precision))


@functools.lru_cache(maxsize=32)
def _fresh_layout(T: int, W: int, sinks: int, device: torch.device) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """`fresh_ring_reference`'s index tensors for T new tokens, a ring of W slots and `sinks` sink slots,
    made once per shape and device (read only; what a cache keeps is copied from them): the token each
    ring slot takes (None when T < W: slots 0..T-1 take the tokens), the ring's positions [W] (-1:
    empty) and the sinks' positions [sinks] (None without sinks)."""
    slots = torch.arange(W, device=device)
    if T >= W:  # slot s holds the position p in [T - W, T) with p % W = s
        src = T - W + (slots - T) % W
        pos = src
    else:  # slots 0..T-1 hold the tokens, the rest is empty
        src, pos = None, torch.where(slots < T, slots, -1)
    sink_pos = None
    if sinks:
        sink = torch.arange(sinks, device=device)
        sink_pos = torch.where(sink < min(sinks, T), sink, -1)
    return src, pos, sink_pos


def fresh_ring_reference(k: Tensor, v: Tensor, window: int, sinks: int = 0) -> tuple:
    """`fresh_ring` in PyTorch ops (the kernel's oracle, and the path off CUDA): six launches."""
    import torch.nn.functional as F

    B, H, T, D = k.shape
    W = window
    src, pos, sink_pos = _fresh_layout(T, W, sinks, k.device)
    if src is not None:
        ring_k, ring_v = k.index_select(2, src), v.index_select(2, src)
    else:
        pad = (0, 0, 0, W - T)
        ring_k, ring_v = F.pad(k, pad), F.pad(v, pad)
    ring_pos = pos.expand(B, W).clone(memory_format=torch.contiguous_format)  # a copy: the cache writes it in place
    if not sinks:
        return ring_k, ring_v, ring_pos, None, None, None
    n = min(sinks, T)
    pad = (0, 0, 0, sinks - n)
    return (ring_k, ring_v, ring_pos, F.pad(k[:, :, :n], pad), F.pad(v[:, :, :n], pad),
            sink_pos.expand(B, sinks).clone(memory_format=torch.contiguous_format))


def fresh_ring_shapes_unsupported(k_shape: tuple[int, ...], dtype: torch.dtype, window: int,
                                  sinks: int) -> str | None:
    """Why the fill kernel cannot take keys and values k_shape [B, H, T, D] of `dtype` (a plan's question:
    no tensor at hand), or None."""
    if dtype not in TRITON_DTYPES:
        return f"dtype {dtype} (one of {TRITON_DTYPES})"
    if len(k_shape) != 4 or k_shape[-1] > MAX_DIM or window < 1 or not 0 <= sinks <= MAX_SINKS:
        return (f"shape {list(k_shape)} ([B, H, T, D], head dim at most {MAX_DIM}), window {window} (>= 1), "
                f"sinks {sinks} (at most {MAX_SINKS})")
    return None


def fresh_ring_unsupported(k: Tensor, v: Tensor, window: int, sinks: int) -> str | None:
    """Why the fill kernel cannot take these inputs, or None."""
    if k.dtype not in TRITON_DTYPES or v.dtype != k.dtype:
        return f"dtypes {k.dtype} / {v.dtype} (one of {TRITON_DTYPES}, alike)"
    if k.dim() != 4 or v.shape != k.shape:
        return f"shapes {list(k.shape)} / {list(v.shape)} ([B, H, T, D] twice)"
    why = fresh_ring_shapes_unsupported(tuple(k.shape), k.dtype, window, sinks)
    if why is None and (k.stride(-1) != 1 or v.stride(-1) != 1):
        return "a tensor without unit stride in the head dim"
    return why


def fresh_ring(k: Tensor, v: Tensor, window: int, sinks: int = 0, backend: str = "auto") -> tuple:
    """The window ring and sinks after a first call of T real tokens in every row (positions 0..T-1):
    k, v [B, H, T, D] -> (ring_k, ring_v [B, H, W, D], ring_pos [B, W] int64, sink_k, sink_v [B, H, sinks, D],
    sink_pos [B, sinks] int64; the last three None without sinks), new tensors in the layout
    `modeling.window.WindowRing` keeps: position p in ring slot p % W (the last W tokens), token j in sink
    slot j, position -1 in a slot no token took (zeros there). `backend` as the fused ops' ("auto": the
    Triton kernel on CUDA, one launch where the PyTorch ops take six; "triton"; "torch")."""
    if fused_kernel(backend, k.device, "window ring fill", fresh_ring_unsupported(k, v, window, sinks)):
        from .triton_window import fresh_ring_triton

        return fresh_ring_triton(k, v, window, sinks)
    return fresh_ring_reference(k, v, window, sinks)
