"""Second-order Higher-order Linear Attention (HLA) and asymmetric HLA.

`hla_naive` is the O(T^3) definition, `hla_recurrent` the streaming serial recurrence (the oracle at
every length and the decode step), `hla_chunked` the chunked form (training / prefill); on CUDA the
Triton kernels `triton_chunk.hla_chunked_triton` (chunked forward and backward) and
`triton_fused_recurrent.hla_recurrent_triton` (one fused launch per decode step), both behind
`hla_triton`. All take q, k: [B, T, H, D], v: [B, T, H, Dv], log_alpha: [B, T, H] and share
`HLAState`. Model code calls `hla_attention`, the one dispatch function, on the path `plan.plan_hla`
decides (an `HLAPlan`, which the mixer makes once per forward). The Triton modules import Triton when
first used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunk import hla_chunked
from .naive import hla_naive
from .plan import HLAPlan, plan_hla
from .plan import triton_unsupported as unsupported
from .recurrent import HLAState, clamp_signed, hla_recurrent

__all__ = ["HLAPlan", "HLAState", "clamp_signed", "hla_attention", "hla_chunked", "hla_naive", "hla_recurrent",
           "hla_triton", "plan_hla", "triton_unsupported"]

def _needs_grad(q, k, v, log_alpha, state) -> bool:
    tensors = [q, k, v, log_alpha] + ([] if state is None else [x for x in vars(state).values() if x is not None])
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


def _decode(q, k, v, log_alpha, state) -> bool:
    """One token without gradients: the fused recurrent kernel (else the chunked kernels)."""
    return q.shape[1] == 1 and not _needs_grad(q, k, v, log_alpha, state)


def triton_unsupported(q: Tensor, chunk_size: int, decode: bool) -> str | None:
    """Why the HLA Triton kernels cannot take these inputs, or None (`plan.triton_unsupported`)."""
    return unsupported(q.dtype, chunk_size, decode)


def hla_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor,
    state: HLAState | None = None,
    *,
    chunk_size: int = 64,
    normalize: bool = False,
    eps: float = 1e-6,
    variant: str = "hla2",
    backend: str = "auto",
    precision: str = "auto",
    plan: HLAPlan | None = None,
) -> tuple[Tensor, HLAState]:
    """HLA of T new tokens continuing `state` (None: start of sequence).

    q, k: [B, T, H, D]; v: [B, T, H, Dv]; log_alpha: [B, T, H] (<= 0). Returns o [B, T, H, Dv] in
    q.dtype and the state after the last token (new tensors, fp32; fp64 for fp64 inputs). The path is
    `plan`'s (its `path` and `precision`; `backend` and `precision` are then unused), else the one
    `plan.plan_hla` makes for these inputs (`kernels.utils.resolve_backend`): "auto" takes the Triton kernels
    on CUDA when Triton is installed and the inputs suit them (`triton_unsupported`), else the
    PyTorch forms; "triton" the kernels or a ValueError; "torch" the recurrence for decode (T == 1)
    and the chunked form for longer inputs; "naive" the recurrence at every length. On the Triton
    path one token without gradients takes the fused recurrent kernel, everything else the chunked
    kernels, their dots of fp32 operands at `precision` (`utils.KERNEL_PRECISIONS`: "auto" is TF32
    on CUDA). A plan's "definition" is the O(T^3) definition from a zero state (None for the state
    after it).
    """
    kw = {"normalize": normalize, "eps": eps, "variant": variant}
    if plan is None:
        plan = plan_hla(q.shape, q.dtype, q.device, chunk_size=chunk_size, backend=backend, precision=precision,
                        grad=_needs_grad(q, k, v, log_alpha, state))
    if plan.path == "triton":
        return hla_triton(q, k, v, log_alpha, state, chunk_size=chunk_size, precision=plan.precision, **kw)
    if plan.path == "definition":
        return hla_naive(q, k, v, log_alpha, **kw), None
    if plan.path == "naive" or q.shape[1] == 1:
        return hla_recurrent(q, k, v, log_alpha, state, **kw)
    return hla_chunked(q, k, v, log_alpha, state, chunk_size=chunk_size, **kw)


def hla_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor,
    state: HLAState | None = None,
    *,
    chunk_size: int = 64,
    normalize: bool = False,
    eps: float = 1e-6,
    variant: str = "hla2",
    precision: str = "ieee",
) -> tuple[Tensor, HLAState]:
    """The Triton forms on any device Triton runs on (CUDA; the CPU interpreter in tests), the
    contract of `hla_attention`: one token without gradients (decode) takes the fused recurrent
    kernel, everything else the chunked kernels (differentiable; dots of fp32 operands at
    `precision`, "ieee" or "tf32"). Inputs the kernels cannot take (`triton_unsupported`) raise a
    ValueError."""
    kw = {"normalize": normalize, "eps": eps, "variant": variant}
    decode = _decode(q, k, v, log_alpha, state)
    why = triton_unsupported(q, chunk_size, decode)
    if why is not None:
        raise ValueError(f"the HLA Triton kernels do not support these inputs: {why}; use hla_attention")
    if decode:
        from .triton_fused_recurrent import hla_recurrent_triton

        return hla_recurrent_triton(q, k, v, log_alpha, state, **kw)
    from .triton_chunk import hla_chunked_triton

    return hla_chunked_triton(q, k, v, log_alpha, state, chunk_size=chunk_size, precision=precision, **kw)
