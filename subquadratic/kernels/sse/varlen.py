"""SSE over sorted segments: tokens sorted by (sample, partition) in time order (a token appears
once per selected partition), one variable-length chunked pass over the (sample, partition)
segments, each starting from its partition's state, outputs scattered back. Costs (1 + K) T.

Fixed shapes, no host synchronisation: every token contributes K rows (its top-K partitions; K is
given, or N as a bound), rows of padded tokens are kept with zero inputs (no write, no decay), the
sort is an argsort of a fixed-size key, and the segments run through `linear_common.segments`
(a chunk count bounded from shapes, the carry masked per segment, no segment longer than T).
On the CPU outside tracing `segments` runs the segments' real lengths instead (same values)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..linear_common import segments
from ..utils import acc_dtype
from .recurrent import SSEState, setup


def sse_varlen(q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, g1: Tensor,
               g2: Tensor, probs: Tensor, sel: Tensor, state: SSEState | None = None,
               chunk_size: int = 64, *, base: str = "gla",
               beta: Tensor | None = None, topk: int | None = None) -> tuple[Tensor, SSEState]:
    """SSE with the partitions run as variable-length segments: cost grows with (1 + K) T.
    Partitions with no token keep their state exactly. `topk`: partitions selected per token
    (at most; None: N). Returns (o [B, T, H, Dv], state)."""
    ops, extra, state = setup(q1, k1, q2, k2, v, g1, g2, probs, sel, state, base, beta)
    B, T, H, Dk = q1.shape
    N, Dv = probs.shape[-1], v.shape[-1]
    K = N if topk is None else min(topk, N)
    dt = acc_dtype(q1)
    dev = q1.device
    o_shared, S0 = ops.chunked(q1, k1, v, g1, *extra, state=state.shared, chunk_size=chunk_size)

    # K rows per token: its selected partitions (a padded token selects none: its rows stay inert,
    # zero inputs in distinct partitions, so no write and no decay), sorted by (sample, partition, time)
    n = sel.to(torch.int8).topk(K, dim=-1).indices                  # [B, T, K]
    live = sel.gather(-1, n)                                         # [B, T, K]
    b = torch.arange(B, device=dev)[:, None, None].expand(B, T, K)
    t = torch.arange(T, device=dev)[None, :, None].expand(B, T, K)
    seg = (b * N + n).reshape(-1)                                    # [M = B T K], each at most T long
    order = torch.argsort(seg * T + t.reshape(-1))
    seg, b, n, t, live = (x.reshape(-1)[order] for x in (seg, b, n, t, live))
    lens = torch.zeros(B * N, dtype=torch.long, device=dev).index_add(0, seg, torch.ones_like(seg))
    pos = torch.arange(seg.numel(), device=dev) - (lens.cumsum(0) - lens)[seg]
    w = (probs.to(dt)[b, t, n] * live)[:, None, None]               # [M, 1, 1]; 0 on inert rows

    def rows(x: Tensor) -> Tensor:  # the rows' inputs, zero on inert rows
        x = x.to(dt)[b, t]
        return x * live.view(-1, *[1] * (x.dim() - 1))

    packed = [w * q2.to(dt)[b, t], w * k2.to(dt)[b, t], rows(v), rows(g2), *(rows(x) for x in extra)]
    parts = state.parts.to(dt).reshape(B * N, H, Dk, Dv)
    o_seg, S_seg = segments(ops.terms, *packed[:3], tuple(packed[3:]), seg, pos, parts, T, chunk_size)
    parts = S_seg.view(B, N, H, Dk, Dv)
    o = o_shared.to(dt).reshape(B * T, H, Dv).index_add(0, b * T + t, o_seg)
    return o.view(B, T, H, Dv).to(q1.dtype), SSEState(S0, parts)
