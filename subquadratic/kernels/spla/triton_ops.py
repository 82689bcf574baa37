"""Triton kernels of SPLA: prefill, training (forward and backward) and decode. Imported only
where Triton is installed.

`spla_sparse_kernel` runs one program per (query token, batch x KV head, split): the G query
heads of the group are the rows of one tile (padded to at least 16 for tl.dot), and the program
loops over the token's selected KV blocks doing the online softmax of the sparse branch and, on
the same K/V tiles, the correction otilde = sum_{selected j} (phi(q).phi(k_j)) v_j of the residual
term. Unselected blocks are never read. Short query chunks split the selected blocks over several
programs (split-K) and merge the partial softmax states afterwards.

Backward (`SparseAttention`): `spla_bwd_dq_kernel` walks each token's selected blocks again for dq;
`spla_bwd_dkv_kernel` runs one program per (key block, batch x KV head) over the queries that
selected that block (CSR lists inverted from the block indices), so dk and dv need no atomics.
Both go through the sparse softmax and the correction term, the feature map's Jacobian included.

Selection (`select_indices`) is two launches for any number of queries: block scores from the
running block statistics, then per (token, KV head) the per-head softmax over the candidate blocks,
the group sum and the top-k, in registers. Decode (`spla_decode_triton`) adds two: the selected
tiles split over several programs while one more program reads out phi(q)^T Sbar_t and updates
Sbar, then a merge. The global causal linear term phi(q)^T Sbar_t of a prefill is chunked PyTorch
matmuls (`causal_linear_term`), differentiated by autograd.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # the package's reference path needs no Triton
    raise ImportError("the SPLA Triton kernels need `pip install triton`") from e

from ..positions import slot_offsets
from .reference import BlockStats, acc_dtype, feature_map

NEG = tl.constexpr(-1e30)  # finite "minus infinity" for masked scores
#: Launch settings: blocks per scoring program, dot precision (or elementwise fp32 sums) of the
#: scores and that launch's warps; selected blocks per decode program and the decode kernel's warps.
#: On the H200 at 128k, the fp32 "ieee" dot took 0.17 ms of a decode step, "tf32x3" 0.044 ms and
#: elementwise sums 0.035 ms. The scoring kernel serves up to SCORE_KERNEL_MAX_TQ queries; beyond,
#: every query would reload all block statistics (52 ms at 32k), so scores are fp32 matmuls.
SCORE_BN = 16
SCORE_PREC = "ieee"
SCORE_DOT = False
SCORE_WARPS = 4
SCORE_KERNEL_MAX_TQ = 64
DECODE_BLOCKS_PER_SPLIT = 3
DECODE_WARPS = 4
#: Queries per call from which the feature map phi(k) is computed once per key before the sparse
#: kernels instead of on every loaded tile (prefill and training recompute it per token otherwise).
PHIK_PRECOMPUTE_MIN_TQ = 65


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation: exact fp32 ("ieee") for fp32 inputs, else on the tensor cores
    with `a` cast to b's dtype."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit
def _softmax_rows(x):
    """phi(x) = softmax over the last (head) dimension, in fp32."""
    xf = x.to(tl.float32)
    e = tl.exp(xf - tl.max(xf, 1)[:, None])
    return e / tl.sum(e, 1)[:, None]


@triton.jit
def spla_sparse_kernel(
    Q, K, V, PHIK, IDX, QPOS, KOFF, O_ACC, O_TIL, M_OUT, L_OUT,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_pb, stride_ph, stride_ps,
    T, H, NSEL, PER_SPLIT, scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    USE_RLA: tl.constexpr, IEEE: tl.constexpr, PRE_PHIK: tl.constexpr = False,
):
    t = tl.program_id(0)
    bh = tl.program_id(1)
    sp = tl.program_id(2)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, GP)
    row_ok = rows < G
    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    q_ptr = Q + b * stride_qb + (h * G + rows)[:, None] * stride_qh + t * stride_qt + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)
    tpos = tl.load(QPOS + b * T + t)
    koff = tl.load(KOFF + b)
    m_i = tl.full([GP], NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    ot = tl.zeros([GP, D], tl.float32)
    if USE_RLA:
        phiq = _softmax_rows(q)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    p_base = PHIK + b * stride_pb + h * stride_ph
    idx_base = IDX + (b * T + t) * H * NSEL + h * NSEL
    for i in range(0, PER_SPLIT):
        kk = sp * PER_SPLIT + i
        blk = tl.load(idx_base + kk, mask=kk < NSEL, other=-1)
        pos = blk * BS + j
        kmask = (blk >= 0) & (pos <= tpos)
        slot = koff + pos
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kmask[:, None], other=0.0)
        s = _mm(q, tl.trans(k), IEEE) * scale
        s = tl.where(kmask[None, :], s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(kmask[None, :], tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p, v, IEEE)
        m_i = m_new
        if USE_RLA:  # the correction on the same tiles, on the tensor cores in the inputs' dtype
            if PRE_PHIK:
                phik = tl.load(p_base + slot[:, None] * stride_ps + d[None, :], mask=kmask[:, None], other=0.0)
            else:
                phik = _softmax_rows(k)
            a = tl.where(kmask[None, :], _mm(phiq, tl.trans(phik.to(k.dtype)), IEEE), 0.0)
            ot += _mm(a, v, IEEE)
    HQ = H * G
    out_row = ((sp * (tl.num_programs(1) // H) + b) * T + t) * HQ + h * G + rows  # [nsp, B, T, HQ]
    tl.store(M_OUT + out_row, m_i, mask=row_ok)
    tl.store(L_OUT + out_row, l_i, mask=row_ok)
    tl.store(O_ACC + out_row[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    if USE_RLA:
        tl.store(O_TIL + out_row[:, None] * D + d[None, :], ot, mask=row_ok[:, None])


@triton.jit
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


@triton.jit
def spla_topk_kernel(
    SC, QPOS, GS, IDX,
    stride_sb, stride_st, stride_sh, stride_sg,
    T, H, NB, block_size, n_sink, n_local, top_k, NSEL,
    G: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr, NBP: tl.constexpr,
):
    """Group top-k of one (token, batch x KV head) from the raw scores SC [B, T, H, G, NB] (any
    strides, unit stride over the blocks; scores of non-candidate blocks are ignored): softmax
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
    for r in range(0, top_k):  # iterative arg-max
        best_v = tl.max(g, 0)
        best_i = tl.argmax(g, 0)
        ok = (best_v >= 0) & (r < free)
        tl.store(out + n_local + n_sink + r, tl.where(ok, best_i, -1))
        g = tl.where(nn == best_i, -2.0, g)


