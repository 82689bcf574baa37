"""One SPLA decode step in PyTorch that reads only the selected blocks: the "torch" path's decode
(CPU, or CUDA without Triton) when each row's tokens sit in consecutive cache slots.

The masked parallel form (`parallel.spla_parallel`) reads every cached key for the sparse branch and
the correction term; here the block scores read the block sums only, the top-k gives each KV head's
selected blocks, and their keys and values are gathered (top_k_blocks x block_size slots) for the
softmax and the correction. The global linear term reads Sbar, as before. Same contract and same
values as `spla_parallel` for one token per row.
"""

from __future__ import annotations

import math

import torch

from ..utils import acc_dtype
from .plan import SPLAParams
from .select import NEG
from .stats import BlockStats, feature_map, new_tokens


def gather_slots(x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D] (a view of a cache, whose slots are rows of D contiguous elements), slot
    [B, H, L] -> x[b, h, slot[b, h, l]] as [B, H, L, D]. Copies whole rows (index_select over the rows
    of x's storage: on the CPU far faster than `gather` with an index expanded over D, see
    docs/benchmarks.md), or indexes x directly where its strides do not make rows."""
    B, H, S, D = x.shape
    sb, sh, ss, sd = x.stride()
    if sd == 1 and ss == D and sb % D == 0 and sh % D == 0:
        n = ((B - 1) * sb + (H - 1) * sh) // D + S                    # the rows x spans
        rows = x.as_strided((n, D), (D, 1))                           # from x's own storage offset
        r = (torch.arange(B, device=x.device) * (sb // D))[:, None, None] \
            + (torch.arange(H, device=x.device) * (sh // D))[None, :, None] + slot
        return rows.index_select(0, r.reshape(-1)).view(B, H, -1, D)
    b = torch.arange(B, device=x.device)[:, None, None]
    h = torch.arange(H, device=x.device)[None, :, None]
    return x[b, h, slot]


def spla_decode_gather(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    stats: BlockStats,
    sbar: torch.Tensor,
    k_offsets: torch.Tensor,
    params: SPLAParams,
    *,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """q [B, 1, HQ, D] (one new token per row, already written into k, v [B, S, H, D]), q_pos [B, 1],
    `k_offsets` [B]: the slot of each row's position 0. Returns (o_sp, o_rla or None, new Sbar) as
    `spla_parallel` does."""
    B, Tq, HQ, D = q.shape
    if Tq != 1:
        raise ValueError(f"spla_decode_gather takes one token per row, got {Tq}")
    S, H = k.shape[1], k.shape[2]
    G = HQ // H
    acc = acc_dtype(q)
    dev = q.device
    bs = params.block_size
    qp = q_pos[:, 0]                                                      # [B]
    qf = q[:, 0].to(acc).reshape(B, H, G, D)
    blocks, live = _decode_blocks(qf, stats, qp, params)                 # [B, H, kk]
    pos = blocks[..., None] * bs + torch.arange(bs, device=dev)          # [B, H, kk, bs]
    ok = (live[..., None] & (pos <= qp[:, None, None, None])).reshape(B, H, -1)   # [B, H, L]
    slot = (k_offsets.long()[:, None, None, None] + pos).clamp_(0, S - 1).reshape(B, H, -1)
    kg = gather_slots(k.transpose(1, 2), slot).to(acc)                    # [B, H, L, D]
    vg = gather_slots(v.transpose(1, 2), slot).to(acc)
    logits = (qf @ kg.transpose(-1, -2)).mul_(1.0 / math.sqrt(D))       # [B, H, G, L]
    masked = ~ok[:, :, None]
    attn = torch.softmax(logits.masked_fill_(masked, NEG), dim=-1)

    k_new, v_new = new_tokens(k, v, 1, new_kv)                           # [B, 1, H, D]
    phik_new = feature_map(k_new[:, 0]) * (qp >= 0)[:, None, None]       # [B, H, D]
    sbar = torch.baddbmm(sbar.to(acc).reshape(B * H, D, D), phik_new.reshape(B * H, D, 1),
                         v_new[:, 0].to(acc).reshape(B * H, 1, D)).view(B, H, D, D)
    if params.use_rla:
        phiq = feature_map(qf)                                            # [B, H, G, D]
        a_sel = (phiq @ feature_map(kg).transpose(-1, -2)).masked_fill_(masked, 0.0)   # [B, H, G, L]
        both = torch.cat([attn, a_sel], 2) @ vg                           # [B, H, 2G, D]: o_sp, the selected part
        o_sp = both[:, :, :G]
        rla = phiq @ sbar - both[:, :, G:]
        every = ok.sum(-1) == (qp + 1)[:, None]                          # all causal keys selected
        o_rla = rla.masked_fill_(every[:, :, None, None], 0.0)
    else:
        o_sp, o_rla = attn @ vg, None
    q_ok = (qp >= 0)[:, None, None, None]
    out = [(x.reshape(B, 1, HQ, D) * q_ok).to(q.dtype) if x is not None else None for x in (o_sp, o_rla)]
    return out[0], out[1], sbar


def _decode_blocks(qf: torch.Tensor, stats: BlockStats, qp: torch.Tensor,
                   params: SPLAParams) -> tuple[torch.Tensor, torch.Tensor]:
    """`select.select_blocks` for one query per row, as block indices: qf [B, H, G, D] (acc dtype),
    qp [B] -> (blocks [B, H, kk] long, live [B, H, kk] bool), kk = min(top_k_blocks, NB). The forced
    blocks rank above every candidate and the candidates by their group score, so one top-k gives
    the forced blocks and the best candidates of the free budget (the same selection)."""
    B, H, G, D = qf.shape
    NB = stats.num_blocks
    b = torch.arange(NB, device=qf.device)
    cur = torch.where(qp >= 0, qp // params.block_size, -1)[:, None]      # [B, 1]
    exists = b <= cur
    forced = exists & ((b < params.num_sink_blocks) | (b > cur - params.num_local_blocks))   # [B, NB]
    cand = exists & ~forced
    cnt = stats.count.clamp(min=1.0)[:, None, :, None]
    mu = stats.sum_k / cnt                                                # [B, H, NB, D]
    qs = qf.to(mu.dtype) * (1.0 / math.sqrt(D))
    score = qs @ mu.transpose(-1, -2)                                     # [B, H, G, NB]
    if params.selection == "taylor":
        s2 = (stats.sum_k2 / cnt).sub_(mu * mu).clamp_(min=0.0)
        score = score.add_(torch.log1p((qs * qs @ s2.transpose(-1, -2)).mul_(0.5)))
    prob = torch.softmax(score.masked_fill_(~cand[:, None, None], NEG), dim=-1).sum(2)   # [B, H, NB]
    rank = torch.where(forced[:, None], 2.0 * G, prob.masked_fill_(~cand[:, None], -1.0))
    vals, blocks = rank.topk(min(params.top_k_blocks, NB), dim=-1)       # [B, H, kk]
    return blocks, vals >= 0
