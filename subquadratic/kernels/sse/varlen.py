"""SSE over sorted segments: tokens sorted by (sample, partition) in time order (a token appears
once per selected partition), one variable-length chunked pass over the non-empty (sample,
partition) segments, each starting from its partition's state, outputs scattered back. Costs
(1 + K) T."""

from __future__ import annotations

import torch
from torch import Tensor

from ..utils import acc_dtype
from .recurrent import SSEState, setup


def sse_varlen(q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, g1: Tensor,
               g2: Tensor, probs: Tensor, sel: Tensor, state: SSEState | None = None,
               chunk_size: int = 64, *, base: str = "gla",
               beta: Tensor | None = None) -> tuple[Tensor, SSEState]:
    """SSE with the partitions run as variable-length segments: cost grows with
    (1 + K) T. Partitions with no token keep their state exactly.
    Returns (o [B, T, H, Dv], state)."""
    ops, extra, state = setup(q1, k1, q2, k2, v, g1, g2, probs, sel, state, base, beta)
    B, T, H, Dk = q1.shape
    N, Dv = probs.shape[-1], v.shape[-1]
    dt = acc_dtype(q1)
    o_shared, S0 = ops.chunked(q1, k1, v, g1, *extra, state=state.shared, chunk_size=chunk_size)

    # one row per (token, selected partition), sorted by (sample, partition, time)
    b, n, t = sel.permute(0, 2, 1).nonzero(as_tuple=True)           # [M]
    seg = b * N + n                                                  # (sample, partition) id
    seg_ids, seg_lens = torch.unique_consecutive(seg, return_counts=True)  # non-empty segments [S]
    cu = torch.cat([seg_lens.new_zeros(1), seg_lens.cumsum(0)])      # [S + 1]
    p = probs.to(dt)[b, t, n][:, None, None]                         # [M, 1, 1]
    packed = [p * q2.to(dt)[b, t], p * k2.to(dt)[b, t], v.to(dt)[b, t], g2.to(dt)[b, t],
              *(x.to(dt)[b, t] for x in extra)]
    parts = state.parts.to(dt).reshape(B * N, H, Dk, Dv)
    o_seg, S_seg = ops.varlen(*packed, cu_seqlens=cu, initial_state=parts[seg_ids],
                              chunk_size=chunk_size)                 # [M, H, Dv], [S, H, Dk, Dv]
    parts = parts.index_copy(0, seg_ids, S_seg).view(B, N, H, Dk, Dv)
    o = o_shared.to(dt).reshape(B * T, H, Dv).index_add(0, b * T + t, o_seg)
    return o.view(B, T, H, Dv).to(q1.dtype), SSEState(S0, parts)
