"""Sparse State Expansion (SSE) in PyTorch, on the linear-attention bases of `kernels/gla` and
`kernels/gated_delta`.

Forms: `recurrent.sse_recurrent` (the serial oracle and the decode step: only the selected
partitions are read and written; `recurrent.sse_decode_step` is the same for one token in few ops,
the "torch" path's decode), `masked.sse_masked` ((N+1)-heads form, a second reference),
`varlen.sse_varlen` (sorted variable-length form); `router.py` holds the router (`router_topk`) and
the load-balancing loss (`sse_aux_loss`). Triton (CUDA, GLA base): `triton_sse.sse_triton` (the
sorted variable-length form on the varlen chunked GLA kernels of `gla/triton_chunk.py`, fixed
shapes, no host synchronisation) and `triton_sse.sse_decode_triton` (one token, only the selected
partitions read and written). Model code calls one dispatch function, `sse_attention`, on the
path `plan.plan_sse` decides (an `SSEPlan`, which the mixer makes once per forward).
"""

from __future__ import annotations

from torch import Tensor

from ..utils import resolve_precision
from .masked import sse_masked
from .plan import SSEPlan, plan_sse
from .plan import triton_unsupported as unsupported
from .recurrent import SSEState, sse_decode_step, sse_recurrent
from .router import router_topk, sse_aux_loss
from .varlen import sse_varlen

__all__ = [
    "SSEPlan", "SSEState", "plan_sse", "router_topk", "sse_attention", "sse_aux_loss", "sse_decode_step",
    "sse_from_projections", "sse_masked", "sse_recurrent", "sse_varlen", "triton_unsupported",
]


def sse_attention(q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, g1: Tensor,
                  g2: Tensor, probs: Tensor, sel: Tensor, state: SSEState | None = None, *,
                  base: str = "gla", beta: Tensor | None = None, chunk_size: int = 64,
                  backend: str = "auto", inplace: bool = False, topk: int | None = None,
                  precision: str = "auto", plan: SSEPlan | None = None) -> tuple[Tensor, SSEState]:
    """SSE of the new tokens from `state` (None: zeros); shapes as in `recurrent.py`. Returns
    (o [B, T, H, Dv] in q1's dtype, new state). The path is `plan`'s (its `path`, `inplace` and
    `precision`; `backend`, `inplace` and `precision` are then unused), else the one `plan.plan_sse`
    makes for these inputs: "auto" takes the Triton kernels on CUDA for the GLA base in fp32/bf16/fp16
    with chunk_size 16, 32 or 64 and head dims up to 128 (keys) / 256 (values), else "torch": the
    recurrent step for one token (decode) (`sse_decode_step`) and the sorted variable-length form
    otherwise; "naive" the serial recurrence at every length; a plan's "masked" the (N+1)-heads form.
    `topk`: the router's K (selections per token), which sizes the fixed-shape grouping of every
    form (default N).
    `inplace=True` (inference with a cache) lets the one-token forms write the new states into
    `state`'s tensors, touching only the selected rows of `state.parts`; the chunked forms ignore it.
    `precision`: the dots of the Triton chunked kernels for fp32 operands (`utils.KERNEL_PRECISIONS`:
    "auto" is TF32 on CUDA)."""
    if plan is None:
        plan = plan_sse(q1.shape, q1.dtype, q1.device, num_partitions=probs.shape[-1], base=base,
                        chunk_size=chunk_size, backend=backend, precision=precision, cached=inplace,
                        value_dim=v.shape[-1])
    inplace = plan.inplace and state is not None
    if plan.path == "triton":
        from .triton_sse import sse_triton

        return sse_triton(q1, k1, q2, k2, v, g1, g2, probs, sel, state, base=base, beta=beta,
                          chunk_size=chunk_size, topk=topk, inplace=inplace, precision=plan.precision)
    if plan.path == "masked":
        return sse_masked(q1, k1, q2, k2, v, g1, g2, probs, sel, state, chunk_size, base=base, beta=beta)
    if plan.path == "torch" and q1.shape[1] == 1:
        return sse_decode_step(q1, k1, q2, k2, v, g1, g2, probs, sel, state, base=base, beta=beta,
                               inplace=inplace, topk=topk)
    if plan.path == "naive" or q1.shape[1] == 1:
        return sse_recurrent(q1, k1, q2, k2, v, g1, g2, probs, sel, state, base=base, beta=beta,
                             inplace=inplace, topk=topk)
    return sse_varlen(q1, k1, q2, k2, v, g1, g2, probs, sel, state, chunk_size, base=base, beta=beta,
                      topk=topk)


def sse_from_projections(q1: Tensor, k1: Tensor, q2: Tensor | None, k2: Tensor | None, v: Tensor, z1: Tensor,
                         z2: Tensor, bias1: Tensor, bias2: Tensor, normalizer: float, probs: Tensor, sel: Tensor,
                         state: SSEState | None = None, *, q2_mode: str = "full", chunk_size: int = 64,
                         topk: int | None = None, precision: str = "auto", valid: Tensor | None = None,
                         norm_gate: tuple | None = None, counts: Tensor | None = None,
                         recompute: bool = True) -> tuple[Tensor, SSEState]:
    """The GLA base's SSE of a chunk of tokens from the projections: `sse_attention` on
    `features.sse_gla_features(q1, k1, q2, k2, v, z1, z2, bias1, bias2, normalizer, q2_mode=q2_mode)`, with
    the features computed inside the SSE kernels, forward and backward
    (`triton_sse.sse_triton_from_projections`), a padding token's (`valid` False) features 0 as the model
    makes them for `sse_attention`. Only where the plan says so (`SSEPlan.fused`). `norm_gate` = (weight, gate,
    eps), without gradients: the output is `norm_gate(o, weight, gate, eps)`'s, in the same kernels.
    `counts`: the router kernel's selection counts of `sel` (`router_topk(..., counts=True)`), which spare
    the grouping its counting launch. `recompute` (`SSEPlan.recompute`): with gradients, the backward
    writes the merged rows again instead of keeping them (`triton_sse.RecomputedRows`)."""
    from .triton_sse import sse_triton_from_projections

    return sse_triton_from_projections(q1, k1, q2, k2, v, z1, z2, bias1, bias2, normalizer, probs, sel, state,
                                       q2_mode=q2_mode, chunk_size=chunk_size, topk=topk,
                                       precision=resolve_precision(precision, q1.device, q1.dtype), valid=valid,
                                       norm_gate=norm_gate, counts=counts, recompute=recompute)


def triton_unsupported(q1: Tensor, v: Tensor, base: str, chunk_size: int) -> str | None:
    """Why the SSE Triton kernels cannot take these inputs, or None (`plan.triton_unsupported`)."""
    return unsupported(q1.dtype, base, chunk_size, q1.shape[-1], v.shape[-1])
