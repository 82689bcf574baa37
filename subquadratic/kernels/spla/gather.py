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
from .select import NEG, select_blocks
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
    block_size = params.block_size
    sel = select_blocks(q, stats, q_pos, params)[:, :, 0]                 # [B, H, NB] bool
    kk = min(params.top_k_blocks, sel.shape[-1])
    live, blocks = sel.to(torch.int8).topk(kk, dim=-1)                   # [B, H, kk]
    qp = q_pos[:, 0]                                                      # [B]
    pos = blocks[..., None] * block_size + torch.arange(block_size, device=dev)  # [B, H, kk, bs]
    ok = live.bool()[..., None] & (pos <= qp[:, None, None, None]) & (qp >= 0)[:, None, None, None]
    slot = (k_offsets.long()[:, None, None, None] + pos).clamp(0, S - 1)
    slot, ok = slot.reshape(B, H, -1), ok.reshape(B, H, -1)              # [B, H, L]
    kg = gather_slots(k.transpose(1, 2), slot).to(acc)                    # [B, H, L, D]
    vg = gather_slots(v.transpose(1, 2), slot).to(acc)
    qf = q[:, 0].to(acc).reshape(B, H, G, D)
    logits = torch.einsum("bhgd,bhld->bhgl", qf, kg) / math.sqrt(D)
    attn = torch.softmax(logits.masked_fill(~ok[:, :, None], NEG), dim=-1)
    o_sp = torch.einsum("bhgl,bhld->bhgd", attn, vg)

    k_new, v_new = new_tokens(k, v, 1, new_kv)                           # [B, 1, H, D]
    phik_new = feature_map(k_new[:, 0]) * (qp >= 0)[:, None, None]       # [B, H, D]
    sbar = sbar.to(acc) + torch.einsum("bhd,bhe->bhde", phik_new, v_new[:, 0].to(acc))
    o_rla = None
    if params.use_rla:
        phiq = feature_map(qf)                                            # [B, H, G, D]
        full = torch.einsum("bhgd,bhde->bhge", phiq, sbar)
        a_sel = torch.einsum("bhgd,bhld->bhgl", phiq, feature_map(kg) * ok[..., None])
        rla = full - torch.einsum("bhgl,bhld->bhgd", a_sel, vg)
        every = ok.sum(-1) == (qp + 1)[:, None]                          # all causal keys selected
        o_rla = rla.masked_fill(every[:, :, None, None], 0.0)
    q_ok = (qp >= 0)[:, None, None, None]
    out = [(x.reshape(B, 1, HQ, D) * q_ok).to(q.dtype) if x is not None else None for x in (o_sp, o_rla)]
    return out[0], out[1], sbar
