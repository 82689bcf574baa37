"""SPLA attention (DESIGN.md "SPLA"): one op, `spla_attention`, the dispatch the model calls.

Layout: q [B, Tq, HQ, D] (the new tokens), k, v [B, S, H, D] (every cached token plus the new ones,
new ones last; any strides with unit stride in D, so a [B, H, S, D] cache passes transposed views),
logical positions q_pos [B, Tq], k_pos [B, S] (-1 at padding), block statistics (`BlockStats`, an
internal structure of the op) and the residual state sbar [B, H, D, D].

Forms: `naive.spla_naive` (the definition, one unpadded sequence: the test oracle),
`gather.spla_decode_gather` (the "torch" backend's decode step: reads only the selected blocks),
`dense.spla_dense` (SDPA over every causal key: SPLA while every row fits its budget),
`parallel.spla_parallel` (masked PyTorch, any device: backend "torch"), `select.select_blocks`
(PyTorch selection); Triton (CUDA): `triton_select.select_indices`, `triton_parallel.spla_parallel_triton`
(prefill / training, backward in `triton_parallel_bwd`) and `triton_decode.spla_decode_triton`
(one token per row), both behind `spla_triton`. The Triton modules import Triton when first used.
`append_token` writes new tokens into a static cache (keys, values, block sums) in place.
"""

from __future__ import annotations

import torch

from ..utils import resolve_backend, slot_offsets, triton_available
from .dense import spla_dense, within_budget
from .gather import spla_decode_gather
from .naive import spla_naive
from .parallel import spla_parallel
from .select import select_blocks
from .stats import BlockStats, feature_map

#: Triton functions exported here, imported (with Triton) on first access: name -> module.
_TRITON_EXPORTS = {
    "select_indices": "triton_select", "spla_parallel_triton": "triton_parallel", "sparse_forward": "triton_parallel",
    "key_features": "triton_parallel", "causal_linear_term": "triton_parallel", "SparseAttention": "triton_parallel",
    "queries_by_block": "triton_parallel_bwd", "spla_decode_triton": "triton_decode",
    "append_token_triton": "triton_decode",
}


__all__ = [
    "BlockStats", "TRITON_HEAD_DIMS", "append_token", "feature_map", "select_blocks", "spla_attention", "spla_dense",
    "spla_decode_gather", "spla_naive", "spla_parallel", "within_budget", "spla_triton", "triton_unsupported",
    *_TRITON_EXPORTS,
]

def __getattr__(name: str):
    if name in _TRITON_EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_TRITON_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Head dimensions the Triton kernels take; their block size must be at least 16 (tl.dot tiles).
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)


def triton_unsupported(head_dim: int, block_size: int, k_offsets: torch.Tensor | None) -> str | None:
    """Why the Triton kernels cannot take these inputs, or None. `k_offsets` is `slot_offsets(k_pos)`:
    None when a row has padding in the middle (its tokens not in consecutive slots)."""
    if head_dim not in TRITON_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {TRITON_HEAD_DIMS}"
    if block_size < 16:
        return f"block_size {block_size} < 16"
    if k_offsets is None:
        return "a row has padding in the middle (its tokens are not in consecutive cache slots)"
    return None


def append_token(K, V, stats: BlockStats, k, v, index, pos, block_size: int, *, backend: str = "auto") -> None:
    """Write new tokens k, v [B, H, T, D] into slots `index` [T] (long, on the device) of a static
    cache's K, V [B, H, S, D] and add the real ones (pos [B, T] >= 0) to its block sums `stats`, in
    place and with no host synchronisation. One token per row on CUDA with Triton (backend "auto" or
    "triton"): one launch (`triton_decode.append_token_triton`); otherwise index_copy_ and
    `BlockStats.add_`, with the same sums."""
    one_launch = (backend in ("auto", "triton") and k.is_cuda and k.shape[2] == 1 and triton_available()
                  and k.shape[-1] in TRITON_HEAD_DIMS and stats.sum_k.dtype == torch.float32
                  and K.stride(-1) == V.stride(-1) == stats.sum_k.stride(-1) == 1)
    if one_launch:
        from .triton_decode import append_token_triton

        append_token_triton(K, V, stats, k, v, index, pos, block_size)
        return
    K.index_copy_(2, index, k)
    V.index_copy_(2, index, v)
    stats.add_(k.transpose(1, 2), pos, block_size)


