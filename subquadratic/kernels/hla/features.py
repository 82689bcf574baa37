"""HLA's inputs in one pass: the L2-normalised, scaled q and k, and k, v repeated over the query
heads of their KV head (HLA keeps one state per query head).

    q' = s q / max(|q|, 1e-12),   k' = s k / max(|k|, 1e-12) of KV head h // G,   v' = v of KV head h // G

In PyTorch (F.normalize, the cast, the scale, two repeat_interleave) that is about a dozen launches
forward and more backward (the norm's and the division's gradients, the repeats' sums over G).
`hla_features` runs it as one Triton kernel forward and one backward (`triton_features.py`),
computing in fp32 and rounding each output once (the PyTorch form rounds the norm, the quotient and
the product each to the input dtype: they agree to the input dtype's rounding). Without the
normalisation (`normalize=False`) the repeat alone runs in PyTorch. `hla_features_reference` is the
PyTorch form: the fallback off CUDA and the tests' oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..triton_utils import TRITON_DTYPES
from ..utils import fused_kernel, run_function

#: The largest head dim the kernel takes (one block per row).
MAX_DIM = 256


def hla_features_reference(q: Tensor, k: Tensor, v: Tensor, scale: float, normalize: bool = True
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """The PyTorch form (module docstring): q [B, T, HQ, D], k [B, T, H, D], v [B, T, H, Dv] ->
    q', k' [B, T, HQ, D], v' [B, T, HQ, Dv]."""
    if normalize:
        q = F.normalize(q, dim=-1).to(q.dtype) * scale
        k = F.normalize(k, dim=-1).to(k.dtype) * scale
    G = q.shape[2] // k.shape[2]
    return q, k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)


def hla_features_unsupported(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why the kernel cannot take these inputs, or None."""
    if q.dtype not in TRITON_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype} / {k.dtype} / {v.dtype} (one of {TRITON_DTYPES}, alike)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] \
            or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
        return f"shapes {list(q.shape)} / {list(k.shape)} / {list(v.shape)} ([B, T, heads, D], KV heads dividing HQ)"
    if max(q.shape[-1], v.shape[-1]) > MAX_DIM:
        return f"head dims {q.shape[-1]} / {v.shape[-1]} (at most {MAX_DIM})"
    return None


def hla_features(q: Tensor, k: Tensor, v: Tensor, scale: float, normalize: bool = True,
                 backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """(q', k', v') of the module docstring, the values of `hla_features_reference` up to the input
    dtype's rounding. backend: "auto" runs the Triton kernels on CUDA for inputs they take, else the
    PyTorch form; "triton" the kernels on any device Triton runs on (the CPU interpreter in tests) or
    a ValueError; "torch" the PyTorch form. Differentiable in q, k and v."""
    kernel = fused_kernel(backend, q.device, "HLA feature", hla_features_unsupported(q, k, v))
    if normalize and kernel:
        from .triton_features import HLAFeatures

        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        return run_function(HLAFeatures, q, k, v, None, None, float(scale), grad)[:3]
    return hla_features_reference(q, k, v, scale, normalize)


def log_alpha_reference(bias: Tensor, proj: Tensor | None, shape: tuple) -> Tensor:
    """HLA's log decays in PyTorch: logsigmoid(bias [+ proj]) in fp32 (fp64 for fp64 inputs), bias [HQ]
    broadcast to `shape` [B, T, HQ], proj [B, T, HQ] or None (a constant decay)."""
    dtype = torch.promote_types(bias.dtype if proj is None else proj.dtype, torch.float32)
    logit = bias.to(dtype).expand(*shape)
    if proj is not None:
        logit = logit + proj.to(dtype)
    return F.logsigmoid(logit)


def decay_unsupported(q: Tensor, bias: Tensor, proj: Tensor | None) -> str | None:
    """Why the feature kernel cannot also take these decay inputs, or None."""
    B, T, HQ = q.shape[:3]
    if bias.shape != (HQ,) or bias.dtype not in TRITON_DTYPES:
        return f"decay bias {list(bias.shape)} {bias.dtype} ([HQ={HQ}] of one of {TRITON_DTYPES})"
    if proj is not None and (proj.shape != (B, T, HQ) or proj.dtype not in TRITON_DTYPES):
        return f"decay projection {list(proj.shape)} {proj.dtype} ([B, T, HQ] = {[B, T, HQ]} of one of {TRITON_DTYPES})"
    return None


def hla_features_and_decay(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor, proj: Tensor | None,
                           backend: str = "auto") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`hla_features(q, k, v, scale)` (normalised) and the log decays `log_alpha_reference(bias, proj)`
    [B, T, HQ] fp32: on the kernel one launch forward and one backward for both (the PyTorch form's
    logsigmoid, cast and add were three launches more a layer); backends as `hla_features`'. proj may be
    a column slice of a packed projection's output (read in place without gradients). Differentiable in
    q, k, v, bias and proj."""
    why = hla_features_unsupported(q, k, v) or decay_unsupported(q, bias, proj)
    if fused_kernel(backend, q.device, "HLA feature", why):
        from .triton_features import HLAFeatures

        grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, bias, proj))
        return run_function(HLAFeatures, q, k, v, bias, proj, float(scale), grad)
    return (*hla_features_reference(q, k, v, scale), log_alpha_reference(bias, proj, q.shape[:3]))