@triton.jit
def spla_decode_kernel(
    Q, K, V, IDX, QPOS, KOFF, SBAR, M_PART, L_PART, O_PART, OT_PART, N_PART, LIN, SBAR_NEW,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    H, NSEL, PER_SPLIT, NSPLIT, scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, DC: tl.constexpr,
    USE_RLA: tl.constexpr, IEEE: tl.constexpr,
):
    """One decode token of one (batch, KV head), split over NSPLIT + 1 programs. Program sp < NSPLIT
    takes selected-block slots [sp * PER_SPLIT, (sp + 1) * PER_SPLIT): the partial online softmax
    (M, L, O parts), the correction otilde on the same tiles (OT part) and the number of causal keys it
    saw (N part). Program NSPLIT (with the residual term) reads out phi(q)^T Sbar_t into LIN and writes
    Sbar_t = Sbar_{t-1} + phi(k_t) v_t^T. `spla_decode_merge_kernel` combines the parts."""
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, GP)
    row_ok = rows < G
    d = tl.arange(0, D)
    q_row = Q + b * stride_qb + (h * G + rows)[:, None] * stride_qh
    tpos = tl.load(QPOS + b)
    koff = tl.load(KOFF + b)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    part = (sp * tl.num_programs(0) + bh) * G + rows
    if sp < NSPLIT:
        j = tl.arange(0, BS)
        q = tl.load(q_row + d[None, :], mask=row_ok[:, None], other=0.0)
        m_i = tl.full([GP], NEG, tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        ot = tl.zeros([GP, D], tl.float32)
        n_sel = tl.full([], 0, tl.int32)
        if USE_RLA:
            phiq = _softmax_rows(q)
        idx_base = IDX + (b * H + h) * NSEL
        for i in range(0, PER_SPLIT):
            kk = sp * PER_SPLIT + i
            blk = tl.load(idx_base + kk, mask=kk < NSEL, other=-1)
            pos = blk * BS + j
            kmask = (blk >= 0) & (pos <= tpos)
            n_sel += tl.sum(kmask.to(tl.int32), 0)
            slot = koff + pos
            k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kmask[:, None], other=0.0)
            v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kmask[:, None], other=0.0)
            s = _mm(q, tl.trans(k), IEEE) * scale
            s = tl.where(kmask[None, :], s, NEG)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.where(kmask[None, :], tl.exp(s - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _mm(p, v, IEEE)
            m_i = m_new
            if USE_RLA:
                a = tl.where(kmask[None, :], _mm(phiq, tl.trans(_softmax_rows(k)), IEEE), 0.0)
                ot += _mm(a, v.to(tl.float32), IEEE)
        tl.store(M_PART + part, m_i, mask=row_ok)
        tl.store(L_PART + part, l_i, mask=row_ok)
        tl.store(O_PART + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(N_PART + sp * tl.num_programs(0) + bh, n_sel)
        if USE_RLA:
            tl.store(OT_PART + part[:, None] * D + d[None, :], ot, mask=row_ok[:, None])
    elif USE_RLA:
        # the new token's key and value (slot koff + tpos) update Sbar and enter the read-out
        valid = tpos >= 0
        qf = tl.load(q_row + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        q_max = tl.max(qf, 1)
        q_sum = tl.sum(tl.exp(qf - q_max[:, None]), 1)
        slot_t = koff + tl.maximum(tpos, 0)
        kt = tl.load(k_base + slot_t * stride_ks + d).to(tl.float32)
        kt_max = tl.max(kt, 0)
        kt_sum = tl.sum(tl.exp(kt - kt_max), 0)
        vt = tl.load(v_base + slot_t * stride_vs + d).to(tl.float32)
        vt = tl.where(valid, vt, 0.0)
        dc = tl.arange(0, DC)
        lin = tl.zeros([GP, D], tl.float32)
        sb_base = SBAR + (b * H + h) * D * D
        sbn_base = SBAR_NEW + (b * H + h) * D * D
        for c0 in range(0, D, DC):
            qc = tl.load(q_row + c0 + dc[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            phiq_c = tl.exp(qc - q_max[:, None]) / q_sum[:, None]
            phik_c = tl.exp(tl.load(k_base + slot_t * stride_ks + c0 + dc).to(tl.float32) - kt_max) / kt_sum
            sb = tl.load(sb_base + (c0 + dc)[:, None] * D + d[None, :])
            sb = sb + phik_c[:, None] * vt[None, :]
            tl.store(sbn_base + (c0 + dc)[:, None] * D + d[None, :], sb)
            lin += tl.dot(phiq_c, sb, input_precision="ieee")
        tl.store(LIN + ((b * H + h) * G + rows)[:, None] * D + d[None, :], lin, mask=row_ok[:, None])


@triton.jit
def spla_decode_merge_kernel(
    QPOS, M_PART, L_PART, O_PART, OT_PART, N_PART, LIN, O_SP, O_RLA,
    H, NSPLIT, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, USE_RLA: tl.constexpr,
):
    """Combine the decode parts of one (batch, KV head): o_sp = sum_s w_s O_s / sum_s w_s L_s with
    w_s = exp(M_s - max M), and o_rla = LIN - sum_s OT_s, exactly 0 when every causal key was
    selected. O_SP, O_RLA: [B, HQ, D] fp32."""
    bh = tl.program_id(0)
    BH = tl.num_programs(0)
    rows = tl.arange(0, GP)
    row_ok = rows < G
    d = tl.arange(0, D)
    m = tl.full([GP], NEG, tl.float32)
    for sp in range(0, NSPLIT):
        m = tl.maximum(m, tl.load(M_PART + (sp * BH + bh) * G + rows, mask=row_ok, other=NEG))
    l_sum = tl.zeros([GP], tl.float32)
    o = tl.zeros([GP, D], tl.float32)
    ot = tl.zeros([GP, D], tl.float32)
    n_sel = tl.full([], 0, tl.int32)
    for sp in range(0, NSPLIT):
        part = (sp * BH + bh) * G + rows
        w = tl.exp(tl.load(M_PART + part, mask=row_ok, other=NEG) - m)
        l_sum += w * tl.load(L_PART + part, mask=row_ok, other=0.0)
        o += w[:, None] * tl.load(O_PART + part[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        n_sel += tl.load(N_PART + sp * BH + bh)
        if USE_RLA:
            ot += tl.load(OT_PART + part[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    out = (bh * G + rows)[:, None] * D + d[None, :]
    o = tl.where((l_sum > 0)[:, None], o / tl.maximum(l_sum, 1e-30)[:, None], 0.0)
    tl.store(O_SP + out, o, mask=row_ok[:, None])
    if USE_RLA:
        tpos = tl.load(QPOS + bh // H)
        rla = tl.load(LIN + out, mask=row_ok[:, None], other=0.0) - ot
        rla = tl.where((tpos >= 0) & (n_sel != tpos + 1), rla, 0.0)
        tl.store(O_RLA + out, rla, mask=row_ok[:, None])


@triton.jit
def spla_bwd_dq_kernel(
    Q, K, V, PHIK, IDX, QPOS, KOFF, LSE, DELTA, DO, DOT, DQ,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_pb, stride_ph, stride_ps,
    T, H, NSEL, scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    USE_RLA: tl.constexpr, IEEE: tl.constexpr, PRE_PHIK: tl.constexpr = False,
):
    """dq of one (query token, batch x KV head) for the G heads of the group, over the token's
    selected blocks: the sparse softmax branch (p = exp(s - lse), ds = p (dO v - delta)) and the
    correction otilde = (phi(q).phi(k)) v, whose d phi(q) goes through the softmax feature map's
    Jacobian. LSE, DELTA: [B, T, HQ]; DO, DOT, DQ: [B, T, HQ, D] (fp32)."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, GP)
    row_ok = rows < G
    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    q = tl.load(Q + b * stride_qb + (h * G + rows)[:, None] * stride_qh + t * stride_qt + d[None, :],
                mask=row_ok[:, None], other=0.0)
    tpos = tl.load(QPOS + b * T + t)
    koff = tl.load(KOFF + b)
    row = (b * T + t) * (H * G) + h * G + rows
    lse = tl.load(LSE + row, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    do = tl.load(DO + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    dq = tl.zeros([GP, D], tl.float32)
    if USE_RLA:
        phiq = _softmax_rows(q)
        dot_ = tl.load(DOT + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        dphiq = tl.zeros([GP, D], tl.float32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    p_base = PHIK + b * stride_pb + h * stride_ph
    idx_base = IDX + (b * T + t) * H * NSEL + h * NSEL
    for i in range(0, NSEL):
        blk = tl.load(idx_base + i)
        pos = blk * BS + j
        kmask = (blk >= 0) & (pos <= tpos)
        slot = koff + pos
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kmask[:, None], other=0.0)
        s = _mm(q, tl.trans(k), IEEE) * scale
        p = tl.where(kmask[None, :], tl.exp(s - lse[:, None]), 0.0)
        ds = p * (_mm(do, tl.trans(v), IEEE) - delta[:, None])
        dq += _mm(ds, k, IEEE)
        if USE_RLA:
            if PRE_PHIK:
                phik = tl.load(p_base + slot[:, None] * stride_ps + d[None, :], mask=kmask[:, None], other=0.0)
            else:
                phik = _softmax_rows(k)
            da = tl.where(kmask[None, :], _mm(dot_, tl.trans(v), IEEE), 0.0)
            dphiq += _mm(da, phik.to(k.dtype), IEEE)
    dq = dq * scale
    if USE_RLA:  # softmax Jacobian: dx = phi * (dphi - <dphi, phi>)
        dq += phiq * (dphiq - tl.sum(dphiq * phiq, 1)[:, None])
    tl.store(DQ + row[:, None] * D + d[None, :], dq, mask=row_ok[:, None])


@triton.jit
def spla_bwd_dkv_kernel(
    Q, K, V, QPOS, KOFF, LSE, DELTA, DO, DOT, CSR_T, CSR_OFF, DK, DV,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    T, H, NB, S, scale,
    G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    USE_RLA: tl.constexpr, IEEE: tl.constexpr,
):
    """dk, dv of one (key block, batch x KV head): loops over the queries that selected the block
    (CSR lists built from the block indices), R // G queries x G heads per tile, through both the
    sparse branch and the correction term (d phi(k) through the feature map's Jacobian). DK, DV:
    [B, H, S, D] fp32, written at the block's slots."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    koff = tl.load(KOFF + b)
    pos = blk * BS + j
    slot = koff + pos
    kv_ok = slot < S
    k = tl.load(K + b * stride_kb + h * stride_kh + slot[:, None] * stride_ks + d[None, :],
                mask=kv_ok[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + slot[:, None] * stride_vs + d[None, :],
                mask=kv_ok[:, None], other=0.0)
    dk = tl.zeros([BS, D], tl.float32)
    dv = tl.zeros([BS, D], tl.float32)
    if USE_RLA:
        phik = _softmax_rows(k)
        phik_lp = phik.to(k.dtype)
        dphik = tl.zeros([BS, D], tl.float32)
    r = tl.arange(0, R)
    BQ: tl.constexpr = R // G
    qslot = r // G
    head = h * G + r % G
    HQ = H * G
    off0 = tl.load(CSR_OFF + bh * NB + blk)
    off1 = tl.load(CSR_OFF + bh * NB + blk + 1)
    for c in range(off0, off1, BQ):
        e = c + qslot
        ok = (qslot < BQ) & (e < off1)
        t = tl.load(CSR_T + e, mask=ok, other=0)
        tpos = tl.load(QPOS + b * T + t, mask=ok, other=-1)
        q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                    mask=ok[:, None], other=0.0)
        row = (b * T + t) * HQ + head
        lse = tl.load(LSE + row, mask=ok, other=0.0)
        delta = tl.load(DELTA + row, mask=ok, other=0.0)
        do = tl.load(DO + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(v.dtype)
        causal = (pos[:, None] <= tpos[None, :]) & ok[None, :] & kv_ok[:, None]  # [BS, R]
        p = tl.where(causal, tl.exp(_mm(k, tl.trans(q), IEEE) * scale - lse[None, :]), 0.0)
        dv += _mm(p, do, IEEE)
        ds = p * (_mm(v, tl.trans(do), IEEE) - delta[None, :])
        dk += _mm(ds, q, IEEE)
        if USE_RLA:
            phiq = _softmax_rows(q).to(k.dtype)
            dot_ = tl.load(DOT + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(v.dtype)
            a = tl.where(causal, _mm(phik_lp, tl.trans(phiq), IEEE), 0.0)
            dv += _mm(a, dot_, IEEE)
            da = tl.where(causal, _mm(v, tl.trans(dot_), IEEE), 0.0)
            dphik += _mm(da, phiq, IEEE)
    dk = dk * scale
    if USE_RLA:
        dk += phik * (dphik - tl.sum(dphik * phik, 1)[:, None])
    out = (bh * S + slot)[:, None] * D + d[None, :]
    tl.store(DK + out, dk, mask=kv_ok[:, None])
    tl.store(DV + out, dv, mask=kv_ok[:, None])


def spla_decode_triton(q, k, v, q_pos, stats, sbar, koff, *, block_size, top_k_blocks, num_sink_blocks,
                       num_local_blocks, selection="taylor", use_rla=True):
    """One token per row (q [B, HQ, 1, D]) in four launches: block scores, group top-k, the split
    decode kernel (selected tiles in parallel with the Sbar read-out and update), and the merge."""
    B, HQ, _, D = q.shape
    H = stats.sum_k.shape[1]
    G = HQ // H
    GP = max(16, triton.next_power_of_2(G))
    dev = q.device
    qpos = q_pos.to(torch.int32).contiguous()
    idx = select_indices(q, stats, qpos, block_size=block_size, top_k_blocks=top_k_blocks,
                         num_sink_blocks=num_sink_blocks, num_local_blocks=num_local_blocks, selection=selection)
    nsel = idx.shape[-1]
    per = min(nsel, DECODE_BLOCKS_PER_SPLIT)
    nsplit = -(-nsel // per)
    m_part = _new((nsplit, B * H * G), dev)
    l_part = _new((nsplit, B * H * G), dev)
    o_part = _new((nsplit, B * H * G, D), dev)
    ot_part = _new((nsplit, B * H * G, D), dev) if use_rla else o_part
    n_part = _new((nsplit, B * H), dev, torch.int32)
    lin = _new((B, HQ, 1, D), dev) if use_rla else o_part
    sbar_new = _new(tuple(sbar.shape), dev) if use_rla else sbar
    spla_decode_kernel[(B * H, nsplit + int(use_rla))](
        q, k, v, idx, qpos, koff, sbar.float().contiguous(), m_part, l_part, o_part, ot_part, n_part, lin, sbar_new,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        H, nsel, per, nsplit, 1.0 / math.sqrt(D),
        G=G, GP=GP, D=D, BS=block_size, DC=min(32, D), USE_RLA=use_rla, IEEE=q.dtype == torch.float32,
        num_warps=DECODE_WARPS, num_stages=2,
    )
    o_sp = _new((B, HQ, 1, D), dev)
    o_rla = _new((B, HQ, 1, D), dev) if use_rla else o_sp
    spla_decode_merge_kernel[(B * H,)](
        qpos, m_part, l_part, o_part, ot_part, n_part, lin, o_sp, o_rla, H, nsplit,
        G=G, GP=GP, D=D, USE_RLA=use_rla, num_warps=4,
    )
    if not use_rla:
        valid = (q_pos >= 0)[:, None, :, None]
        kv_t = torch.einsum("bhsd,bhse->bhde", feature_map(k[:, :, -1:]) * valid, v[:, :, -1:].float())
        return o_sp.to(q.dtype), None, sbar + kv_t
    return o_sp.to(q.dtype), o_rla.to(q.dtype), sbar_new


#: Tests set this to fill every kernel output with NaN before the launch (poisoned outputs).
POISON_OUTPUTS = False


def _new(shape, device, dtype=torch.float32):
    if POISON_OUTPUTS:
        return torch.full(shape, -1 if dtype == torch.int32 else float("nan"), device=device, dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype)



def select_indices(q, stats, q_pos, *, block_size, top_k_blocks, num_sink_blocks, num_local_blocks,
                   selection="taylor", max_scores: int = 1 << 27) -> torch.Tensor:
    """The selected blocks of every query as int32 indices [B, Tq, H, local + sink + top_k] (-1 = none),
    over chunks of queries whose raw scores [B, chunk, HQ, NB] stay under `max_scores` floats, with no
    host synchronisation: block scores (the scoring kernel for a few queries; for more, fp32 matmuls,
    which reuse the statistics across queries), then the group top-k kernel. The same selection as
    `reference.select_blocks` (up to ties and fp32 rounding of the scores)."""
    B, HQ, Tq, D = q.shape
    H, NB = stats.sum_k.shape[1], stats.num_blocks
    G = HQ // H
    GP = max(16, triton.next_power_of_2(G))
    dev = q.device
    nsel = num_local_blocks + num_sink_blocks + top_k_blocks
    taylor = selection == "taylor"
    sum_k, sum_k2, count = (x.float() for x in (stats.sum_k, stats.sum_k2, stats.count))
    if Tq > SCORE_KERNEL_MAX_TQ:  # per-block mean and variance once, then matmuls
        cnt = count.clamp(min=1.0)[:, None, :, None]
        mu = sum_k / cnt
        s2 = (sum_k2 / cnt - mu * mu).clamp(min=0.0) if taylor else None
    elif not (sum_k.stride() == sum_k2.stride() and sum_k.stride()[2:] == (D, 1) and count.stride(1) == 1):
        sum_k, sum_k2, count = sum_k.contiguous(), sum_k2.contiguous(), count.contiguous()
    qpos = q_pos.to(torch.int32).contiguous()  # no copy when the caller passes int32 positions
    chunk = max(1, min(Tq, max_scores // max(1, B * HQ * NB)))
    out = _new((B, Tq, H, nsel), dev, torch.int32) if chunk < Tq else None
    for c0 in range(0, Tq, chunk):
        C = min(Tq, c0 + chunk) - c0
        qc, pc = q[:, :, c0:c0 + C], qpos[:, c0:c0 + C].contiguous()
        if Tq > SCORE_KERNEL_MAX_TQ:
            qs = qc.float().reshape(B, H, G, C, D) / math.sqrt(D)
            sc = torch.matmul(qs, mu.transpose(-1, -2)[:, :, None])  # [B, H, G, C, NB]
            if taylor:
                sc += torch.log1p(0.5 * torch.matmul(qs * qs, s2.transpose(-1, -2)[:, :, None]))
            strides = (sc.stride(0), sc.stride(3), sc.stride(1), sc.stride(2))
        else:
            sc = _new((B, C, H, G, NB), dev)
            spla_score_kernel[(C, B * H, triton.cdiv(NB, SCORE_BN))](
                qc, sum_k, sum_k2, count, pc, sc, qc.stride(0), qc.stride(1), qc.stride(2),
                sum_k.stride(0), sum_k.stride(1), count.stride(0),
                C, H, NB, block_size, num_sink_blocks, num_local_blocks, 1.0 / math.sqrt(D),
                G=G, GP=GP, D=D, BN=SCORE_BN, TAYLOR=taylor, PREC=SCORE_PREC, USE_DOT=SCORE_DOT,
                num_warps=SCORE_WARPS,
            )
            strides = (sc.stride(0), sc.stride(1), sc.stride(2), sc.stride(3))
        idx = _new((B, C, H, nsel), dev, torch.int32)
        spla_topk_kernel[(C, B * H)](
            sc, pc, _new((B, C, H, NB), dev), idx, *strides, C, H, NB, block_size, num_sink_blocks,
            num_local_blocks, top_k_blocks, nsel, G=G, GP=GP, BN=128, NBP=max(16, triton.next_power_of_2(NB)),
            num_warps=4 if NB <= 4096 else 8,
        )
        if out is None:
            return idx
        out[:, c0:c0 + C] = idx
    return out


def causal_linear_term(phiq, phik, v, sbar, valid, chunk: int = 64):
    """phi(q_t)^T (Sbar + sum_{new j <= t} phi(k_j) v_j^T) for the new tokens, chunked; returns (o, new Sbar).
    phiq: [B, H, G, T, D], phik, v: [B, H, T, D] (fp32), valid: [B, T]."""
    B, H, G, T, D = phiq.shape
    phik = phik * valid[:, None, :, None]
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:
        phiq = torch.nn.functional.pad(phiq, (0, 0, 0, pad))
        phik = torch.nn.functional.pad(phik, (0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    qc = phiq.view(B, H, G, n, chunk, D)
    kc = phik.view(B, H, n, chunk, D)
    vc = v.view(B, H, n, chunk, D)
    kv = torch.einsum("bhncd,bhnce->bhnde", kc, vc)  # per-chunk sums
    states = torch.cumsum(kv, dim=2) - kv + sbar[:, :, None]  # state before each chunk
    inter = torch.einsum("bhgncd,bhnde->bhgnce", qc, states)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    a = torch.einsum("bhgncd,bhnsd->bhgncs", qc, kc) * causal
    intra = torch.einsum("bhgncs,bhnse->bhgnce", a, vc)
    o = (inter + intra).reshape(B, H, G, n * chunk, D)[..., :T, :]
    return o, sbar + kv.sum(2)


def key_features(k: torch.Tensor) -> torch.Tensor:
    """phi(k) = softmax over the head dimension, once per key, in k's dtype [B, H, S, D]."""
    return torch.softmax(k.float(), dim=-1).to(k.dtype)


def sparse_forward(q, k, v, idx, qpos, koff, use_rla, block_size, num_splits=1, phik=None):
    """The sparse kernel over the selected blocks idx [B, Tq, H, K] (split-K over `num_splits`
    programs, merged here); `phik` (`key_features(k)`, optional) spares the kernel the feature map
    of every loaded tile. Returns o_sp (normalised), otilde (or None) [B, Tq, HQ, D] fp32 and the
    log-sum-exp [B, Tq, HQ] of the sparse softmax."""
    B, HQ, Tq, D = q.shape
    H = k.shape[1]
    G = HQ // H
    K_sel = idx.shape[-1]
    per = -(-K_sel // num_splits)
    num_splits = -(-K_sel // per)
    dev = q.device
    o_part = _new((num_splits, B, Tq, HQ, D), dev)
    ot_part = _new((num_splits, B, Tq, HQ, D), dev) if use_rla else o_part
    m_part = _new((num_splits, B, Tq, HQ), dev)
    l_part = _new((num_splits, B, Tq, HQ), dev)
    pk = k if phik is None else phik
    spla_sparse_kernel[(Tq, B * H, num_splits)](
        q, k, v, pk, idx, qpos, koff, o_part, ot_part, m_part, l_part,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        pk.stride(0), pk.stride(1), pk.stride(2),
        Tq, H, K_sel, per, 1.0 / math.sqrt(D),
        G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BS=block_size, USE_RLA=use_rla,
        IEEE=q.dtype == torch.float32, PRE_PHIK=phik is not None, num_warps=4, num_stages=2,
    )
    if num_splits == 1:
        m, l_sum, o = m_part[0], l_part[0], o_part[0]
    else:
        m = m_part.max(0).values
        w = torch.exp(m_part - m[None])  # [nsp, B, Tq, HQ]
        l_sum = (w * l_part).sum(0)
        o = (w[..., None] * o_part).sum(0)
    o_sp = o / l_sum.clamp(min=1e-30)[..., None]
    lse = torch.where(l_sum > 0, m + torch.log(l_sum.clamp(min=1e-30)), 0.0)
    otilde = (ot_part[0] if num_splits == 1 else ot_part.sum(0)) if use_rla else None
    return o_sp, otilde, lse


def queries_by_block(idx: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Invert the selection idx [B, Tq, H, K] (-1 = none) into CSR lists: for each (batch x KV head,
    block) the query tokens that selected it. Returns (tokens int32 [n], offsets int32 [B*H*NB + 1])."""
    B, Tq, H, _ = idx.shape
    dev = idx.device
    bh = (torch.arange(B, device=dev)[:, None] * H + torch.arange(H, device=dev)[None, :])[:, None, :, None]
    t = torch.arange(Tq, device=dev, dtype=torch.int32)[None, :, None, None].expand_as(idx)
    valid = idx >= 0
    key = (bh * num_blocks + idx.long())[valid]
    key, order = key.sort(stable=True)
    counts = torch.bincount(key, minlength=B * H * num_blocks)
    offsets = torch.zeros(B * H * num_blocks + 1, dtype=torch.int32, device=dev)
    offsets[1:] = counts.cumsum(0)
    return t[valid][order].contiguous(), offsets


class SparseAttention(torch.autograd.Function):
    """The sparse branch and the correction otilde with Triton kernels for the backward pass too:
    dq per query token over its selected blocks, dk/dv per key block over the queries that selected
    it. The selection itself (idx) carries no gradient, as in the reference."""

    @staticmethod
    def forward(ctx, q, k, v, idx, qpos, koff, use_rla, block_size, precompute_phik=False):
        phik = key_features(k) if use_rla and precompute_phik else None
        o, ot, lse = sparse_forward(q, k, v, idx, qpos, koff, use_rla, block_size, phik=phik)
        ctx.save_for_backward(q, k, v, idx, qpos, koff, o, lse, phik)
        ctx.use_rla, ctx.block_size = use_rla, block_size
        return o, ot

    @staticmethod
    def backward(ctx, do, dot_):
        q, k, v, idx, qpos, koff, o, lse, phik = ctx.saved_tensors
        use_rla, bs = ctx.use_rla, ctx.block_size
        B, HQ, Tq, D = q.shape
        H, S = k.shape[1], k.shape[2]
        G = HQ // H
        dev = q.device
        do = torch.zeros_like(o) if do is None else do.float().contiguous()
        delta = (do * o).sum(-1).contiguous()  # [B, Tq, HQ]
        if use_rla:
            dot_ = torch.zeros_like(o) if dot_ is None else dot_.float().contiguous()
        else:
            dot_ = do
        ieee = q.dtype == torch.float32
        scale = 1.0 / math.sqrt(D)
        strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2))
        dq = _new((B, Tq, HQ, D), dev)
        pk = k if phik is None else phik
        spla_bwd_dq_kernel[(Tq, B * H)](
            q, k, v, pk, idx, qpos, koff, lse, delta, do, dot_, dq, *strides, pk.stride(0), pk.stride(1),
            pk.stride(2), Tq, H, idx.shape[-1], scale, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BS=bs,
            USE_RLA=use_rla, IEEE=ieee, PRE_PHIK=phik is not None, num_warps=4, num_stages=2,
        )
        NB = triton.cdiv(S, bs)
        csr_t, csr_off = queries_by_block(idx, NB)
        # padding slots belong to no block: their gradient is 0
        dk = torch.zeros(B, H, S, D, device=dev, dtype=torch.float32)
        dv = torch.zeros_like(dk)
        R = max(16, triton.next_power_of_2(G), 64 if D <= 64 else 32)
        spla_bwd_dkv_kernel[(NB, B * H)](
            q, k, v, qpos, koff, lse, delta, do, dot_, csr_t, csr_off, dk, dv, *strides,
            Tq, H, NB, S, scale, G=G, R=R, D=D, BS=bs, USE_RLA=use_rla, IEEE=ieee,
            num_warps=4 if D <= 64 else 8, num_stages=1,
        )
        return dq.transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def spla_attention_triton(
    q, k, v, q_pos, k_pos, stats: BlockStats, sbar, *, block_size, top_k_blocks, num_sink_blocks,
    num_local_blocks, selection="taylor", use_rla=True, query_chunk=None, num_splits=None, k_offsets=None,
):
    """Same contract as `spla_attention_reference` (q [B, HQ, Tq, D], k, v [B, H, S, D] with the new
    tokens last); returns (o_sp, o_rla or None, new Sbar). `k_offsets` [B]: slot of each row's position
    0 (`slot_offsets(k_pos)`, computed here when not given); rows whose real tokens do not sit in
    consecutive slots (padding in the middle) take the reference path."""
    from .reference import spla_attention_reference

    B, HQ, Tq, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = HQ // H
    koff = slot_offsets(k_pos) if k_offsets is None else k_offsets
    if koff is None or D not in (16, 32, 64, 128, 256) or block_size < 16:
        return spla_attention_reference(
            q, k, v, q_pos, k_pos, stats, sbar, block_size=block_size, top_k_blocks=top_k_blocks,
            num_sink_blocks=num_sink_blocks, num_local_blocks=num_local_blocks, selection=selection,
            use_rla=use_rla, query_chunk=query_chunk,
        )
    kw = dict(block_size=block_size, top_k_blocks=top_k_blocks, num_sink_blocks=num_sink_blocks,
              num_local_blocks=num_local_blocks, selection=selection)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if Tq == 1 and q.dtype != torch.float64 and num_splits is None and not needs_grad:  # decode: 4 launches
        return spla_decode_triton(q, k, v, q_pos, stats, sbar, koff, use_rla=use_rla, **kw)
    qpos = q_pos.to(torch.int32).contiguous()
    idx = select_indices(q, stats, qpos, **kw)  # [B, Tq, H, K]
    # kernel operands: unit stride in the head dimension; fp64 inputs (tests) run the kernels in fp32
    kq, kk, kv = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if q.dtype == torch.float64:
        kq, kk, kv = kq.float(), kk.float(), kv.float()
    pre = use_rla and Tq >= PHIK_PRECOMPUTE_MIN_TQ
    if needs_grad:
        o_sp, otilde = SparseAttention.apply(kq, kk, kv, idx, qpos, koff, use_rla, block_size, pre)
    else:
        if num_splits is None:
            num_splits = max(1, min(idx.shape[-1], 264 // max(1, B * H * Tq))) if Tq <= 8 else 1
        o_sp, otilde, _ = sparse_forward(kq, kk, kv, idx, qpos, koff, use_rla, block_size, num_splits,
                                         phik=key_features(kk) if pre else None)
    q_ok = (q_pos >= 0)[:, :, None, None]
    o_sp = (o_sp * q_ok).transpose(1, 2)  # [B, HQ, Tq, D]
    out_dtype = torch.float64 if sbar.dtype == torch.float64 else q.dtype
    acc = acc_dtype(sbar)
    if not use_rla:
        kv_new = torch.einsum("bhsd,bhse->bhde", feature_map(k[:, :, S - Tq:]).to(acc) *
                              (q_pos >= 0)[:, None, :, None], v[:, :, S - Tq:].to(acc))
        return o_sp.to(out_dtype), None, sbar + kv_new
    phiq = feature_map(q).to(acc).view(B, H, G, Tq, D)
    o_lin, sbar_new = causal_linear_term(
        phiq, feature_map(k[:, :, S - Tq:]).to(acc), v[:, :, S - Tq:].to(acc), sbar.to(acc), q_pos >= 0,
        chunk=min(64, Tq),
    )
    o_rla = o_lin.reshape(B, HQ, Tq, D) - otilde.transpose(1, 2).to(acc)
    # every causal key selected -> the residual term is exactly zero (not a cancellation)
    start = idx.long() * block_size  # [B, Tq, H, K]
    tp = q_pos[:, :, None, None].long()
    n_sel = torch.where(idx >= 0, (tp - start + 1).clamp(0, block_size), 0).sum(-1)  # [B, Tq, H]
    all_sel = (n_sel == (q_pos[:, :, None] + 1)).permute(0, 2, 1)  # [B, H, Tq]
    o_rla = o_rla.view(B, H, G, Tq, D).masked_fill(all_sel[:, :, None, :, None], 0.0).view(B, HQ, Tq, D)
    o_rla = o_rla * q_ok.transpose(1, 2)
    return o_sp.to(out_dtype), o_rla.to(out_dtype), sbar_new
