"""One SPLA decode step in PyTorch that reads only the selected blocks: the "torch" path's decode
(CPU, or CUDA without Triton) when each row's tokens sit in consecutive cache slots.

The masked parallel form (`parallel.spla_parallel`) reads every cached key for the sparse branch and
the correction term; here the block scores read the block sums only, the top-k gives each KV head's
selected blocks, and their keys and values are gathered (top_k_blocks x block_size slots) for the
softmax and the correction. The global linear term reads Sbar, as before. Same contract and same
values as `spla_parallel` for one token per row.

Without the residual term (`use_rla=False`, or gamma = 0, which the model turns into it), when the
cached slots are at most `READ_ALL_RATIO` times the selected ones, the exact branch reads every
cached key in place under a mask of the selected blocks instead (`read="all"`): the same softmax
over the same keys, without the two gather copies, which on the CPU cost more than reading the
unselected keys (docs/benchmarks.md, "CPU prefill and decode").
"""

from __future__ import annotations

import math

import torch

from ..utils import acc_dtype
from .plan import SPLAParams
from .select import NEG
from .stats import BlockStats, feature_map, new_tokens

#: `read="auto"` reads every cached slot under a mask (no gathers) when the slots are at most this
#: many times the selected ones (top_k_blocks x block_size) and the residual term is not computed.
READ_ALL_RATIO = 2.0
READS = ("auto", "blocks", "all")


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
    read: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """q [B, 1, HQ, D] (one new token per row, already written into k, v [B, S, H, D]), q_pos [B, 1],
    `k_offsets` [B]: the slot of each row's position 0. Returns (o_sp, o_rla or None, new Sbar) as
    `spla_parallel` does. `read`: "blocks" gathers the selected blocks' keys and values, "all" reads
    every cached key under a mask of the selected blocks (use_rla=False only), "auto" picks "all" where
    it is cheaper (`READ_ALL_RATIO`)."""
    B, Tq, HQ, D = q.shape
    if Tq != 1:
        raise ValueError(f"spla_decode_gather takes one token per row, got {Tq}")
    if read not in READS:
        raise ValueError(f"read must be one of {', '.join(READS)}; got {read!r}")
    if read == "all" and params.use_rla:
        raise ValueError('read="all" computes no residual term: pass params with use_rla=False or read="blocks"')
    S, H = k.shape[1], k.shape[2]
    G = HQ // H
    acc = acc_dtype(q)
    dev = q.device
    bs = params.block_size
    qp = q_pos[:, 0]                                                      # [B]
    qf = q[:, 0].to(acc).reshape(B, H, G, D)
    blocks, live = _decode_blocks(qf, stats, qp, params)                 # [B, H, kk]
    if read == "auto":
        read = "all" if not params.use_rla and S <= READ_ALL_RATIO * blocks.shape[-1] * bs else "blocks"
    if read == "all":
        o_sp = _attend_all(qf, k, v, qp, k_offsets, blocks, live, stats.num_blocks, bs)
        k_new, v_new = new_tokens(k, v, 1, new_kv)
        sbar = _add_sbar(sbar, k_new, v_new, qp, acc)
        return torch.where((qp >= 0)[:, None, None, None], o_sp.reshape(B, 1, HQ, D), 0.0).to(q.dtype), None, sbar
    pos = blocks[..., None] * bs + torch.arange(bs, device=dev)          # [B, H, kk, bs]
    ok = (live[..., None] & (pos <= qp[:, None, None, None])).reshape(B, H, -1)   # [B, H, L]
    slot = (k_offsets.long()[:, None, None, None] + pos).clamp_(0, S - 1).reshape(B, H, -1)
    kg = gather_slots(k.transpose(1, 2), slot).to(acc)                    # [B, H, L, D]
    vg = gather_slots(v.transpose(1, 2), slot).to(acc)
    logits = (qf @ kg.transpose(-1, -2)).mul_(1.0 / math.sqrt(D))       # [B, H, G, L]
    masked = ~ok[:, :, None]
    attn = torch.softmax(logits.masked_fill_(masked, NEG), dim=-1)

    k_new, v_new = new_tokens(k, v, 1, new_kv)                           # [B, 1, H, D]
    sbar = _add_sbar(sbar, k_new, v_new, qp, acc)
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


