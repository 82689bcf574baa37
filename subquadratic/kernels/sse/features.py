"""SSE's feature maps and GLA decays in one pass: what the mixer computes between its projections
and the state recurrence.

From the projections q1 [B, T, H, D], k1, v [B, T, HK, D] (HK KV heads, each serving H / HK query
heads: repeated to H heads), the second branch's q2, k2 [B, T, H, D] and the decay projections z1, z2
[B, T, H * D] (before their biases), the GLA base takes

    SiLU(q1), softmax_D(k1), SiLU(q2), softmax_D(k2), SiLU(v),
    g_i = logsigmoid(z_i + bias_i) / normalizer       (fp32, <= 0)

where q2_mode says what q2 and k2 are: "full" the second branch's pre-activations, "offset" their
low-rank offsets (q2 <- q1 + q2, k2 <- k1 + k2, the sums taken in fp32 inside the kernel), "same" none
(q2 = q1, k2 = k1; the arguments are ignored).

In PyTorch that is about twenty elementwise launches and as many passes over [B, T, H, D] tensors
(the keys' softmax in fp32 and back, the decays' casts, bias, logsigmoid and division in fp32), and
autograd saves the fp32 intermediates. `sse_gla_features` runs it as one Triton kernel forward and
one backward (`triton_features.py`), computing in fp32 and rounding where the PyTorch form rounds
(each output once, to its input's dtype; the decays stay fp32), and saves only its inputs. The kernel
reads its inputs where they are (column slices of a packed projection: no copies) and the KV heads in
place of their repeat.
`sse_gla_features_reference` is that PyTorch form (fp64 stays fp64): the fallback off CUDA and the
tests' oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..triton_utils import TRITON_DTYPES
from ..utils import acc_dtype, fused_kernel, run_function

#: The largest head dim the kernel takes (one block per row).
MAX_DIM = 256


def sse_gla_features_reference(q1: Tensor, k1: Tensor, q2: Tensor | None, k2: Tensor | None, v: Tensor, z1: Tensor,
                               z2: Tensor, bias1: Tensor, bias2: Tensor, normalizer: float,
                               q2_mode: str = "full") -> tuple[Tensor, ...]:
    """The PyTorch form (module docstring): (SiLU(q1), softmax(k1), SiLU(q2), softmax(k2), SiLU(v), g1, g2)
    at H heads, the keys' softmax in fp32 (fp64 for fp64 keys) rounded to their dtype, g_i [B, T, H, D]
    in fp32 (fp64 for fp64 z)."""
    dt = acc_dtype(z1)
    shape = q1.shape
    G = q1.shape[2] // k1.shape[2]
    if G > 1:
        k1, v = k1.repeat_interleave(G, 2), v.repeat_interleave(G, 2)
    if q2_mode == "same":
        q2, k2 = q1, k1
    elif q2_mode == "offset":
        q2, k2 = q1 + q2, k1 + k2

    def decay(z: Tensor, bias: Tensor) -> Tensor:
        return (F.logsigmoid(z.to(dt) + bias.to(dt)) / normalizer).view(shape)

    def key(k: Tensor) -> Tensor:
        return torch.softmax(k, -1, dtype=acc_dtype(k)).to(k.dtype)

    return (F.silu(q1), key(k1), F.silu(q2), key(k2), F.silu(v), decay(z1, bias1), decay(z2, bias2))


#: What q2 and k2 are (module docstring).
Q2_MODES = ("full", "offset", "same")


def sse_gla_features_unsupported(q1: Tensor, k1: Tensor, q2: Tensor | None, k2: Tensor | None, v: Tensor, z1: Tensor,
                                 z2: Tensor, bias1: Tensor, bias2: Tensor, q2_mode: str = "full") -> str | None:
    """Why the kernel cannot take these inputs, or None."""
    if q2_mode not in Q2_MODES:
        raise ValueError(f"q2_mode must be one of {Q2_MODES}; got {q2_mode!r}")
    xs = (q1, k1, v) if q2_mode == "same" else (q1, k1, q2, k2, v)
    if q1.dtype not in TRITON_DTYPES or any(x.dtype != q1.dtype for x in xs):
        return f"dtypes {[str(x.dtype) for x in xs]} (one of {TRITON_DTYPES}, alike)"
    if z1.dtype not in TRITON_DTYPES or z2.dtype != z1.dtype or bias1.dtype not in TRITON_DTYPES \
            or bias2.dtype != bias1.dtype:
        return f"decay dtypes {z1.dtype} / {z2.dtype} / {bias1.dtype} / {bias2.dtype}"
    if q1.dim() != 4 or any(x.dim() != 4 for x in xs):
        return f"shapes {[list(x.shape) for x in xs]} ([B, T, H, D])"
    B, T, H, D = q1.shape
    HK = k1.shape[2]
    if k1.shape != (B, T, HK, D) or v.shape != k1.shape or HK == 0 or H % HK:
        return f"k1 / v shapes {list(k1.shape)} / {list(v.shape)} ([B, T, HK, D], H = {H} a multiple of HK)"
    if q2_mode != "same" and (q2.shape != q1.shape or k2.shape != q1.shape):
        return f"q2 / k2 shapes {list(q2.shape)} / {list(k2.shape)} (q1's, {list(q1.shape)})"
    if D > MAX_DIM:
        return f"head dim {D} (at most {MAX_DIM})"
    if any(z.shape != (B, T, H * D) for z in (z1, z2)) or any(b.shape != (H * D,) for b in (bias1, bias2)):
        return f"decay shapes {list(z1.shape)} / {list(z2.shape)}, biases {list(bias1.shape)} / {list(bias2.shape)}"
    return None


def sse_gla_features(q1: Tensor, k1: Tensor, q2: Tensor | None, k2: Tensor | None, v: Tensor, z1: Tensor, z2: Tensor,
                     bias1: Tensor, bias2: Tensor, normalizer: float, backend: str = "auto",
                     q2_mode: str = "full") -> tuple[Tensor, ...]:
    """(SiLU(q1), softmax(k1), SiLU(q2), softmax(k2), SiLU(v), g1, g2) at H heads: the values of
    `sse_gla_features_reference` (module docstring).

    q1: [B, T, H, D]; k1, v: [B, T, HK, D] (H a multiple of HK); q2, k2: [B, T, H, D] as q2_mode says
    ("full", "offset"; None or anything for "same"), all of one dtype; z1, z2: [B, T, H * D]; bias1,
    bias2: [H * D]. backend: "auto" runs the Triton kernels on CUDA for inputs they take, else the
    PyTorch form; "triton" the kernels on any device Triton runs on (the CPU interpreter in tests) or a
    ValueError; "torch" the PyTorch form. Differentiable in every tensor."""
    xs = (q1, k1, q2, k2, v, z1, z2, bias1, bias2)
    if fused_kernel(backend, q1.device, "SSE feature", sse_gla_features_unsupported(*xs, q2_mode=q2_mode)):
        from .triton_features import SSEFeatures

        if q2_mode == "same":
            xs = (q1, k1, q1, q1, *xs[4:])  # placeholders the kernel does not read
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in xs)
        return run_function(SSEFeatures, *xs, float(normalizer), q2_mode, grad)
    return sse_gla_features_reference(*xs, normalizer, q2_mode)
