"""Pure-PyTorch SPLA attention (docs/design.md "SPLA"), the masked parallel form: runs anywhere, is the
"torch" backend of `spla_attention` and the reference the Triton kernels are tested against.

Layout: queries q [B, Tq, HQ, D] are the new tokens, keys/values k, v [B, S, H, D] are every cached
token plus the new ones (post-RoPE keys). Logical positions say where a token sits in its own
sequence: q_pos [B, Tq], k_pos [B, S], -1 at padding. Blocks are cut on logical positions, so a
left-padded row of a batch sees exactly the blocks it would see alone.

Block statistics are running sums (`BlockStats`), updated with new keys only; the residual linear
state Sbar [B, H, D, D] (fp32) is carried the same way. This form reads every cached key: the
sparse branch is SDPA with each query's selected causal keys as its mask, and the residual term
phi(q_t)^T Sbar_t - otilde_t is summed directly over the unselected causal keys,
sum_{j <= t, j not in Sel(t)} (phi(q_t).phi(k_j)) v_j, plus phi(q_t)^T (Sbar - sum of the cached
keys' phi(k_j) v_j^T), the part of the given Sbar that the cached keys do not account for (0 up to
rounding in a model's cache), and set to exactly 0 where every causal key is selected. The Triton
kernels take the subtraction form, which reads the selected blocks only.

With `return_weights` the sparse branch is written out instead of calling SDPA: the softmax
weights of each query over its selected causal keys ([B, HQ, Tq, S], zeros elsewhere, the layout of
Transformers' eager attention), from which o_sp is computed, so the weights are part of the graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..utils import acc_dtype
from .plan import SPLAParams
from .select import select_blocks
from .stats import BlockStats, feature_map, new_tokens


def spla_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    stats: BlockStats,
    sbar: torch.Tensor,
    params: SPLAParams,
    *,
    query_chunk: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_weights: bool = False,
) -> tuple[torch.Tensor, ...]:
    """SPLA for the new tokens as masked dense PyTorch (every cached key read, in query chunks).
    Returns (o_sp [B, Tq, HQ, D], o_rla [B, Tq, HQ, D] or None, new Sbar), and with `return_weights`
    the exact branch's attention weights [B, HQ, Tq, S] in q's dtype (one query chunk: the softmax
    over each query's selected causal keys, zeros at the other keys and for padded queries).

    q: [B, Tq, HQ, D] post-RoPE queries of the new tokens, which are the last Tq entries of
    k, v: [B, S, H, D]. `stats` must already include the new keys; `sbar` [B, H, D, D] covers the
    S - Tq cached tokens only. Padded queries (q_pos < 0) return zeros. Where the new tokens are not the
    last Tq slots (a static cache's whole buffers), `new_kv` holds their keys and values
    [B, Tq, H, D]: they feed Sbar and the causal linear term, and every slot is a candidate key.
    """
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # views [B, H, T, D]
    B, HQ, Tq, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = HQ // H
    P = S - Tq  # cached slots before the new tokens (when they are last)
    scale = 1.0 / math.sqrt(D)
    block_size, use_rla = params.block_size, params.use_rla
    sel_blocks = select_blocks(q.transpose(1, 2), stats, q_pos, params)  # [B, H, Tq, NB]
    k_valid = k_pos >= 0
    k_blk = torch.where(k_valid, k_pos // block_size, 0)  # [B, S]
    if return_weights:
        query_chunk = max(1, Tq)  # the weights are returned whole: one chunk
    elif query_chunk is None:
        query_chunk = min(1024, max(128, (1 << 23) // max(1, B * HQ * S)))  # ~32 MB score tiles
    acc = acc_dtype(q)
    kf = k.to(acc)
    vf = v.to(acc)
    sbar = sbar.to(acc)
    phik = feature_map(k) * k_valid[:, None, :, None]  # [B, H, S, D]; pads contribute nothing
    k_new, v_new = (x.transpose(1, 2) for x in new_tokens(k.transpose(1, 2), v.transpose(1, 2), Tq, new_kv))
    phik_new = feature_map(k_new) * (q_pos >= 0)[:, None, :, None]
    v_new = v_new.to(acc)
    o_sp = q.new_zeros(B, HQ, Tq, D, dtype=acc)
    o_rla = torch.zeros_like(o_sp) if use_rla else None
    weights = None
    if use_rla:  # what Sbar holds beyond the cached keys' own sum (0 up to rounding in a model's cache)
        drift = sbar - (phik.transpose(-1, -2) @ vf - phik_new.transpose(-1, -2) @ v_new)
    for c0 in range(0, Tq, query_chunk):
        c1 = min(Tq, c0 + query_chunk)
        C = c1 - c0
        Sc = P + c1 if new_kv is None else S  # keys after the chunk's last slot are never causal for it
        qp = q_pos[:, c0:c1]  # [B, C]
        kp = k_pos[:, :Sc]
        causal = (kp >= 0)[:, None, :] & (kp[:, None, :] <= qp[:, :, None])  # [B, C, Sc]
        blk_sel = sel_blocks[:, :, c0:c1].gather(
            -1, k_blk[:, None, None, :Sc].expand(B, H, C, Sc)
        )  # [B, H, C, Sc]
        mask = blk_sel & causal[:, None]  # selected causal keys [B, H, C, Sc]
        qc = q[:, :, c0:c1].to(acc).reshape(B, H, G, C, D)
        # the sparse branch (through SDPA: batch x KV head as the batch, the group's G query heads
        # sharing the KV head and the mask); every real query has a key (its own block is always
        # selected), padded ones get any (zeroed below)
        allowed = mask | (qp < 0)[:, None, :, None]  # [B, H, C, Sc]
        rows = allowed.reshape(B * H, 1, C, Sc)
        if return_weights:  # the softmax written out, as eager attention does (weights in q's dtype)
            scores = torch.matmul(qc, kf[:, :, None, :Sc].transpose(-1, -2)) * scale  # [B, H, G, C, Sc]
            scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
            p = torch.softmax(scores, dim=-1) * (qp >= 0)[:, None, None, :, None]  # padded queries: zeros
            weights = p.to(q.dtype).reshape(B, HQ, C, Sc)
            o_sp[:, :, c0:c1] = torch.matmul(weights.view(B, H, G, C, Sc).to(acc), vf[:, :, None, :Sc]).reshape(
                B, HQ, C, D)
        else:
            o_sp[:, :, c0:c1] = F.scaled_dot_product_attention(
                qc.reshape(B * H, G, C, D), kf[:, :, None, :Sc].reshape(B * H, 1, Sc, D),
                vf[:, :, None, :Sc].reshape(B * H, 1, Sc, D), attn_mask=rows, scale=scale, enable_gqa=True,
            ).reshape(B, HQ, C, D)
        if use_rla:  # the unselected causal keys' linear term, summed directly (module docstring)
            unsel = causal[:, None] & ~blk_sel  # [B, H, C, Sc]
            phiq = feature_map(qc).reshape(B, H, G * C, D)
            a = torch.matmul(phiq, phik[:, :, :Sc].transpose(-1, -2)).view(B, H, G, C, Sc)
            a = a.masked_fill_(~unsel[:, :, None], 0.0).view(B, H, G * C, Sc)
            rla = torch.matmul(a, vf[:, :, :Sc]) + torch.matmul(phiq, drift)
            rla = rla.view(B, H, G, C, D).masked_fill_(~unsel.any(-1)[:, :, None, :, None], 0.0)
            o_rla[:, :, c0:c1] = rla.reshape(B, HQ, C, D)
    q_ok = (q_pos >= 0)[:, :, None, None]
    o_sp = (o_sp.transpose(1, 2) * q_ok).to(q.dtype)
    if use_rla:
        o_rla = (o_rla.transpose(1, 2) * q_ok).to(q.dtype)
    if Tq:
        sbar = sbar + torch.einsum("bhsd,bhse->bhde", phik_new, v_new)
    if return_weights:  # one chunk of every slot (Sc = S), or none for no new token
        return o_sp, o_rla, sbar, q.new_zeros(B, HQ, Tq, S) if weights is None else weights
    return o_sp, o_rla, sbar