def _add_sbar(sbar: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qp: torch.Tensor,
              acc: torch.dtype) -> torch.Tensor:
    """Sbar [B, H, D, D] + phi(k_new) v_new^T for the new token [B, 1, H, D] of each real row (qp >= 0)."""
    B, _, H, D = k_new.shape
    phik_new = feature_map(k_new[:, 0]) * (qp >= 0)[:, None, None]       # [B, H, D]
    return torch.baddbmm(sbar.to(acc).reshape(B * H, D, D), phik_new.reshape(B * H, D, 1),
                         v_new[:, 0].to(acc).reshape(B * H, 1, D)).view(B, H, D, D)


def _attend_all(qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qp: torch.Tensor, k_offsets: torch.Tensor,
                blocks: torch.Tensor, live: torch.Tensor, nb: int, bs: int) -> torch.Tensor:
    """Softmax attention of qf [B, H, G, D] (acc dtype) over every cached slot of k, v [B, S, H, D] in
    place, masked to the selected blocks (blocks, live [B, H, kk]) up to the query's position qp [B]:
    the exact branch over the same keys as the gathered form. Returns o_sp [B, H, G, D]."""
    B, H, G, D = qf.shape
    S = k.shape[1]
    kpos = torch.arange(S, device=qf.device) - k_offsets.long()[:, None]               # [B, S] logical positions
    kblk = torch.where((kpos >= 0) & (kpos <= qp[:, None]), kpos // bs, nb)           # [B, S]; nb: not a key
    chosen = torch.zeros(B, H, nb + 1, dtype=torch.bool, device=qf.device).scatter_(-1, blocks, live)
    ok = chosen.gather(-1, kblk[:, None].expand(B, H, S))                              # [B, H, S]
    K, V = k.transpose(1, 2).to(qf.dtype), v.transpose(1, 2).to(qf.dtype)               # [B, H, S, D] views
    logits = (qf @ K.transpose(-1, -2)).mul_(1.0 / math.sqrt(D))                      # [B, H, G, S]
    return torch.softmax(logits.masked_fill_(~ok[:, :, None], NEG), dim=-1) @ V


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
    back = cur - b                                                        # [B, NB]: blocks back from the current
    exists = back >= 0
    # candidates: complete past blocks that are neither sink nor local; the forced blocks are the other existing ones
    cand = (back >= params.num_local_blocks) & (b >= params.num_sink_blocks)
    cnt = stats.count.clamp(min=1.0)[:, None, :, None]
    mu = stats.sum_k / cnt                                                # [B, H, NB, D]
    qs = qf.to(mu.dtype) * (1.0 / math.sqrt(D))
    score = qs @ mu.transpose(-1, -2)                                     # [B, H, G, NB]
    if params.selection == "taylor":
        s2 = (stats.sum_k2 / cnt).sub_(mu * mu).clamp_(min=0.0)
        score = score.add_(torch.log1p((qs * qs @ s2.transpose(-1, -2)).mul_(0.5)))
    cand = cand[:, None]                                                  # [B, 1, NB]
    prob = torch.softmax(torch.where(cand[:, :, None], score, NEG), dim=-1).sum(2)   # [B, H, NB]
    # forced 2G (above any group score), candidates their score, blocks not yet started -1
    rank = torch.where(cand, prob, torch.where(exists, 2.0 * G, -1.0)[:, None])
    vals, blocks = rank.topk(min(params.top_k_blocks, NB), dim=-1)       # [B, H, kk]
    return blocks, vals >= 0
