"""Rotary position embedding of q and k in one pass, with the values of Transformers' form.

`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)` (Llama's, which every supported source
uses) is q * cos + rotate_half(q) * sin, and the same for k: about ten elementwise launches and
as many passes over q and k forward, as many backward. `rope` runs it as one Triton launch forward
and one backward (`triton_rope.py`) and rounds where the PyTorch form rounds (each product, then
the sum, in the promoted dtype of q and cos; backward, each of the two gradient terms in q's dtype,
then their sum), so on the GPU it gives that form's values bit for bit. `rope_reference` is that
form: the fallback off CUDA and the tests' oracle.
"""

from __future__ import annotations

from torch import Tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .triton_utils import TRITON_DTYPES
from .utils import fused_kernel, run_function


def rope_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Transformers' RoPE of q [B, T, HQ, D] and k [B, T, H, D] with cos, sin [B or 1, T, D]."""
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)


def rope_unsupported(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> str | None:
    """Why the kernel cannot take these inputs, or None."""
    if any(x.dtype not in TRITON_DTYPES for x in (q, k, cos, sin)) or k.dtype != q.dtype or sin.dtype != cos.dtype:
        return f"dtypes {q.dtype} / {k.dtype} / {cos.dtype} / {sin.dtype} (q, k alike; cos, sin alike; no fp64)"
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        return f"shapes {list(q.shape)} / {list(k.shape)} ([B, T, heads, D], alike but the heads)"
    B, T, _, D = q.shape
    if D % 2 or cos.dim() != 3 or cos.shape != sin.shape or cos.shape[0] not in (1, B) \
            or tuple(cos.shape[1:]) != (T, D):
        return f"cos / sin {list(cos.shape)} for q {list(q.shape)} ([B or 1, T, D], D even)"
    return None


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """RoPE of q [B, T, HQ, D] and k [B, T, H, D] (cos, sin [B or 1, T, D]): the values of
    `rope_reference`. backend: "auto" runs the Triton kernels on CUDA for inputs they take, else
    the PyTorch form; "triton" the kernels on any device Triton runs on (the CPU interpreter in
    tests) or a ValueError; "torch" the PyTorch form. Differentiable in q and k (cos and sin are
    buffers: no gradient)."""
    if fused_kernel(backend, q.device, "RoPE", rope_unsupported(q, k, cos, sin)):
        from .triton_rope import Rope

        cos, sin = (t.detach() if t.requires_grad else t for t in (cos, sin))
        return run_function(Rope, q, k, cos, sin)
    return rope_reference(q, k, cos, sin)
