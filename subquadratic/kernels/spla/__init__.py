"""SPLA attention (docs/design.md "SPLA"): one op, `spla_attention`, the dispatch the model calls.

Layout: q [B, Tq, HQ, D] (the new tokens), k, v [B, S, H, D] (every cached token plus the new ones,
new ones last; any strides with unit stride in D, so a [B, H, S, D] cache passes transposed views),
logical positions q_pos [B, Tq], k_pos [B, S] (-1 at padding), block statistics (`BlockStats`, an
internal structure of the op), the residual state sbar [B, H, D, D] and the hyper-parameters
(`SPLAParams`).

The path of a call is decided once, by `plan.plan_spla` (an `SPLAPlan`: path, kernel form, splits,
phi(k) precomputed or not, selection, launch settings), and executed here. Forms:
`naive.spla_naive` (the definition, one unpadded sequence: the test oracle), `dense.spla_dense`
(SDPA over every causal key: SPLA while every row fits its budget), `parallel.spla_parallel`
(masked PyTorch, any device), `gather.spla_decode_gather` (the PyTorch decode step: reads only the
selected blocks), `select.select_blocks` (PyTorch selection); Triton (CUDA):
`triton_select.select_indices`, `triton_tile.select_indices_fast` and
`triton_select_stream.select_indices_stream` (selection; `recall.selection_recall` measures one),
`triton_parallel.spla_parallel_triton` (prefill / training: the block-major kernels of
`triton_blocks`, backward in `triton_blocks_bwd`, for training; the query-tile kernels of
`triton_tile` for prefill; the per-token kernels, backward in `triton_parallel_bwd`, for a few
tokens) and
`triton_decode.spla_decode_triton` (one token per row). The Triton modules import Triton when
first used. `append_token` writes new tokens into a static cache (keys, values, block sums) in place.
"""

from __future__ import annotations

import torch

from ..utils import slot_offsets
from .dense import spla_dense
from .gather import spla_decode_gather
from .naive import spla_naive
from .parallel import spla_parallel
from .plan import (
    OFFSET_PATHS,
    TRITON_HEAD_DIMS,
    Launch,
    SPLAParams,
    SPLAPlan,
    plan_append,
    plan_spla,
    triton_unsupported,
    within_budget,
)
from .recall import selection_recall
from .select import select_blocks
from .stats import BlockStats, feature_map

#: Triton functions exported here, imported (with Triton) on first access: name -> module.
_TRITON_EXPORTS = {
    "select_indices": "triton_select", "spla_parallel_triton": "triton_parallel", "sparse_forward": "triton_parallel",
    "key_features": "triton_parallel", "causal_linear_term": "triton_parallel", "SparseAttention": "triton_parallel",
    "queries_by_block": "triton_parallel_bwd", "spla_decode_triton": "triton_decode",
    "append_token_triton": "triton_decode", "select_indices_fast": "triton_tile", "tile_shape": "triton_tile",
    "tile_union": "triton_tile", "tile_sparse_forward": "triton_tile", "tile_sparse_attention": "triton_tile",
    "select_indices_stream": "triton_select_stream", "blocks_sparse_attention": "triton_blocks",
}


__all__ = [
    "BlockStats", "Launch", "SPLAParams", "SPLAPlan", "TRITON_HEAD_DIMS", "append_token", "feature_map", "plan_append",
    "plan_spla", "select_blocks", "selection_recall", "spla_attention", "spla_dense", "spla_decode_gather",
    "spla_naive", "spla_parallel",
    "triton_unsupported", "within_budget", *_TRITON_EXPORTS,
]

def __getattr__(name: str):
    if name in _TRITON_EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_TRITON_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def append_token(K, V, stats: BlockStats, k, v, index, pos, block_size: int, *, backend: str = "auto") -> None:
    """Write new tokens k, v [B, H, T, D] into slots `index` [T] (long, on the device) of a static
    cache's K, V [B, H, S, D] and add the real ones (pos [B, T] >= 0) to its block sums `stats`, in
    place and with no host synchronisation, on the path `plan.plan_append` picks: one launch
    (`triton_decode.append_token_triton`) or index_copy_ and `BlockStats.add_`, with the same sums."""
    unit_stride = K.stride(-1) == V.stride(-1) == stats.sum_k.stride(-1) == 1
    if plan_append(k.shape, k.device, stats.sum_k.dtype, unit_stride=unit_stride, backend=backend) == "triton":
        from .triton_decode import append_token_triton

        append_token_triton(K, V, stats, k, v, index, pos, block_size)
        return
    K.index_copy_(2, index, k)
    V.index_copy_(2, index, v)
    stats.add_(k.transpose(1, 2), pos, block_size)


