"""SPLA inside its budget: exact softmax attention through SDPA (flash / memory-efficient / CPU).

While every row's context fits `top_k_blocks * block_size` keys, the selection takes every causal
block, so the sparse branch is softmax attention over all causal keys and the residual term is
exactly zero. This path computes just that, without scoring or selecting, and still carries the
residual state Sbar (and the caller the block sums), so a row that later outgrows the budget
continues on the sparse path with the same state it would have had there; a caller that keeps the
keys and values (a growing cache, `SPLALayer`) passes no Sbar and folds the tokens into it later,
only once a call leaves the budget (`fold_state`).

Which path runs is decided by the plan (`plan.within_budget`) from shapes alone (the number of key
slots), so the decision needs no host synchronisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils import allowed_keys
from .stats import new_tokens, state_increment


def spla_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    sbar: torch.Tensor | None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    causal: bool = False,
) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """Softmax attention of the new tokens over every causal cached key, plus the Sbar update.

    q: [B, Tq, HQ, D] post-RoPE queries of the new tokens; k, v: [B, S, H, D] every cached token with
    the new ones last; q_pos [B, Tq], k_pos [B, S] logical positions (-1 = padding); sbar [B, H, D, D]
    covers the S - Tq cached tokens (carried with or without the residual term, as on the sparse
    path; None: not updated, and None returned, the caller folding these tokens in later with
    `fold_state`). The new tokens are the last Tq of k, v, or, where they sit elsewhere (a static cache's
    whole buffers), `new_kv` holds their keys and values [B, Tq, H, D]. causal=True: the caller
    knows that every slot of k, v is a real token in position order and the new tokens are the last
    Tq (`SequenceInfo.causal`), so SDPA runs without a mask where that gives the same values (Tq = S:
    is_causal; Tq = 1: every key). Returns (o_sp [B, Tq, HQ, D]
    in q's dtype (fp64 for an fp64 sbar or fp64 inputs), None: the residual term is exactly zero, new
    Sbar). Padded queries return zeros.
    """
    B, Tq, HQ, D = q.shape
    H = k.shape[2]
    wide = sbar.dtype == torch.float64 if sbar is not None else q.dtype == torch.float64
    out_dtype = torch.float64 if wide else q.dtype
    qt, kt, vt = (x.transpose(1, 2).to(out_dtype) for x in (q, k, v))  # [B, heads, T, D] views
    if causal and new_kv is None and Tq in (k.shape[1], 1):
        # every slot real, the queries the last Tq: causal (Tq = S) or every key (one query)
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=Tq > 1, enable_gqa=HQ != H).transpose(1, 2)
    else:
        allowed = allowed_keys(q_pos, k_pos)  # padded queries see every key; their output is zeroed below
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed[:, None], enable_gqa=HQ != H)
        o = o.transpose(1, 2) * (q_pos >= 0)[:, :, None, None]
    if sbar is None:
        return o, None, None
    k_new, v_new = new_tokens(k, v, Tq, new_kv)
    return o, None, fold_state(sbar, k_new, v_new, q_pos)


def fold_state(sbar: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Sbar plus what tokens with keys k and values v [B, T, H, D] (any strides) at logical positions
    pos [B, T] (-1 = padding, which adds nothing) add to it: sum_t phi(k_t)^T v_t, in sbar's dtype."""
    acc = sbar.dtype
    phik = torch.softmax(k, dim=-1, dtype=acc) * (pos >= 0)[:, :, None, None]  # [B, T, H, D]
    return sbar + state_increment(phik.transpose(1, 2), v.transpose(1, 2), acc)