def _resolve_offsets(k_offsets, k_pos: torch.Tensor) -> torch.Tensor | None:
    """`k_offsets` as given (a tensor, or a function returning one), else `slot_offsets(k_pos)`."""
    k_offsets = k_offsets() if callable(k_offsets) else k_offsets
    return slot_offsets(k_pos) if k_offsets is None else k_offsets


def spla_attention(q, k, v, q_pos, k_pos, stats, sbar, *, backend: str = "auto", k_offsets=None, new_kv=None,
                   causal: bool = False, **kw):
    """SPLA attention of the new tokens over the cache. Returns (o_sp [B, Tq, HQ, D], o_rla [B, Tq, HQ, D]
    or None with use_rla=False, new sbar); keyword arguments as `parallel.spla_parallel`.

    Inside the budget (S key slots, padding included, <= top_k_blocks x block_size, so every causal
    block of every row is selected and the residual term is exactly zero), "auto" and "torch" take
    `spla_dense`: softmax attention through SDPA, which also carries Sbar, so the switch to the
    sparse path when a row outgrows the budget is seamless. S is a shape: no host sync decides it.

    Beyond the budget the path is decided here and nowhere else (`utils.resolve_backend`): "auto"
    takes the Triton kernels on CUDA when Triton is installed and the inputs suit them
    (`triton_unsupported`: head dim, block size, no padding in the middle of a row), else the
    PyTorch form; "torch" the PyTorch form; "triton" the kernels or a ValueError; "naive" a
    ValueError (the definition serves tests only). On the Triton path, one token per row without
    gradients (decode) takes the decode kernels, everything else the prefill / training kernels.
    `k_offsets` [B] int32: the slot of each row's position 0 (`slot_offsets(k_pos)`), or a function
    returning it (called only where needed; the model shares one result between its layers),
    computed here when not given (one host sync). `new_kv`: the new tokens' keys and values
    [B, Tq, H, D] where they are not the last Tq slots of k, v (a static cache's whole buffers, where
    unused slots have position -1). `causal`: the caller knows every slot is a real token in
    position order with the new tokens last (`SequenceInfo.causal`), so the dense path may skip the mask."""
    if backend in ("auto", "torch") and within_budget(k.shape[1], kw["block_size"], kw["top_k_blocks"]):
        return spla_dense(q, k, v, q_pos, k_pos, sbar, new_kv, causal=causal)
    why = None
    if q.is_cuda and backend in ("auto", "triton"):  # the offsets (a host sync) only where kernels may run
        k_offsets = _resolve_offsets(k_offsets, k_pos)
        why = triton_unsupported(q.shape[-1], kw["block_size"], k_offsets)
    path = resolve_backend(backend, q.device, op="SPLA", has_triton=True, has_naive=False, unsupported=why)
    if path == "torch":
        if q.shape[1] == 1 and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
            k_offsets = _resolve_offsets(k_offsets, k_pos)
            if k_offsets is not None:  # a decode step: read only the selected blocks
                return spla_decode_gather(q, k, v, q_pos, stats, sbar, k_offsets, new_kv=new_kv, **kw)
        return spla_parallel(q, k, v, q_pos, k_pos, stats, sbar, new_kv=new_kv, **kw)
    return spla_triton(q, k, v, q_pos, k_pos, stats, sbar, k_offsets=k_offsets, new_kv=new_kv, **kw)


def spla_triton(q, k, v, q_pos, k_pos, stats, sbar, *, k_offsets=None, num_splits: int | None = None, new_kv=None,
                **kw):
    """The Triton forms, on any device Triton runs on (CUDA; the CPU interpreter in tests), same
    contract as `spla_attention`: one token per row without gradients (decode, fp32/bf16/fp16) takes
    the decode kernels, everything else the prefill / training kernels (`num_splits`: split each
    token's blocks over that many programs). Inputs the kernels cannot take raise a ValueError."""
    if k_offsets is None:
        k_offsets = slot_offsets(k_pos)
    why = triton_unsupported(q.shape[-1], kw["block_size"], k_offsets)
    if why is not None:
        raise ValueError(f"the SPLA Triton kernels do not support these inputs: {why}; use spla_attention")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if q.shape[1] == 1 and q.dtype != torch.float64 and num_splits is None and not needs_grad:
        from .triton_decode import spla_decode_triton

        kw.pop("query_chunk", None)
        return spla_decode_triton(q, k, v, q_pos, stats, sbar, k_offsets, new_kv=new_kv, **kw)
    from .triton_parallel import spla_parallel_triton

    return spla_parallel_triton(q, k, v, q_pos, k_pos, stats, sbar, k_offsets=k_offsets, num_splits=num_splits,
                                new_kv=new_kv, **kw)
