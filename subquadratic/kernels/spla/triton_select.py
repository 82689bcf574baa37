"""SPLA block selection with Triton: block scores from the running block statistics (a scoring
kernel for a few queries, fp32 matmuls for many), then per (token, KV head) the per-head softmax over
the candidate blocks, the group sum and the top-k, in registers (`spla_topk_kernel`). Two launches
for any number of queries, no host synchronisation."""

from __future__ import annotations

import math

import torch

from ..triton_launch import jit
from ..triton_utils import cdiv, next_power_of_2
from ..utils import import_triton, new_output
from .plan import Launch, SPLAParams
from .triton_common import NEG

triton, tl = import_triton()

@jit
def spla_score_kernel(
    Q, SUMK, SUMK2, CNT, QPOS, SC,
    stride_qb, stride_qh, stride_qt, stride_sb, stride_sh, stride_cb,
    T, H, NB, block_size, n_sink, n_local, scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, TAYLOR: tl.constexpr,
    PREC: tl.constexpr = "ieee", USE_DOT: tl.constexpr = True,
):
    """Block scores of the G query heads of one (token, batch x KV head) for BN blocks:
    qs.mu + log(1 + qs^2.s2 / 2) ("taylor") or qs.mu, NEG for blocks that are not candidates
    (complete past blocks that are not forced). SC: [B, T, H, G, NB]. The scores are one padded
    [GP, D] x [D, BN] fp32 dot at precision PREC ("ieee"; "tf32x3", within fp32 rounding of it and
    faster), or with USE_DOT=False each head's scores as elementwise fp32 sums."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, GP)
    row_ok = rows < G
    d = tl.arange(0, D)
    n = tl.program_id(2) * BN + tl.arange(0, BN)
    q = tl.load(Q + b * stride_qb + (h * G + rows)[:, None] * stride_qh + t * stride_qt + d[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32) * scale
    tpos = tl.load(QPOS + b * T + t)
    cur = tl.where(tpos >= 0, tpos // block_size, -1)
    cand = (n < cur) & (n >= n_sink) & (n <= cur - n_local)
    stat = b * stride_sb + h * stride_sh + n * D  # sum_k, sum_k2: [B, H, NB, D] views, unit stride in D
    cnt = tl.maximum(tl.load(CNT + b * stride_cb + n, mask=n < NB, other=1.0), 1.0)
    mu = tl.load(SUMK + stat[:, None] + d[None, :], mask=(n < NB)[:, None], other=0.0) / cnt[:, None]
    if TAYLOR:
        s2 = tl.load(SUMK2 + stat[:, None] + d[None, :], mask=(n < NB)[:, None], other=0.0)
        s2 = tl.maximum(s2 / cnt[:, None] - mu * mu, 0.0)
    if USE_DOT:
        sc = tl.dot(q, tl.trans(mu), input_precision=PREC)
        if TAYLOR:
            sc += tl.log(1.0 + 0.5 * tl.dot(q * q, tl.trans(s2), input_precision=PREC))
        sc = tl.where(cand[None, :], sc, NEG)
        out = (((b * T + t) * H + h) * G + rows)[:, None] * NB + n[None, :]
        tl.store(SC + out, sc, mask=row_ok[:, None] & (n < NB)[None, :])
    else:
        for g in tl.static_range(G):
            qg = tl.load(Q + b * stride_qb + (h * G + g) * stride_qh + t * stride_qt + d).to(tl.float32) * scale
            sg = tl.sum(mu * qg[None, :], 1)
            if TAYLOR:
                sg += tl.log(1.0 + 0.5 * tl.sum(s2 * (qg * qg)[None, :], 1))
            sg = tl.where(cand, sg, NEG)
            tl.store(SC + (((b * T + t) * H + h) * G + g) * NB + n, sg, mask=n < NB)


@jit
def spla_topk_kernel(
    SC, QPOS, GS, IDX,
    stride_sb, stride_st, stride_sh, stride_sg,
    T, H, NB, block_size, n_sink, n_local, top_k, NSEL,
    G: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr, NBP: tl.constexpr,
):
    """Group top-k of one (token, batch x KV head) from the raw scores SC [B, T, H, G, NB] (any
    strides, unit stride over the blocks; scores of non-candidate blocks are ignored; GP >= G rows, no
    tl.dot here, so no padding to 16): softmax
    over the candidate blocks per query head, summed over the group (written to the scratch GS
    [B, T, H, NB]), then the forced blocks (local, then sinks) and the best `top_k - forced`
    candidates into IDX [B, T, H, NSEL] (-1 = none)."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, GP)
    row_ok = rows < G
    tpos = tl.load(QPOS + b * T + t)
    cur = tl.where(tpos >= 0, tpos // block_size, -1)
    sc_base = SC + b * stride_sb + t * stride_st + h * stride_sh + rows[:, None] * stride_sg
    gs_base = GS + ((b * T + t) * H + h) * NB
    m_i = tl.full([GP], NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    for n0 in range(0, NB, BN):  # softmax statistics per query head over the candidates
        n = n0 + tl.arange(0, BN)
        cand = (n < cur) & (n >= n_sink) & (n <= cur - n_local)
        sc = tl.load(sc_base + n[None, :], mask=row_ok[:, None] & (n < NB)[None, :], other=NEG)
        sc = tl.where(cand[None, :], sc, NEG)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.where(cand[None, :], tl.exp(sc - m_new[:, None]), 0.0), 1)
        m_i = m_new
    inv_l = tl.where(row_ok & (l_i > 0), 1.0 / tl.maximum(l_i, 1e-30), 0.0)
    for n0 in range(0, NB, BN):  # group score of each candidate, -1 elsewhere
        n = n0 + tl.arange(0, BN)
        cand = (n < cur) & (n >= n_sink) & (n <= cur - n_local)
        sc = tl.load(sc_base + n[None, :], mask=row_ok[:, None] & (n < NB)[None, :], other=NEG)
        p = tl.exp(sc - m_i[:, None]) * inv_l[:, None]
        tl.store(gs_base + n, tl.where(cand, tl.sum(p, 0), -1.0), mask=n < NB)
    out = IDX + ((b * T + t) * H + h) * NSEL
    n_forced = tl.full([], 0, tl.int32)
    for i in range(0, n_local):  # the current block and the ones before it
        blk = cur - i
        tl.store(out + i, tl.where(blk >= 0, blk, -1))
        n_forced += tl.where(blk >= 0, 1, 0)
    for i in range(0, n_sink):  # sinks not already local
        ok = i <= cur - n_local
        tl.store(out + n_local + i, tl.where(ok, i, -1))
        n_forced += tl.where(ok, 1, 0)
    free = top_k - n_forced
    tl.debug_barrier()  # the group scores written above are read back by other threads
    nn = tl.arange(0, NBP)
    g = tl.load(gs_base + nn, mask=nn < NB, other=-1.0)  # all group scores in registers
    for r in range(0, free):  # iterative arg-max over the free budget, one reduction per round
        best_v, best_i = tl.max(g, 0, return_indices=True)
        tl.store(out + n_local + n_sink + r, tl.where(best_v >= 0, best_i, -1))
        g = tl.where(nn == best_i, -2.0, g)
    for r in range(tl.maximum(free, 0), top_k):
        tl.store(out + n_local + n_sink + r, -1)


def select_indices(q, stats, q_pos, params: SPLAParams, *, matmul: bool = False, launch: Launch | None = None,
                   max_scores: int = 1 << 27) -> torch.Tensor:
    """The selected blocks of every query q [B, Tq, HQ, D] as int32 indices [B, Tq, H, local + sink +
    top_k] (-1 = none), over chunks of queries whose raw scores [B, chunk, HQ, NB] stay under
    `max_scores` floats, with no host synchronisation: block scores (the scoring kernel, for a few
    queries: each program reloads the block statistics; or with `matmul` fp32 matmuls, which share
    them across queries), then the group top-k kernel; `launch` sets both launches (default
    `Launch()`). The same selection as `select.select_blocks` (up to ties and fp32 rounding)."""
    q = q.transpose(1, 2)  # view [B, HQ, Tq, D]
    B, HQ, Tq, D = q.shape
    H, NB = stats.sum_k.shape[1], stats.num_blocks
    G = HQ // H
    GP = max(16, next_power_of_2(G))
    dev = q.device
    block_size, n_sink, n_local, top_k = (params.block_size, params.num_sink_blocks, params.num_local_blocks,
                                          params.top_k_blocks)
    nsel = params.num_selected
    launch = Launch() if launch is None else launch
    taylor = params.selection == "taylor"
    sum_k, sum_k2, count = (x.float() for x in (stats.sum_k, stats.sum_k2, stats.count))
    if matmul:  # per-block mean and variance once, then matmuls
        cnt = count.clamp(min=1.0)[:, None, :, None]
        mu = sum_k / cnt
        s2 = (sum_k2 / cnt - mu * mu).clamp(min=0.0) if taylor else None
    elif not (sum_k.stride() == sum_k2.stride() and sum_k.stride()[2:] == (D, 1) and count.stride(1) == 1):
        sum_k, sum_k2, count = sum_k.contiguous(), sum_k2.contiguous(), count.contiguous()
    qpos = q_pos.to(torch.int32).contiguous()  # no copy when the caller passes int32 positions
    chunk = max(1, min(Tq, max_scores // max(1, B * HQ * NB)))
    out = new_output((B, Tq, H, nsel), dev, torch.int32) if chunk < Tq else None
    for c0 in range(0, Tq, chunk):
        C = min(Tq, c0 + chunk) - c0
        qc, pc = q[:, :, c0:c0 + C], qpos[:, c0:c0 + C].contiguous()
        if matmul:
            qs = qc.float().reshape(B, H, G, C, D) / math.sqrt(D)
            sc = torch.matmul(qs, mu.transpose(-1, -2)[:, :, None])  # [B, H, G, C, NB]
            if taylor:
                sc += torch.log1p(0.5 * torch.matmul(qs * qs, s2.transpose(-1, -2)[:, :, None]))
            strides = (sc.stride(0), sc.stride(3), sc.stride(1), sc.stride(2))
        else:
            sc = new_output((B, C, H, G, NB), dev)
            spla_score_kernel[(C, B * H, cdiv(NB, launch.score_bn))](
                qc, sum_k, sum_k2, count, pc, sc, qc.stride(0), qc.stride(1), qc.stride(2),
                sum_k.stride(0), sum_k.stride(1), count.stride(0),
                C, H, NB, block_size, n_sink, n_local, 1.0 / math.sqrt(D),
                G=G, GP=GP, D=D, BN=launch.score_bn, TAYLOR=taylor, PREC=launch.score_prec, USE_DOT=launch.score_dot,
                num_warps=launch.score_warps,
            )
            strides = (sc.stride(0), sc.stride(1), sc.stride(2), sc.stride(3))
        idx = new_output((B, C, H, nsel), dev, torch.int32)
        GP_TOPK = max(2, next_power_of_2(G))  # no tl.dot in the top-k: no padding to 16
        spla_topk_kernel[(C, B * H)](
            sc, pc, new_output((B, C, H, NB), dev), idx, *strides, C, H, NB, block_size, n_sink, n_local, top_k, nsel,
            G=G, GP=GP_TOPK, BN=launch.topk_bn or max(128, 4096 // GP_TOPK), NBP=max(16, next_power_of_2(NB)),
            num_warps=launch.topk_warps if NB <= 4096 else 8,
        )
        if out is None:
            return idx
        out[:, c0:c0 + C] = idx
    return out
