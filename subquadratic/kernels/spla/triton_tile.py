"""Query-tile SPLA kernels for prefill and training (docs/design.md "Kernels").

One program per (query tile of BM consecutive tokens, batch x KV head). The rows of a tile are
(token, query head of the group): BM x GP rows, so tl.dot sees BM * GP rows instead of one token's
G heads padded to 16. The program loops over the UNION of the blocks its tokens selected, loading
each K/V tile once per query tile, and keeps each token's own selection exact with a per-row mask:
row (t, g) uses key j of block b only if b is in t's selected list and j <= t. On the same tiles it
accumulates the online softmax of the sparse branch and the correction
otilde = sum_{selected j} (phi(q).phi(k_j)) v_j of the residual term.

The union is built on the device, with no host synchronisation and no data-dependent shape
(`tile_union_kernel`): per tile, the ascending list of the blocks selected by any of its tokens
(at most min(NB, BM * K) entries, the count stored beside it) and, per entry, a BM-bit word saying
which of the tile's tokens selected it.

Backward (`TileSparseAttention`): dq per query tile over the same union (`tile_bwd_dq_kernel`);
dk/dv per (key block, batch x KV head) over the query tiles whose union holds the block
(`tile_bwd_dkv_kernel`), from the union lists inverted by one device sort, so no atomics.

Same contract and values as `triton_parallel.sparse_forward` / `triton_parallel.SparseAttention`, the
per-token kernels; which of the two a call runs, and with how many rows per tile, is the plan's
(`SPLAPlan.form`, `tile_rows`). `select_indices_fast` is the one-launch selection of a query tile,
same contract as `triton_select.select_indices`.
"""

from __future__ import annotations

import math

import torch

from ..triton_launch import jit
from ..triton_utils import cdiv, next_power_of_2
from ..utils import import_triton, new_output
from .plan import SPLAParams
from .triton_common import NEG, key_features, mm, softmax_rows

triton, tl = import_triton()

#: Tokens of one query tile at most: the per-entry token masks are int32 words.
TILE_MAX_TOKENS = 32


