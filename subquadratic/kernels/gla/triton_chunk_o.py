"""The output kernels of the chunked linear-attention op, forward and backward, one kernel each for
every decay kind (the constexpr DECAY, the layouts and the chunk bounds of `triton_chunk_h.py`):

    o_t = (q_t decay(chunk start -> t)) h_c + sum_{s <= t in the chunk} A_ts v_s

with h_c the state before the token's chunk and A the intra-chunk causal scores, per query head
(query head j reads KV head j // G):
  DECAY 0:  A_ts = q_t . k_s;   DECAY 1:  A_ts = (q_t . k_s) exp(gc_t - gc_s)  (both formed here);
  DECAY 2:  A_ts = sum_d q_td k_sd exp(gc_td - gc_sd), which no single factorisation keeps finite:
            `intra_fwd` forms it by sub-chunks of BC = 16 tokens, exponents <= 0 only (for query
            sub-chunk i and key sub-chunk j < i the product is split at the first row of i; a
            diagonal sub-chunk is one fp32 dot split the same way when its decay span is at most
            30, else its decays are formed pairwise per key dim), and `chunk_fwd_o`
            loads it. G = 1 for this kind.

Kernels, one program per (V block, chunk, KV head) unless said: `chunk_fwd_o` (the G query heads
of the KV head in turn: k, v and h are loaded once for them); backward `chunk_bwd_dv`
(dv = sum_g A_g^T do_g + (k decay-to-end) dh), `chunk_bwd_dqk` (one program per (chunk, KV head):
dq per query head, dk summed over them, and for DECAY > 0 the log decays' gradient
dg_t = sum_{t' >= t in the chunk} (q dq - k dk)_t' + the chunk-end term <h_c, dh_c> exp(gc_last)
+ sum_s k_s . dk_s(state part), so no sum runs across chunks); DECAY 2 adds `intra_bwd_dA`
(dA = do v^T) and `intra_bwd` (the intra-chunk parts of dq, dk per sub-chunk), which
`chunk_bwd_dqk` loads. Operands of every dot are cleaned with tl.where at invalid rows (no 0 * inf).
"""

from __future__ import annotations

from ..triton_launch import jit
from ..triton_utils import autotune
from ..utils import import_triton
from .triton_chunk_h import chunk_bounds, chunk_rows, load_decays, load_state

triton, tl = import_triton()

#: (BK, BV, warps, stages) the kernels are autotuned over on the GPU (BK: the whole key dim).
CONFIGS_O = [(None, 64, 4, 2), (None, 64, 8, 2), (None, 128, 8, 2), (None, 32, 4, 2), (None, 64, 4, 3)]
CONFIGS_DQK = [(None, 64, 8, 2), (None, 64, 4, 2), (None, 32, 4, 2), (None, 32, 8, 2), (None, 128, 8, 2)]
KEY = ["K", "V", "BT", "G", "DECAY", "PREC"]
BC = 16  # sub-chunk of the DECAY 2 intra-chunk kernels
#: warps and stages of the DECAY 2 intra-chunk kernels (their tiles are [BC, K] and [BT, BT]: small
#: programs, where fewer warps may keep more of them resident), and `intra_bwd_dA`'s V blocks
CONFIGS_INTRA = [(None, None, w, st) for w in (1, 2, 4, 8) for st in (1, 2)]
CONFIGS_DA = [(None, 64, 4, 2), (None, 64, 2, 2), (None, 32, 2, 2), (None, 32, 4, 2), (None, 128, 4, 2),
              (None, 64, 8, 2), (None, 64, 4, 3)]
KEY_INTRA = ["K", "BT", "PREC"]
KEY_DA = ["V", "BT", "PREC"]