def spla_attention(q, k, v, q_pos, k_pos, stats, sbar, params: SPLAParams, *, backend: str = "auto",
                   k_offsets=None, new_kv=None, causal: bool = False, plan: SPLAPlan | None = None,
                   precision: str = "auto", union_hint=None, rla_norm=None):
    """SPLA attention of the new tokens over the cache. Returns (o_sp [B, Tq, HQ, D], o_rla [B, Tq, HQ, D]
    or None (inside the budget, or with use_rla=False), new sbar).

    The path is `plan`, else the one `plan.plan_spla` makes for these shapes, `backend` and whether
    gradients are needed; a given plan must agree with the inputs on gradients. `k_offsets` [B]
    int32: the slot of each row's position 0 (`slot_offsets(k_pos)`), or a function returning it
    (the model shares one result between its layers); read here and nowhere else, only on the paths
    that need it (`OFFSET_PATHS`; computed from k_pos when not given: one host sync). Where it is None
    (a row with padding in the middle) a plan made here is made again for such rows (the PyTorch
    form); a given plan raises. `new_kv`: the new tokens' keys and values [B, Tq, H, D] where they are
    not the last Tq slots of k, v (a static cache's whole buffers, where unused slots have position
    -1). `causal`: the caller knows every slot is a real token in position order with the new tokens
    last (`SequenceInfo.causal`), so the dense and Triton paths may skip the masks. `precision`: the dot precision
    of the Triton kernels for fp32 operands (`utils.KERNEL_PRECISIONS`; "auto": TF32 on CUDA) of a
    plan made here. `union_hint` (`plan.UnionHint`, shared by the layers of one forward): how the form
    "union" reads its measurement. `rla_norm`: (weight [HQ, D], eps) of the norm the caller adds to
    the output, o_sp + RMSNorm_weight(o_rla); a path that fuses it (`SPLAPlan.fuse_norm`: the
    block-major kernels without gradients) returns that sum as o_sp and None as o_rla, so the
    caller adds nothing."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    given = plan is not None
    if not given:
        plan = plan_spla(q.shape, k.shape, q.dtype, q.device, params, backend=backend, grad=grad, precision=precision)
    elif plan.grad != grad:
        raise ValueError(f"the SPLA plan was made for grad={plan.grad}, these inputs have grad={grad} (gradients "
                         f"enabled and an input requiring them); make the plan with plan_spla(..., grad={grad})")
    koff = None
    if plan.path in OFFSET_PATHS:
        koff = k_offsets() if callable(k_offsets) else slot_offsets(k_pos) if k_offsets is None else k_offsets
        if koff is None and given:
            raise ValueError(f"the SPLA path {plan.path!r} needs each row's tokens in consecutive slots (padding only "
                             "before or after them); let spla_attention plan such rows (the PyTorch form)")
        if koff is None:
            plan = plan_spla(q.shape, k.shape, q.dtype, q.device, params, backend=backend, grad=grad,
                             consecutive=False, precision=precision)
    if plan.path == "dense":
        return spla_dense(q, k, v, q_pos, k_pos, sbar, new_kv, causal=causal)
    if plan.path == "torch":
        return spla_parallel(q, k, v, q_pos, k_pos, stats, sbar, params, new_kv=new_kv)
    if plan.path == "torch_decode":
        return spla_decode_gather(q, k, v, q_pos, stats, sbar, koff, params, new_kv=new_kv)
    if plan.path == "triton_decode":
        from .triton_decode import spla_decode_triton

        return spla_decode_triton(q, k, v, q_pos, stats, sbar, koff, params, launch=plan.launch, new_kv=new_kv,
                                  precision=plan.precision)
    from .triton_parallel import spla_parallel_triton

    return spla_parallel_triton(q, k, v, q_pos, k_pos, stats, sbar, koff, params, plan, new_kv=new_kv, causal=causal,
                                union_hint=union_hint, rla_norm=rla_norm)