@jit
def tile_union_kernel(
    IDX, SCR, UNION, BITS, CNT, T, H, NSEL, NU, NB,
    BM: tl.constexpr, KP: tl.constexpr, NBP: tl.constexpr,
):
    """Union of the blocks selected by the BM tokens of one query tile (IDX [B, T, H, NSEL], -1 =
    none): ascending block ids into UNION [B*H, ntiles, NU], the tokens that chose each one as a
    BM-bit word into BITS (same shape), and their number into CNT [B*H, ntiles]. The words are
    gathered in the program's own row of the scratch SCR [B*H, ntiles, NB] (zeroed here, then
    or-ed into), so the work is O(NB + BM * NSEL) per tile."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    ntiles = tl.num_programs(0)
    b = bh // H
    h = bh % H
    m = tl.arange(0, BM)
    kk = tl.arange(0, KP)
    t = tile * BM + m
    ok = (t < T)[:, None] & (kk < NSEL)[None, :]
    sel = tl.load(IDX + ((b * T + t) * H + h)[:, None] * NSEL + kk[None, :], mask=ok, other=-1)  # [BM, KP]
    nn = tl.arange(0, NBP)
    scr = SCR + (bh * ntiles + tile) * NB
    tl.store(scr + nn, tl.zeros([NBP], tl.int32), mask=nn < NB)
    tl.debug_barrier()
    bit = tl.broadcast_to((tl.full([BM, 1], 1, tl.int32) << m[:, None]), [BM, KP])
    tl.atomic_or(scr + tl.maximum(sel, 0), bit, mask=sel >= 0)
    tl.debug_barrier()
    word = tl.load(scr + nn, mask=nn < NB, other=0, cache_modifier=".cg")
    mark = (word != 0).to(tl.int32)
    dst = tl.cumsum(mark, 0) - 1
    base = (bh * ntiles + tile) * NU
    keep = mark > 0
    tl.store(UNION + base + dst, nn, mask=keep)
    tl.store(BITS + base + dst, word, mask=keep)
    tl.store(CNT + bh * ntiles + tile, tl.sum(mark, 0))


@jit
def tile_fwd_kernel(
    Q, K, V, PHIK, UNION, BITS, CNT, QPOS, KOFF, OUT, OT, LSE,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_pb, stride_ph, stride_ps,
    T, H, NU, scale,
    G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    USE_RLA: tl.constexpr, IEEE: tl.constexpr, PRE_PHIK: tl.constexpr,
):
    """Sparse softmax and the correction otilde of one query tile over the union of its blocks.
    OUT (normalised), OT: [B, T, HQ, D] fp32; LSE: [B, T, HQ]."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    ntiles = tl.num_programs(0)
    b = bh // H
    h = bh % H
    ROWS: tl.constexpr = BM * GP
    r = tl.arange(0, ROWS)
    m = r // GP
    g = r % GP
    t = tile * BM + m
    row_ok = (t < T) & (g < G)
    head = h * G + g
    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                mask=row_ok[:, None], other=0.0)
    tpos = tl.load(QPOS + b * T + t, mask=row_ok, other=-1)
    tmax = tl.max(tpos, 0)
    koff = tl.load(KOFF + b)
    m_i = tl.full([ROWS], NEG, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    ot = tl.zeros([ROWS, D], tl.float32)
    if USE_RLA:
        phiq = softmax_rows(q)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    p_base = PHIK + b * stride_pb + h * stride_ph
    ubase = (bh * ntiles + tile) * NU
    cnt = tl.load(CNT + bh * ntiles + tile)
    for u in range(0, cnt):
        blk = tl.load(UNION + ubase + u)
        bits = tl.load(BITS + ubase + u)
        rsel = ((bits >> m) & 1) != 0
        pos = blk * BS + j
        kload = pos <= tmax
        mask = rsel[:, None] & (pos[None, :] <= tpos[:, None])
        slot = koff + pos
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kload[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kload[:, None], other=0.0)
        s = mm(q, tl.trans(k), IEEE) * scale
        s = tl.where(mask, s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(mask, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mm(p, v, IEEE)
        m_i = m_new
        if USE_RLA:
            if PRE_PHIK:
                phik = tl.load(p_base + slot[:, None] * stride_ps + d[None, :], mask=kload[:, None], other=0.0)
            else:
                phik = softmax_rows(k)
            a = tl.where(mask, mm(phiq, tl.trans(phik.to(k.dtype)), IEEE), 0.0)
            ot += mm(a, v, IEEE)
    HQ = H * G
    out_row = (b * T + t) * HQ + head
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), 0.0)
    tl.store(LSE + out_row, lse, mask=row_ok)
    tl.store(OUT + out_row[:, None] * D + d[None, :], o, mask=row_ok[:, None])
    if USE_RLA:
        tl.store(OT + out_row[:, None] * D + d[None, :], ot, mask=row_ok[:, None])


@jit
def tile_bwd_dq_kernel(
    Q, K, V, PHIK, UNION, BITS, CNT, QPOS, KOFF, LSE, DELTA, DO, DOT, DQ,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_pb, stride_ph, stride_ps,
    T, H, NU, scale,
    G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    USE_RLA: tl.constexpr, IEEE: tl.constexpr, PRE_PHIK: tl.constexpr,
):
    """dq of one query tile over the union of its blocks, through the sparse softmax
    (ds = p (dO v - delta)) and the correction (d phi(q) through the feature map's Jacobian).
    LSE, DELTA: [B, T, HQ]; DO, DOT, DQ: [B, T, HQ, D] fp32."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    ntiles = tl.num_programs(0)
    b = bh // H
    h = bh % H
    ROWS: tl.constexpr = BM * GP
    r = tl.arange(0, ROWS)
    m = r // GP
    g = r % GP
    t = tile * BM + m
    row_ok = (t < T) & (g < G)
    head = h * G + g
    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                mask=row_ok[:, None], other=0.0)
    tpos = tl.load(QPOS + b * T + t, mask=row_ok, other=-1)
    tmax = tl.max(tpos, 0)
    koff = tl.load(KOFF + b)
    HQ = H * G
    row = (b * T + t) * HQ + head
    lse = tl.load(LSE + row, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    do = tl.load(DO + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0).to(q.dtype)
    dq = tl.zeros([ROWS, D], tl.float32)
    if USE_RLA:
        phiq = softmax_rows(q)
        dot_ = tl.load(DOT + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0).to(q.dtype)
        dphiq = tl.zeros([ROWS, D], tl.float32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    p_base = PHIK + b * stride_pb + h * stride_ph
    ubase = (bh * ntiles + tile) * NU
    cnt = tl.load(CNT + bh * ntiles + tile)
    for u in range(0, cnt):
        blk = tl.load(UNION + ubase + u)
        bits = tl.load(BITS + ubase + u)
        rsel = ((bits >> m) & 1) != 0
        pos = blk * BS + j
        kload = pos <= tmax
        mask = rsel[:, None] & (pos[None, :] <= tpos[:, None])
        slot = koff + pos
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kload[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kload[:, None], other=0.0)
        s = mm(q, tl.trans(k), IEEE) * scale
        p = tl.where(mask, tl.exp(s - lse[:, None]), 0.0)
        ds = p * (mm(do, tl.trans(v), IEEE) - delta[:, None])
        dq += mm(ds, k, IEEE)
        if USE_RLA:
            if PRE_PHIK:
                phik = tl.load(p_base + slot[:, None] * stride_ps + d[None, :], mask=kload[:, None], other=0.0)
            else:
                phik = softmax_rows(k)
            da = tl.where(mask, mm(dot_, tl.trans(v), IEEE), 0.0)
            dphiq += mm(da, phik.to(k.dtype), IEEE)
    dq = dq * scale
    if USE_RLA:
        dq += phiq * (dphiq - tl.sum(dphiq * phiq, 1)[:, None])
    tl.store(DQ + row[:, None] * D + d[None, :], dq, mask=row_ok[:, None])


@jit
def tile_bwd_dkv_kernel(
    Q, K, V, PHIQ, QPOS, KOFF, LSE, DELTA, DO, DOT, E_TILE, E_BITS, E_OFF, DK, DV,
    stride_qb, stride_qh, stride_qt,
    stride_fb, stride_fh, stride_ft,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    T, H, NB, S, scale,
    G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    USE_RLA: tl.constexpr, IEEE: tl.constexpr,
):
    """dk, dv of one (key block, batch x KV head) over the query tiles whose union holds the block
    (entries E_TILE / E_BITS of CSR row bh * NB + blk), through both branches; PHIQ = phi(q), computed
    once per query (layout of Q, own strides) rather than once per (block, tile). DK, DV: [B, H, S, D]
    fp32 at the block's slots."""
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
        phik = softmax_rows(k)
        phik_lp = phik.to(k.dtype)
        dphik = tl.zeros([BS, D], tl.float32)
    ROWS: tl.constexpr = BM * GP
    r = tl.arange(0, ROWS)
    m = r // GP
    g = r % GP
    head = h * G + g
    HQ = H * G
    off0 = tl.load(E_OFF + bh * NB + blk)
    off1 = tl.load(E_OFF + bh * NB + blk + 1)
    for e in range(off0, off1):
        tile = tl.load(E_TILE + e)
        bits = tl.load(E_BITS + e)
        t = tile * BM + m
        ok = (t < T) & (g < G) & (((bits >> m) & 1) != 0)
        tpos = tl.load(QPOS + b * T + t, mask=ok, other=-1)
        q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                    mask=ok[:, None], other=0.0)
        row = (b * T + t) * HQ + head
        lse = tl.load(LSE + row, mask=ok, other=0.0)
        delta = tl.load(DELTA + row, mask=ok, other=0.0)
        do = tl.load(DO + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(v.dtype)
        causal = (pos[:, None] <= tpos[None, :]) & ok[None, :] & kv_ok[:, None]  # [BS, ROWS]
        p = tl.where(causal, tl.exp(mm(k, tl.trans(q), IEEE) * scale - lse[None, :]), 0.0)
        dv += mm(p, do, IEEE)
        ds = p * (mm(v, tl.trans(do), IEEE) - delta[None, :])
        dk += mm(ds, q, IEEE)
        if USE_RLA:
            phiq = tl.load(PHIQ + b * stride_fb + head[:, None] * stride_fh + t[:, None] * stride_ft + d[None, :],
                           mask=ok[:, None], other=0.0).to(k.dtype)
            dot_ = tl.load(DOT + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(v.dtype)
            a = tl.where(causal, mm(phik_lp, tl.trans(phiq), IEEE), 0.0)
            dv += mm(a, dot_, IEEE)
            da = tl.where(causal, mm(v, tl.trans(dot_), IEEE), 0.0)
            dphik += mm(da, phiq, IEEE)
    dk = dk * scale
    if USE_RLA:
        dk += phik * (dphik - tl.sum(dphik * phik, 1)[:, None])
    out = (bh * S + slot)[:, None] * D + d[None, :]
    tl.store(DK + out, dk, mask=kv_ok[:, None])
    tl.store(DV + out, dv, mask=kv_ok[:, None])


@jit
def tile_select_kernel(
    Q, MU, S2, QPOS, GS, IDX,
    stride_qb, stride_qh, stride_qt, stride_ib, stride_it,
    T, H, NB, block_size, n_sink, n_local, top_k, NSEL, scale,
    G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
    NBP: tl.constexpr, TB: tl.constexpr, TAYLOR: tl.constexpr, PREC: tl.constexpr,
):
    """Selection of one query tile (BM tokens x the GP heads of a KV group) in one program: block
    scores qs.mu + log(1 + qs^2.s2 / 2) on the tensor cores from the block means MU and variances
    S2 [B, H, NB, D] (fp32), the softmax over the candidate blocks per query head (two passes over
    the blocks, the second recomputing the scores), the group sum per token into the scratch GS
    [B*H, T, NB], then per token the forced blocks (local, then sinks) and the best
    `top_k - forced` candidates into IDX [B, T, H, NSEL] (-1 = none), as `spla_topk_kernel`."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    ROWS: tl.constexpr = BM * GP
    r = tl.arange(0, ROWS)
    mrow = r // GP
    g = r % GP
    t = tile * BM + mrow
    row_ok = (t < T) & (g < G)
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32) * scale
    q2 = q * q
    tpos = tl.load(QPOS + b * T + t, mask=row_ok, other=-1)
    cur = tl.where(tpos >= 0, tpos // block_size, -1)
    cmax = tl.max(cur, 0)
    stat = MU + bh * NB * D
    stat2 = S2 + bh * NB * D
    m_i = tl.full([ROWS], NEG, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    for n0 in range(0, cmax, BN):  # per-head softmax statistics over the candidates (n < cur)
        n = n0 + tl.arange(0, BN)
        nok = n < NB
        mu = tl.load(stat + n[:, None] * D + d[None, :], mask=nok[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(mu), input_precision=PREC)
        if TAYLOR:
            s2 = tl.load(stat2 + n[:, None] * D + d[None, :], mask=nok[:, None], other=0.0)
            sc += tl.log(1.0 + 0.5 * tl.dot(q2, tl.trans(s2), input_precision=PREC))
        cand = (n[None, :] < cur[:, None]) & (n[None, :] >= n_sink) & (n[None, :] <= cur[:, None] - n_local)
        sc = tl.where(cand, sc, NEG)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.where(cand, tl.exp(sc - m_new[:, None]), 0.0), 1)
        m_i = m_new
    inv_l = tl.where(row_ok & (l_i > 0), 1.0 / tl.maximum(l_i, 1e-30), 0.0)
    mt = tl.arange(0, BM)
    tt = tile * BM + mt
    ttok = tt < T
    tposm = tl.load(QPOS + b * T + tt, mask=ttok, other=-1)
    curm = tl.where(tposm >= 0, tposm // block_size, -1)
    gs_base = GS + bh * T * NB
    for n0 in range(0, cmax, BN):  # group score of each candidate, -1 elsewhere
        n = n0 + tl.arange(0, BN)
        nok = n < NB
        mu = tl.load(stat + n[:, None] * D + d[None, :], mask=nok[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(mu), input_precision=PREC)
        if TAYLOR:
            s2 = tl.load(stat2 + n[:, None] * D + d[None, :], mask=nok[:, None], other=0.0)
            sc += tl.log(1.0 + 0.5 * tl.dot(q2, tl.trans(s2), input_precision=PREC))
        cand = (n[None, :] < cur[:, None]) & (n[None, :] >= n_sink) & (n[None, :] <= cur[:, None] - n_local)
        p = tl.where(cand, tl.exp(sc - m_i[:, None]), 0.0) * inv_l[:, None]
        gsum = tl.sum(tl.reshape(p, [BM, GP, BN]), 1)  # [BM, BN]
        candm = (n[None, :] < curm[:, None]) & (n[None, :] >= n_sink) & (n[None, :] <= curm[:, None] - n_local)
        tl.store(gs_base + tt[:, None] * NB + n[None, :], tl.where(candm, gsum, -1.0),
                 mask=ttok[:, None] & (n[None, :] < cmax))
    tl.debug_barrier()  # the group scores written above are read back by other threads
    nn = tl.arange(0, NBP)
    for m0 in tl.static_range(0, BM, TB):
        ts = tile * BM + m0 + tl.arange(0, TB)
        tok = ts < T
        tp = tl.load(QPOS + b * T + ts, mask=tok, other=-1)
        cu = tl.where(tp >= 0, tp // block_size, -1)
        out = IDX + b * stride_ib + ts * stride_it + h * NSEL
        n_forced = tl.zeros([TB], tl.int32)
        for i in range(0, n_local):  # the current block and the ones before it
            blk = cu - i
            tl.store(out + i, tl.where(blk >= 0, blk, -1), mask=tok)
            n_forced += tl.where(blk >= 0, 1, 0)
        for i in range(0, n_sink):  # sinks not already local
            sok = i <= cu - n_local
            tl.store(out + n_local + i, tl.where(sok, i, -1), mask=tok)
            n_forced += tl.where(sok, 1, 0)
        free = top_k - n_forced
        gsc = tl.load(gs_base + ts[:, None] * NB + nn[None, :],
                      mask=tok[:, None] & (nn[None, :] < NB) & (nn[None, :] < cmax), other=-1.0,
                      cache_modifier=".cg")  # [TB, NBP]
        for rr in range(0, top_k):  # iterative arg-max
            best_v = tl.max(gsc, 1)
            best_i = tl.argmax(gsc, 1)
            ok = (best_v >= 0) & (rr < free)
            tl.store(out + n_local + n_sink + rr, tl.where(ok, best_i, -1), mask=tok)
            gsc = tl.where(nn[None, :] == best_i[:, None], -2.0, gsc)


def select_indices_fast(q, stats, q_pos, params: SPLAParams, *, prec: str = "ieee",
                        max_scores: int = 1 << 27) -> torch.Tensor:
    """Same contract as `triton_select.select_indices` (q [B, Tq, HQ, D], stats with NB blocks, q_pos
    [B, Tq]): int32 indices [B, Tq, H, local + sink + top_k] (-1 = none), one launch per chunk of
    queries (chunks keep the scratch of group scores [B*H, chunk, NB] under `max_scores` floats),
    no host synchronisation. Scores at `prec` ("ieee", or "tf32x3": the plan's choice on CUDA)."""
    q = q.transpose(1, 2)  # view [B, HQ, Tq, D]
    B, HQ, Tq, D = q.shape
    H, NB = stats.sum_k.shape[1], stats.num_blocks
    G = HQ // H
    GP = next_power_of_2(G)
    BM = max(1, min(TILE_MAX_TOKENS, 64 // GP))
    while BM * GP < 16:
        BM *= 2
    dev = q.device
    nsel = params.num_selected
    cnt = stats.count.float().clamp(min=1.0)[:, None, :, None]
    mu = (stats.sum_k.float() / cnt).contiguous()
    s2 = (stats.sum_k2.float() / cnt - mu * mu).clamp(min=0.0).contiguous() if params.selection == "taylor" else mu
    qpos = q_pos.to(torch.int32).contiguous()
    out = new_output((B, Tq, H, nsel), dev, torch.int32)
    chunk = max(BM, min(Tq, max_scores // max(1, B * H * max(1, NB))) // BM * BM)
    gs = torch.empty(B * H * min(chunk, Tq) * max(1, NB), device=dev, dtype=torch.float32)
    NBP = max(16, next_power_of_2(NB))
    TB = max(1, min(BM, 8192 // NBP))
    for c0 in range(0, Tq, chunk):
        C = min(Tq, c0 + chunk) - c0
        qc, pc, oc = q[:, :, c0:c0 + C], qpos[:, c0:c0 + C].contiguous(), out[:, c0:c0 + C]
        tile_select_kernel[(cdiv(C, BM), B * H)](
            qc, mu, s2, pc, gs, oc, qc.stride(0), qc.stride(1), qc.stride(2), oc.stride(0), oc.stride(1),
            C, H, NB, params.block_size, params.num_sink_blocks, params.num_local_blocks, params.top_k_blocks, nsel,
            1.0 / math.sqrt(D), G=G, GP=GP, BM=BM, D=D, BN=64 if D <= 64 else 32, NBP=NBP, TB=TB,
            TAYLOR=params.selection == "taylor",
            PREC=prec, num_warps=4,
        )
    return out


def tile_shape(G: int, rows: int) -> tuple[int, int]:
    """(GP, BM): the group padded to a power of two and the tokens of a query tile of about `rows`
    rows (tokens x GP)."""
    GP = next_power_of_2(G)
    BM = max(1, min(TILE_MAX_TOKENS, rows // GP))
    while BM * GP < 16:
        BM *= 2
    return GP, BM


def tile_union(idx: torch.Tensor, num_blocks: int, BM: int):
    """Per query tile of BM tokens: (union [B*H, ntiles, NU] int32 ascending, bits (same shape, int32:
    bit m = token m of the tile chose the block), count [B*H, ntiles] int32, NU). No host sync."""
    B, T, H, K = idx.shape
    ntiles = cdiv(T, BM)
    NU = max(1, min(num_blocks, BM * K))
    dev = idx.device
    union = new_output((B * H, ntiles, NU), dev, torch.int32)
    bits = new_output((B * H, ntiles, NU), dev, torch.int32)
    cnt = new_output((B * H, ntiles), dev, torch.int32)
    scratch = torch.empty(B * H, ntiles, max(1, num_blocks), device=dev, dtype=torch.int32)
    tile_union_kernel[(ntiles, B * H)](
        idx, scratch, union, bits, cnt, T, H, K, NU, max(1, num_blocks), BM=BM,
        KP=max(2, next_power_of_2(K)), NBP=max(16, next_power_of_2(num_blocks)),
        num_warps=4 if num_blocks <= 4096 else 8,
    )
    return union, bits, cnt, NU


def query_tile_union(idx: torch.Tensor, num_keys: int, G: int, block_size: int, rows: int):
    """`tile_union` of the query tiles `tile_sparse_forward` runs (tiles of about `rows` rows, groups
    of G query heads) over `num_keys` key slots in blocks of `block_size`."""
    return tile_union(idx.contiguous(), cdiv(num_keys, block_size), tile_shape(G, rows)[1])


def tile_sparse_forward(q, k, v, idx, qpos, koff, use_rla, block_size, *, rows: int, phik=None, union=None,
                        precision: str = "ieee"):
    """Same contract as `triton_parallel.sparse_forward` (q [B, HQ, Tq, D], k, v [B, H, S, D], idx
    [B, Tq, H, K] int32, qpos [B, Tq] int32, koff [B] int32), over query tiles of about `rows` rows
    (dots of fp32 operands at `precision`, "ieee" or "tf32"): returns o_sp (normalised), otilde (or
    None) [B, Tq, HQ, D] fp32 and the log-sum-exp [B, Tq, HQ]; also the union lists (for the
    backward)."""
    B, HQ, Tq, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = HQ // H
    GP, BM = tile_shape(G, rows)
    if union is None:
        union = query_tile_union(idx, S, G, block_size, rows)
    ul, ub, uc, NU = union
    ntiles = ul.shape[1]
    dev = q.device
    o = new_output((B, Tq, HQ, D), dev)
    ot = new_output((B, Tq, HQ, D), dev) if use_rla else o
    lse = new_output((B, Tq, HQ), dev)
    pk = k if phik is None else phik
    tile_fwd_kernel[(ntiles, B * H)](
        q, k, v, pk, ul, ub, uc, qpos, koff, o, ot, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        pk.stride(0), pk.stride(1), pk.stride(2),
        Tq, H, NU, 1.0 / math.sqrt(D),
        G=G, GP=GP, BM=BM, D=D, BS=block_size, USE_RLA=use_rla, IEEE=q.dtype == torch.float32 and precision == "ieee",
        PRE_PHIK=phik is not None, num_warps=4 if BM * GP * D <= 64 * 64 else 8, num_stages=2,
    )
    return o, (ot if use_rla else None), lse, union


def blocks_to_tiles(union, num_blocks: int):
    """Invert the union lists: for each (batch x KV head, block) the query tiles whose union holds it,
    as CSR (tiles int32 [n], bits int32 [n], offsets int32 [B*H*NB + 1]); one device sort, no host
    sync (n is the padded size of the lists; entries past the offsets are unused)."""
    ul, ub, uc, NU = union
    BH, ntiles, _ = ul.shape
    dev = ul.device
    valid = torch.arange(NU, device=dev)[None, None, :] < uc[:, :, None]
    bh = torch.arange(BH, device=dev, dtype=torch.int64)[:, None, None]
    key = torch.where(valid, bh * num_blocks + ul.long(), BH * num_blocks).flatten()
    skey, order = key.sort(stable=True)
    offsets = torch.searchsorted(skey, torch.arange(BH * num_blocks + 1, device=dev)).to(torch.int32)
    tiles = ((order // NU) % ntiles).to(torch.int32)
    bits = ub.flatten()[order]
    return tiles, bits, offsets


class TileSparseAttention(torch.autograd.Function):
    """The sparse branch and the correction otilde over query tiles, forward and backward. The
    selection (idx) carries no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, idx, qpos, koff, use_rla, block_size, precompute_phik, rows, precision="ieee"):
        phik = key_features(k) if use_rla and precompute_phik else None
        o, ot, lse, union = tile_sparse_forward(q, k, v, idx, qpos, koff, use_rla, block_size, rows=rows, phik=phik,
                                                precision=precision)
        ul, ub, uc, NU = union
        ctx.save_for_backward(q, k, v, qpos, koff, o, lse, phik, ul, ub, uc)
        ctx.use_rla, ctx.block_size, ctx.NU, ctx.rows, ctx.precision = use_rla, block_size, NU, rows, precision
        return o, ot

    @staticmethod
    def backward(ctx, do, dot_):
        q, k, v, qpos, koff, o, lse, phik, ul, ub, uc = ctx.saved_tensors
        use_rla, bs, NU = ctx.use_rla, ctx.block_size, ctx.NU
        B, HQ, Tq, D = q.shape
        H, S = k.shape[1], k.shape[2]
        G = HQ // H
        GP, BM = tile_shape(G, ctx.rows)
        dev = q.device
        do = torch.zeros_like(o) if do is None else do.float().contiguous()
        delta = (do * o).sum(-1).contiguous()
        if use_rla:
            dot_ = torch.zeros_like(o) if dot_ is None else dot_.float().contiguous()
        else:
            dot_ = do
        ieee = q.dtype == torch.float32 and ctx.precision == "ieee"
        scale = 1.0 / math.sqrt(D)
        strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2))
        ntiles = ul.shape[1]
        dq = new_output((B, Tq, HQ, D), dev)
        pk = k if phik is None else phik
        warps = 4 if BM * GP * D <= 64 * 64 else 8
        tile_bwd_dq_kernel[(ntiles, B * H)](
            q, k, v, pk, ul, ub, uc, qpos, koff, lse, delta, do, dot_, dq, *strides,
            pk.stride(0), pk.stride(1), pk.stride(2), Tq, H, NU, scale,
            G=G, GP=GP, BM=BM, D=D, BS=bs, USE_RLA=use_rla, IEEE=ieee, PRE_PHIK=phik is not None,
            num_warps=warps, num_stages=2,
        )
        NB = cdiv(S, bs)
        e_tile, e_bits, e_off = blocks_to_tiles((ul, ub, uc, NU), NB)
        dk = torch.zeros(B, H, S, D, device=dev, dtype=torch.float32)
        dv = torch.zeros_like(dk)
        phiq = torch.softmax(q.float(), dim=-1).to(q.dtype) if use_rla else q
        tile_bwd_dkv_kernel[(NB, B * H)](
            q, k, v, phiq, qpos, koff, lse, delta, do, dot_, e_tile, e_bits, e_off, dk, dv, *strides[:3],
            phiq.stride(0), phiq.stride(1), phiq.stride(2), *strides[3:],
            Tq, H, NB, S, scale, G=G, GP=GP, BM=BM, D=D, BS=bs, USE_RLA=use_rla, IEEE=ieee,
            num_warps=warps, num_stages=1,
        )
        return dq.transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *[None] * 8


def tile_sparse_attention(q, k, v, idx, qpos, koff, use_rla, block_size, precompute_phik, *, grad: bool,
                          rows: int, precision: str = "ieee", union=None):
    """The tile form of `triton_parallel.SparseAttention.apply` (same operands, q [B, HQ, Tq, D] and
    k, v [B, H, S, D] views) over query tiles of about `rows` rows, dots of fp32 operands at
    `precision` ("ieee" or "tf32"): (o_sp, otilde) [B, Tq, HQ, D] fp32; with `grad` differentiable
    through `TileSparseAttention`, else the forward alone (over `union`, the tiles' `tile_union` for
    these rows, when the caller has it)."""
    if grad:
        return TileSparseAttention.apply(q, k, v, idx, qpos, koff, use_rla, block_size, precompute_phik, rows,
                                         precision)
    phik = key_features(k) if use_rla and precompute_phik else None
    o, ot, _, _ = tile_sparse_forward(q, k, v, idx, qpos, koff, use_rla, block_size, rows=rows, phik=phik,
                                      union=union, precision=precision)
    return o, ot