@autotune(CONFIGS_O, KEY)
@jit
def chunk_fwd_o(
    q, k, v, gc, h, A, o, s_bos, s_n, T, NT,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n, row, m_t, row_last = chunk_rows(s_bos, s_n, i_c, i_h, T, NT, H, BT, IS_VARLEN)
    o_t, o_k = tl.arange(0, BT), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
    b_h = load_state(h, i_c, i_h, n, o_k, o_v, H, K, V).to(b_k.dtype)
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    if DECAY != 0:
        b_g, b_gl = load_decays(gc, row, row_last, m_t, n, o_k, K, DECAY)
    if DECAY == 1:  # q decayed from the chunk start; the intra-chunk decays
        b_eq = tl.exp(b_g)[:, None]
        b_M = tl.where(causal, tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
    elif DECAY == 2:
        b_eq = tl.exp(b_g)
    for i_g in range(0, G):
        hq = i_h * G + i_g
        row_q = (row - i_h) * G + hq
        b_q = tl.load(q + row_q[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        if DECAY == 2:
            b_qg = tl.where(m_tk, b_q.to(tl.float32) * b_eq, 0.0).to(b_q.dtype)
            b_o = tl.dot(b_qg, b_h, input_precision=PREC)
            b_A = tl.load(A + (i_c * H * G + hq).to(tl.int64) * BT * BT + o_t[:, None] * BT + o_t[None, :],
                          mask=causal, other=0.0)
        else:
            b_o = tl.dot(b_q, b_h, input_precision=PREC)
            b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
            if DECAY == 1:
                b_o = b_o * b_eq
                b_A = b_A * b_M
            else:
                b_A = tl.where(causal, b_A, 0.0)
        b_o += tl.dot(b_A.to(b_v.dtype), b_v, input_precision=PREC)
        tl.store(o + row_q[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


@autotune(CONFIGS_O, KEY)
@jit
def chunk_bwd_dv(
    q, k, gc, A, do, dh, dv, s_bos, s_n, T, NT,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n, row, m_t, row_last = chunk_rows(s_bos, s_n, i_c, i_h, T, NT, H, BT, IS_VARLEN)
    o_t, o_k = tl.arange(0, BT), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_dh = load_state(dh, i_c, i_h, n, o_k, o_v, H, K, V).to(b_k.dtype)
    upper = (o_t[:, None] <= o_t[None, :]) & m_t[:, None] & m_t[None, :]  # [s, t]: key s, query t >= s
    b_kd = b_k  # k decayed to the chunk end
    if DECAY != 0:
        b_g, b_gl = load_decays(gc, row, row_last, m_t, n, o_k, K, DECAY)
    if DECAY == 1:
        b_kd = tl.where(m_tk, b_k.to(tl.float32) * tl.exp(b_gl - b_g)[:, None], 0.0).to(b_k.dtype)
        b_Mt = tl.where(upper, tl.exp(tl.where(upper, b_g[None, :] - b_g[:, None], 0.0)), 0.0)
    elif DECAY == 2:
        b_kd = tl.where(m_tk, b_k.to(tl.float32) * tl.exp(b_gl[None, :] - b_g), 0.0).to(b_k.dtype)
    b_dv = tl.dot(b_kd, b_dh, input_precision=PREC)
    for i_g in range(0, G):
        hq = i_h * G + i_g
        row_q = (row - i_h) * G + hq
        b_do = tl.load(do + row_q[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(b_k.dtype)
        if DECAY == 2:  # A^T [s, t]
            b_At = tl.load(A + (i_c * H * G + hq).to(tl.int64) * BT * BT + o_t[None, :] * BT + o_t[:, None],
                           mask=upper, other=0.0)
        else:
            b_q = tl.load(q + row_q[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_At = tl.dot(b_k, tl.trans(b_q), input_precision=PREC)
            if DECAY == 1:
                b_At = b_At * b_Mt
            else:
                b_At = tl.where(upper, b_At, 0.0)
        b_dv += tl.dot(b_At.to(b_k.dtype), b_do, input_precision=PREC)
    tl.store(dv + row[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)


@autotune(CONFIGS_DQK, KEY)
@jit
def chunk_bwd_dqk(
    q, k, v, gc, h, do, dh, dq_in, dk_in, dq, dk, dg, s_bos, s_n, T, NT, gs,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """dq, dk and the gradient of the raw log decays g (whose gs multiple the walk summed into gc: the
    gradient is gs times gc's reverse cumulative sum)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    n, row, m_t, row_last = chunk_rows(s_bos, s_n, i_c, i_h, T, NT, H, BT, IS_VARLEN)
    o_t, o_k = tl.arange(0, BT), tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    off = row[:, None] * K + o_k[None, :]
    b_k = tl.load(k + off, mask=m_tk, other=0.0)
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    if DECAY != 0:
        b_g, b_gl = load_decays(gc, row, row_last, m_t, n, o_k, K, DECAY)
    if DECAY == 1:
        b_M = tl.where(causal, tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
        b_eq = tl.exp(b_g)[:, None]
        b_ek = tl.where(m_t, tl.exp(b_gl - b_g), 0.0)[:, None]
    elif DECAY == 2:
        b_eq = tl.exp(b_g)
        b_ek = tl.where(m_tk, tl.exp(b_gl[None, :] - b_g), 0.0)
    # the state's gradient in dk (v_s dh^T, decayed to the chunk end) and <h, dh> per key dim
    b_dkh = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & (o_v < V)[None, :], other=0.0)
        b_dh = load_state(dh, i_c, i_h, n, o_k, o_v, H, K, V)
        b_dkh += tl.dot(b_v.to(b_k.dtype), tl.trans(b_dh.to(b_k.dtype)), input_precision=PREC)
        if DECAY != 0:
            b_h = load_state(h, i_c, i_h, n, o_k, o_v, H, K, V)
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
    if DECAY != 0:
        b_dkh = b_dkh * b_ek
    b_dk = b_dkh
    if DECAY == 2:
        b_dk += tl.load(dk_in + off, mask=m_tk, other=0.0)
    b_qdq = tl.zeros([BT, BK], dtype=tl.float32)  # q * dq (DECAY 2, G = 1)
    b_qdq_t = tl.zeros([BT], dtype=tl.float32)  # sum over the query heads and key dims of q * dq (DECAY 1)
    for i_g in range(0, G):
        row_q = (row - i_h) * G + i_h * G + i_g
        off_q = row_q[:, None] * K + o_k[None, :]
        b_q = tl.load(q + off_q, mask=m_tk, other=0.0)
        b_dqh = tl.zeros([BT, BK], dtype=tl.float32)
        b_ds = tl.zeros([BT, BT], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            b_do = tl.load(do + row_q[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(b_q.dtype)
            b_h = load_state(h, i_c, i_h, n, o_k, o_v, H, K, V)
            b_dqh += tl.dot(b_do, tl.trans(b_h.to(b_q.dtype)), input_precision=PREC)
            if DECAY != 2:
                b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(b_q.dtype)
                b_ds += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        if DECAY == 2:
            b_dq = tl.load(dq_in + off_q, mask=m_tk, other=0.0) + tl.where(m_tk, b_dqh * b_eq, 0.0)
        else:
            if DECAY == 1:  # ds[t, s] = (do_t . v_s) exp(gc_t - gc_s), s <= t
                b_ds = b_ds * b_M
                b_dq = b_dqh * b_eq
            else:
                b_ds = tl.where(causal, b_ds, 0.0)
                b_dq = b_dqh
            b_dsc = b_ds.to(b_q.dtype)
            b_dq += tl.dot(b_dsc, b_k, input_precision=PREC)
            b_dk += tl.dot(tl.trans(b_dsc), b_q, input_precision=PREC)
        tl.store(dq + off_q, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        if DECAY == 1:
            b_qdq_t += tl.sum(b_q.to(tl.float32) * b_dq, 1)
        elif DECAY == 2:
            b_qdq += b_q.to(tl.float32) * b_dq
    tl.store(dk + off, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    # the log decays' gradient: in-chunk reverse cumulative sum of d/d gc plus the chunk-end term
    if DECAY == 1:
        kf = b_k.to(tl.float32)
        b_dgt = tl.where(m_t, b_qdq_t - tl.sum(kf * b_dk, 1), 0.0)
        b_x = tl.sum(b_hdh, 0) * tl.exp(b_gl) + tl.sum(tl.sum(kf * b_dkh, 1), 0)
        b_dg = (tl.sum(b_dgt, 0) - tl.cumsum(b_dgt, 0) + b_dgt + b_x) * gs
        tl.store(dg + row, b_dg, mask=m_t)
    elif DECAY == 2:
        kf = b_k.to(tl.float32)
        b_dgam = tl.where(m_tk, b_qdq - kf * b_dk, 0.0)
        b_x = b_hdh * tl.exp(b_gl) + tl.sum(kf * b_dkh, 0)
        b_dg = (tl.sum(b_dgam, 0)[None, :] - tl.cumsum(b_dgam, 0) + b_dgam + b_x[None, :]) * gs
        tl.store(dg + off, b_dg, mask=m_tk)


# ---------------------------------------------------------------------------
# DECAY 2: the intra-chunk scores and their gradients by sub-chunks (G = 1)
# ---------------------------------------------------------------------------


@autotune(CONFIGS_INTRA, KEY_INTRA)
@jit
def intra_fwd(
    q, k, gc, A, s_bos, s_n, T, NT,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (chunk, query sub-chunk i, head): rows i*BC.. of the intra-chunk scores
    A [NC, H, BT, BT] (fp32; entries above the diagonal are not written)."""
    i_c, i_i, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, n = chunk_bounds(s_bos, s_n, i_c, T, NT, BT, IS_VARLEN)
    o_c, o_k = tl.arange(0, BC), tl.arange(0, BK)
    m_k = o_k < K
    r_i = i_i * BC + o_c
    m_i = r_i < n
    m_ik = m_i[:, None] & m_k[None, :]
    off_i = ((bos + r_i).to(tl.int64) * H + i_h)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + off_i, mask=m_ik, other=0.0).to(tl.float32)
    b_g = tl.load(gc + off_i, mask=m_ik, other=0.0)
    b_gn = tl.load(gc + ((bos + i_i * BC).to(tl.int64) * H + i_h) * K + o_k, mask=m_k & ((o_k * 0 + i_i * BC) < n),
                   other=0.0)
    b_qg = tl.where(m_ik, b_q * tl.exp(b_g - b_gn[None, :]), 0.0).to(q.dtype.element_ty)
    a_base = A + (i_c * H + i_h).to(tl.int64) * BT * BT
    for j in range(0, i_i):
        r_j = j * BC + o_c
        off_j = ((bos + r_j).to(tl.int64) * H + i_h)[:, None] * K + o_k[None, :]
        m_jk = (r_j < n)[:, None] & m_k[None, :]
        b_k = tl.load(k + off_j, mask=m_jk, other=0.0).to(tl.float32)
        b_gj = tl.load(gc + off_j, mask=m_jk, other=0.0)
        b_kg = tl.where(m_jk, b_k * tl.exp(b_gn[None, :] - b_gj), 0.0).to(k.dtype.element_ty)
        b_A = tl.dot(b_qg, tl.trans(b_kg), input_precision=PREC)
        tl.store(a_base + r_i[:, None] * BT + r_j[None, :], b_A)
    # diagonal block: A_ts = sum_d q_td k_sd exp(gc_td - gc_sd), s <= t inside the sub-chunk. Split at its
    # first row n, exp(gc_t - gc_n) <= 1 and exp(gc_n - gc_s) <= exp(span), span the sub-chunk's largest
    # decay (gc_n - gc_last over the key dims): one fp32 dot when the span is at most 30 (exp(30) |k|
    # stays far inside fp32), else the pairwise exponents (all <= 0) one key at a time
    r_last = tl.maximum(tl.minimum(i_i * BC + BC, n) - 1, 0)
    b_gr = tl.load(gc + ((bos + r_last).to(tl.int64) * H + i_h) * K + o_k, mask=m_k & (o_k * 0 < n), other=0.0)
    span = tl.max(tl.where(m_k, b_gn - b_gr, 0.0), 0)
    lower = (o_c[:, None] >= o_c[None, :]) & m_i[:, None] & m_i[None, :]
    if span <= 30.0:
        b_ki = tl.load(k + off_i, mask=m_ik, other=0.0).to(tl.float32)
        b_kn = tl.where(m_ik, b_ki * tl.exp(b_gn[None, :] - b_g), 0.0)
        b_qn = tl.where(m_ik, b_q * tl.exp(b_g - b_gn[None, :]), 0.0)
        b_A = tl.where(lower, tl.dot(b_qn, tl.trans(b_kn), input_precision=PREC), 0.0)
    else:
        b_A = tl.zeros([BC, BC], dtype=tl.float32)
        for j in range(0, BC):
            s = i_i * BC + j
            m_s = (o_k * 0 + s) < n
            off_s = ((bos + s).to(tl.int64) * H + i_h) * K + o_k
            b_ks = tl.load(k + off_s, mask=m_k & m_s, other=0.0).to(tl.float32)
            b_gs = tl.load(gc + off_s, mask=m_k & m_s, other=0.0)
            keep = (o_c >= j)[:, None] & m_ik & m_s[None, :]
            b_e = tl.exp(tl.where(keep, b_g - b_gs[None, :], 0.0))
            col = tl.sum(tl.where(keep, b_q * b_ks[None, :] * b_e, 0.0), 1)
            b_A = tl.where(o_c[None, :] == j, col[:, None], b_A)
    tl.store(a_base + r_i[:, None] * BT + r_i[None, :], b_A)


@autotune(CONFIGS_DA, KEY_DA)
@jit
def intra_bwd_dA(
    v, do, dA, s_bos, s_n, T, NT,
    H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
    BV: tl.constexpr,
):
    """dA[t, s] = do_t . v_s for s <= t (0 elsewhere), fp32 [NC, H, BT, BT]; one program per
    (chunk, head)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, n = chunk_bounds(s_bos, s_n, i_c, T, NT, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    m_t = o_t < n
    row = (bos + o_t).to(tl.int64) * H + i_h
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(b_v.dtype)
        b_dA += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
    b_dA = tl.where(o_t[:, None] >= o_t[None, :], b_dA, 0.0)
    tl.store(dA + (i_c * H + i_h).to(tl.int64) * BT * BT + o_t[:, None] * BT + o_t[None, :], b_dA)


@autotune(CONFIGS_INTRA, KEY_INTRA)
@jit
def intra_bwd(
    q, k, gc, dA, dq, dk, s_bos, s_n, T, NT,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    NC: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Intra-chunk parts of dq, dk (fp32) for the rows of sub-chunk i, one program per (chunk,
    sub-chunk, head): dq_t = sum_{s <= t} dA_ts k_s exp(gc_t - gc_s),
    dk_s = sum_{t >= s} dA_ts q_t exp(gc_t - gc_s)."""
    i_c, i_i, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, n = chunk_bounds(s_bos, s_n, i_c, T, NT, BT, IS_VARLEN)
    o_c, o_k = tl.arange(0, BC), tl.arange(0, BK)
    m_k = o_k < K
    r_i = i_i * BC + o_c
    m_i = r_i < n
    m_ik = m_i[:, None] & m_k[None, :]
    off_i = ((bos + r_i).to(tl.int64) * H + i_h)[:, None] * K + o_k[None, :]
    b_g = tl.load(gc + off_i, mask=m_ik, other=0.0)
    dA_base = dA + (i_c * H + i_h).to(tl.int64) * BT * BT
    # reference points: first row of sub-chunk i (for dq), its last valid row (for dk)
    b_gn = tl.load(gc + ((bos + i_i * BC).to(tl.int64) * H + i_h) * K + o_k, mask=m_k & ((o_k * 0 + i_i * BC) < n),
                   other=0.0)
    r_last = tl.maximum(tl.minimum(i_i * BC + BC, n) - 1, 0)
    b_gr = tl.load(gc + ((bos + r_last).to(tl.int64) * H + i_h) * K + o_k, mask=m_k & (o_k * 0 < n), other=0.0)
    # the diagonal block as in `intra_fwd`: one fp32 dot each for dq and dk when the sub-chunk's decay span
    # is at most 30 (k_s exp(gc_n - gc_s) and q_t exp(gc_t - gc_last), both <= exp(span)), else the
    # pairwise exponents one row at a time (below)
    span = tl.max(tl.where(m_k, b_gn - b_gr, 0.0), 0)
    lower = (o_c[:, None] >= o_c[None, :]) & m_i[:, None] & m_i[None, :]
    b_dAii = tl.load(dA_base + r_i[:, None] * BT + r_i[None, :], mask=lower, other=0.0)  # [t, s]
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    for j in range(0, i_i):
        r_j = j * BC + o_c
        off_j = ((bos + r_j).to(tl.int64) * H + i_h)[:, None] * K + o_k[None, :]
        m_jk = (r_j < n)[:, None] & m_k[None, :]
        b_kj = tl.load(k + off_j, mask=m_jk, other=0.0).to(tl.float32)
        b_gj = tl.load(gc + off_j, mask=m_jk, other=0.0)
        b_kg = tl.where(m_jk, b_kj * tl.exp(b_gn[None, :] - b_gj), 0.0).to(k.dtype.element_ty)
        b_dAij = tl.load(dA_base + r_i[:, None] * BT + r_j[None, :]).to(k.dtype.element_ty)
        b_dq += tl.dot(b_dAij, b_kg, input_precision=PREC)
    if span <= 30.0:
        b_ki = tl.load(k + off_i, mask=m_ik, other=0.0).to(tl.float32)
        b_dq += tl.dot(b_dAii, tl.where(m_ik, b_ki * tl.exp(b_gn[None, :] - b_g), 0.0), input_precision=PREC)
    b_dq = tl.where(m_ik, b_dq * tl.exp(b_g - b_gn[None, :]), 0.0)
    b_dk = tl.zeros([BC, BK], dtype=tl.float32)
    for j in range(i_i + 1, NC):
        r_j = j * BC + o_c
        off_j = ((bos + r_j).to(tl.int64) * H + i_h)[:, None] * K + o_k[None, :]
        m_jk = (r_j < n)[:, None] & m_k[None, :]
        b_qj = tl.load(q + off_j, mask=m_jk, other=0.0).to(tl.float32)
        b_gj = tl.load(gc + off_j, mask=m_jk, other=0.0)
        b_qg = tl.where(m_jk, b_qj * tl.exp(b_gj - b_gr[None, :]), 0.0).to(q.dtype.element_ty)
        b_dAji = tl.load(dA_base + r_j[None, :] * BT + r_i[:, None]).to(q.dtype.element_ty)  # [s in i, t in j]
        b_dk += tl.dot(b_dAji, b_qg, input_precision=PREC)
    if span <= 30.0:
        b_qi = tl.load(q + off_i, mask=m_ik, other=0.0).to(tl.float32)
        b_dk += tl.dot(tl.trans(b_dAii), tl.where(m_ik, b_qi * tl.exp(b_g - b_gr[None, :]), 0.0),
                       input_precision=PREC)
    b_dk = tl.where(m_ik, b_dk * tl.exp(b_gr[None, :] - b_g), 0.0)
    if span > 30.0:  # diagonal block, one row j at a time: j as the key (for dq) and as the query (for dk)
        for j in range(0, BC):
            r = i_i * BC + j
            m_r = (o_k * 0 + r) < n
            m_rc = (o_c * 0 + r) < n
            off_r = ((bos + r).to(tl.int64) * H + i_h) * K + o_k
            b_kr = tl.load(k + off_r, mask=m_k & m_r, other=0.0).to(tl.float32)
            b_qr = tl.load(q + off_r, mask=m_k & m_r, other=0.0).to(tl.float32)
            b_gr_ = tl.load(gc + off_r, mask=m_k & m_r, other=0.0)
            col = tl.load(dA_base + r_i * BT + r, mask=m_i & m_rc, other=0.0)     # dA[t in i, s = r]
            rw = tl.load(dA_base + r * BT + r_i, mask=m_i & m_rc, other=0.0)      # dA[t = r, s in i]
            keep_q = (o_c >= j)[:, None] & m_ik & m_r[None, :]                    # t >= s = r
            e_q = tl.exp(tl.where(keep_q, b_g - b_gr_[None, :], 0.0))
            b_dq += tl.where(keep_q, col[:, None] * b_kr[None, :] * e_q, 0.0)
            keep_k = (o_c <= j)[:, None] & m_ik & m_r[None, :]                    # s <= t = r
            e_k = tl.exp(tl.where(keep_k, b_gr_[None, :] - b_g, 0.0))
            b_dk += tl.where(keep_k, rw[:, None] * b_qr[None, :] * e_k, 0.0)
    tl.store(dq + off_i, b_dq, mask=m_ik)
    tl.store(dk + off_i, b_dk, mask=m_ik)
