"""SSE's router (softmax over partitions, top-K) and its load-balancing loss."""

from __future__ import annotations

import torch
from torch import Tensor

from ..utils import acc_dtype


def router_topk(logits: Tensor, k: int, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Router: softmax over the N partitions in float32 (float64 stays float64),
    then the top-k mask. logits: [B, T, N], valid: [B, T] bool (False at
    padding). Returns (probs [B, T, N], sel [B, T, N] bool; all False where invalid)."""
    N = logits.shape[-1]
    if not 1 <= k <= N:
        raise ValueError(f"top-k must be in [1, N={N}]; got {k}")
    probs = torch.softmax(logits, dim=-1, dtype=acc_dtype(logits))  # the cast inside the softmax
    top = probs.topk(k, dim=-1).indices
    sel = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, top, True)
    if valid is not None:
        sel = sel & valid[..., None].bool()
    return probs, sel


def sse_aux_loss(probs: Tensor, sel: Tensor, valid: Tensor | None = None) -> Tensor:
    """Load-balancing loss (N / K) sum_i mean_t(p^i_t) mean_t(1[i in T_t]) over
    the valid tokens of the whole batch; 1 when routing is uniform.
    probs, sel: [B, T, N], valid: [B, T] bool (default: tokens with any selection).
    K is the number of selected partitions of a valid token."""
    N = probs.shape[-1]
    if valid is None:
        valid = sel.any(-1)
    w = valid.to(probs.dtype)[..., None]                             # [B, T, 1]; masks, no indexing
    count = w.sum()
    s = sel.to(probs.dtype) * w
    p_mean = (probs * w).sum((0, 1)) / count.clamp(min=1)            # [N]
    s_mean = s.sum((0, 1)) / count.clamp(min=1)
    K = s.sum() / count.clamp(min=1)                                 # partitions per valid token
    loss = N / K.clamp(min=1) * (p_mean * s_mean).sum()
    return torch.where(count > 0, loss, probs.sum() * 0.0)
