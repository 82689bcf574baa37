"""Triton variable-length chunked GLA (per-key-dim decay): forward and backward.

    S_t = diag(exp g_t) S_{t-1} + k_t^T v_t,   o_t = q_t S_t      (per segment, from its initial state)

Layout: packed tokens q, k, g: [M, H, K], v: [M, H, V]; `cu_seqlens` [S + 1] (int, on the device)
cuts them into S segments (empty ones allowed; their state passes through). Initial states
[S, H, K, V] in, final states [S, H, K, V] (fp32) out. Same contract and values as `gla_varlen`.

No host synchronisation: every grid comes from shapes only.
- Per-segment kernels (`_fwd_h` chunk states, `_bwd_dh` their gradients) run one program per
  (K block, V block, segment x head) and walk that segment's chunks (a loop bound read on the device).
- Per-chunk kernels run on a fixed number of chunk slots, NS = M // C + S (an upper bound of
  sum_s ceil(len_s / C)); slot j holds chunk j of the segment-major chunk list, or nothing (a slot
  with 0 valid tokens, whose programs store nothing). `_slots` builds the slot table with device ops.

Numerics. gc = in-chunk cumulative sum of g (<= 0, non-increasing). Every exp() below has an
exponent <= 0: inter-chunk terms use exp(gc_t) and exp(gc_last - gc_s); the intra-chunk scores are
split into sub-chunks of BC = 16 tokens: for query sub-chunk i and key sub-chunk j < i,
A_ij = (q_i exp(gc_i - gc_n)) (k_j exp(gc_n - gc_j))^T with gc_n at the first row of sub-chunk i;
inside a diagonal sub-chunk the decays exp(gc_t - gc_s), s <= t, are formed pairwise per key dim
(a loop over the 16 keys). Decays of log alpha ~ -5 per token over a 64-token chunk stay finite:
each factor underflows to 0 where the true product is negligible, nothing overflows.
Operands of every dot are cleaned with tl.where at invalid rows (no 0 * inf).

Forward kernels: `_cumsum` (gc), `_fwd_h`, `_fwd_A` (intra-chunk scores, one program per
sub-chunk row), `_fwd_o`. Backward: `_fwd_h` again, `_bwd_dh`, `_bwd_dA` (do v^T), `_bwd_dv`,
`_bwd_intra` (intra-chunk dq, dk per sub-chunk), `_bwd_inter` (inter-chunk dq, dk; dg as the
in-chunk reverse cumulative sum of q dq - k dk plus the chunk-end terms).
Dots run on the tensor cores in the input dtype with fp32 accumulation, exact fp32 ("ieee") for
fp32 inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton_utils import block_size as _bs
from ..triton_utils import dot_precision
from ..utils import import_triton, new_output

triton, tl = import_triton()

#: Block sizes along V for the per-segment state kernels and the output kernels; K is kept whole
#: (head dims up to 128). Warps per kernel.
BK_H = 64
BV_H = 64
BV_O = 64
WARPS = 4
WARPS_WIDE = 8  # kernels holding several [chunk, K] fp32 tiles (_fwd_o, _bwd_dv, _bwd_inter)
BC = 16  # sub-chunk


# ---------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------


@triton.jit
def _cumsum(g, gc, s_bos, s_n, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, n = tl.load(s_bos + i_c), tl.load(s_n + i_c)
    o_t, o_k = tl.arange(0, BT), tl.arange(0, BK)
    m = (o_t < n)[:, None] & (o_k < K)[None, :]
    off = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
    b_g = tl.load(g + off, mask=m, other=0.0)
    tl.store(gc + off, tl.cumsum(b_g, 0), mask=m)


@triton.jit
def _fwd_h(
    k, v, gc, h, h0, ht, cu, ccu,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    USE_H0: tl.constexpr, PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """One program per (K block, V block, segment x head): the state before every chunk of the
    segment into h [NS, H, K, V] and the final state into ht [S, H, K, V]."""
    i_k, i_v, i_sh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, i_h = i_sh // H, i_sh % H
    bos, eos = tl.load(cu + i_s), tl.load(cu + i_s + 1)
    c0 = tl.load(ccu + i_s)
    NT = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_sh * K * V + off_kv, mask=m_kv, other=0.0)
    for i_t in range(0, NT):
        tl.store(h + ((c0 + i_t) * H + i_h) * K * V + off_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        tok = bos + i_t * BT + o_t
        m_t = tok < eos
        last = tl.minimum(bos + i_t * BT + BT, eos) - 1
        b_k = tl.load(k + (tok * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_v = tl.load(v + (tok * H + i_h)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_g = tl.load(gc + (tok * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_kd = tl.where(m_t[:, None], b_k.to(tl.float32) * tl.exp(b_gl[None, :] - b_g), 0.0).to(b_k.dtype)
        b_h = b_h * tl.exp(b_gl)[:, None] + tl.dot(tl.trans(b_kd), b_v, input_precision=PREC)
    tl.store(ht + i_sh * K * V + off_kv, b_h, mask=m_kv)


@triton.jit
def _fwd_A(
    q, k, gc, A, s_bos, s_n,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    PREC: tl.constexpr,
):
    """One program per (chunk slot, query sub-chunk i, head): rows i*BC.. of the intra-chunk
    scores A [NS, H, BT, BT] (fp32; entries above the diagonal are not written)."""
    i_c, i_i, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, n = tl.load(s_bos + i_c), tl.load(s_n + i_c)
    o_c, o_k = tl.arange(0, BC), tl.arange(0, BK)
    m_k = o_k < K
    r_i = i_i * BC + o_c
    m_i = r_i < n
    m_ik = m_i[:, None] & m_k[None, :]
    off_i = ((bos + r_i) * H + i_h)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + off_i, mask=m_ik, other=0.0).to(tl.float32)
    b_g = tl.load(gc + off_i, mask=m_ik, other=0.0)
    b_gn = tl.load(gc + ((bos + i_i * BC) * H + i_h) * K + o_k, mask=m_k & ((o_k * 0 + i_i * BC) < n), other=0.0)
    b_qg = tl.where(m_ik, b_q * tl.exp(b_g - b_gn[None, :]), 0.0).to(q.dtype.element_ty)
    a_base = A + (i_c * H + i_h) * BT * BT
    for j in range(0, i_i):
        r_j = j * BC + o_c
        off_j = ((bos + r_j) * H + i_h)[:, None] * K + o_k[None, :]
        m_jk = (r_j < n)[:, None] & m_k[None, :]
        b_k = tl.load(k + off_j, mask=m_jk, other=0.0).to(tl.float32)
        b_gj = tl.load(gc + off_j, mask=m_jk, other=0.0)
        b_kg = tl.where(m_jk, b_k * tl.exp(b_gn[None, :] - b_gj), 0.0).to(k.dtype.element_ty)
        b_A = tl.dot(b_qg, tl.trans(b_kg), input_precision=PREC)
        tl.store(a_base + r_i[:, None] * BT + r_j[None, :], b_A)
    # diagonal block: exp(gc_t - gc_s) per key dim, s <= t, one key at a time
    b_A = tl.zeros([BC, BC], dtype=tl.float32)
    for j in range(0, BC):
        s = i_i * BC + j
        m_s = (o_k * 0 + s) < n
        b_ks = tl.load(k + ((bos + s) * H + i_h) * K + o_k, mask=m_k & m_s, other=0.0).to(tl.float32)
        b_gs = tl.load(gc + ((bos + s) * H + i_h) * K + o_k, mask=m_k & m_s, other=0.0)
        keep = (o_c >= j)[:, None] & m_ik & m_s[None, :]
        b_e = tl.exp(tl.where(keep, b_g - b_gs[None, :], 0.0))
        col = tl.sum(tl.where(keep, b_q * b_ks[None, :] * b_e, 0.0), 1)
        b_A = tl.where(o_c[None, :] == j, col[:, None], b_A)
    tl.store(a_base + r_i[:, None] * BT + r_i[None, :], b_A)


@triton.jit
def _fwd_o(
    q, v, gc, h, A, o, s_bos, s_n,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    PREC: tl.constexpr, BV: tl.constexpr,
):
    """One program per (V block, chunk slot, head): o = (q exp(gc)) h + A v."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, n = tl.load(s_bos + i_c), tl.load(s_n + i_c)
    o_t, o_k = tl.arange(0, BT), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t, m_k, m_v = o_t < n, o_k < K, o_v < V
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    row = (bos + o_t) * H + i_h
    b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_g = tl.load(gc + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_qg = tl.where(m_tk, b_q.to(tl.float32) * tl.exp(b_g), 0.0).to(b_q.dtype)
    b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
    b_h = tl.load(h + (i_c * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :] & (o_k * 0 < n)[:, None], other=0.0)
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_A = tl.load(A + (i_c * H + i_h) * BT * BT + o_t[:, None] * BT + o_t[None, :], mask=causal, other=0.0)
    b_o = tl.dot(b_qg, b_h.to(b_q.dtype), input_precision=PREC)
    b_o += tl.dot(b_A.to(b_v.dtype), b_v, input_precision=PREC)
    tl.store(o + row[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


# ---------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------


@triton.jit
def _bwd_dh(
    q, do, gc, dh, dht, dh0, cu, ccu,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    USE_DHT: tl.constexpr, PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """Backwards over a segment's chunks: dh [NS, H, K, V] = gradient of the state at the end of
    each chunk, from the final state's gradient dht; the initial state's gradient into dh0."""
    i_k, i_v, i_sh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, i_h = i_sh // H, i_sh % H
    bos, eos = tl.load(cu + i_s), tl.load(cu + i_s + 1)
    c0 = tl.load(ccu + i_s)
    NT = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_sh * K * V + off_kv, mask=m_kv, other=0.0)
    for j in range(0, NT):
        i_t = NT - 1 - j
        tl.store(dh + ((c0 + i_t) * H + i_h) * K * V + off_kv, b_dh.to(dh.dtype.element_ty), mask=m_kv)
        tok = bos + i_t * BT + o_t
        m_t = tok < eos
        last = tl.minimum(bos + i_t * BT + BT, eos) - 1
        b_q = tl.load(q + (tok * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_do = tl.load(do + (tok * H + i_h)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                       other=0.0)
        b_g = tl.load(gc + (tok * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_qg = tl.where(m_t[:, None], b_q.to(tl.float32) * tl.exp(b_g), 0.0).to(b_q.dtype)
        b_dh = b_dh * tl.exp(b_gl)[:, None] + tl.dot(tl.trans(b_qg), b_do.to(b_q.dtype), input_precision=PREC)
    tl.store(dh0 + i_sh * K * V + off_kv, b_dh, mask=m_kv)


@triton.jit
def _bwd_dA(
    v, do, dA, s_bos, s_n,
    H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """dA[t, s] = do_t . v_s for s <= t (0 elsewhere), fp32 [NS, H, BT, BT]."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, n = tl.load(s_bos + i_c), tl.load(s_n + i_c)
    o_t = tl.arange(0, BT)
    m_t = o_t < n
    row = (bos + o_t) * H + i_h
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(b_v.dtype)
        b_dA += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
    b_dA = tl.where(o_t[:, None] >= o_t[None, :], b_dA, 0.0)
    tl.store(dA + (i_c * H + i_h) * BT * BT + o_t[:, None] * BT + o_t[None, :], b_dA)


@triton.jit
def _bwd_dv(
    k, gc, A, do, dh, dv, s_bos, s_n,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    PREC: tl.constexpr, BV: tl.constexpr,
):
    """dv_s = sum_{t >= s} A_ts do_t + (k_s exp(gc_last - gc_s)) dh."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, n = tl.load(s_bos + i_c), tl.load(s_n + i_c)
    o_t, o_k = tl.arange(0, BT), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t, m_k, m_v = o_t < n, o_k < K, o_v < V
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    row = (bos + o_t) * H + i_h
    last = bos + tl.maximum(n, 1) - 1
    b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_g = tl.load(gc + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=m_k & (o_k * 0 < n), other=0.0)
    b_kd = tl.where(m_tk, b_k.to(tl.float32) * tl.exp(b_gl[None, :] - b_g), 0.0).to(b_k.dtype)
    b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(b_k.dtype)
    b_dh = tl.load(dh + (i_c * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                   mask=m_k[:, None] & m_v[None, :] & (o_k * 0 < n)[:, None], other=0.0).to(b_k.dtype)
    # A^T [s, t]
    causal = (o_t[:, None] <= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_At = tl.load(A + (i_c * H + i_h) * BT * BT + o_t[None, :] * BT + o_t[:, None], mask=causal, other=0.0)
    b_dv = tl.dot(b_At.to(b_k.dtype), b_do, input_precision=PREC) + tl.dot(b_kd, b_dh, input_precision=PREC)
    tl.store(dv + row[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)


@triton.jit
def _bwd_intra(
    q, k, gc, dA, dq, dk, s_bos, s_n,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    NC: tl.constexpr, PREC: tl.constexpr,
):
    """Intra-chunk parts of dq, dk (fp32) for the rows of sub-chunk i:
    dq_t = sum_{s <= t} dA_ts k_s exp(gc_t - gc_s),  dk_s = sum_{t >= s} dA_ts q_t exp(gc_t - gc_s)."""
    i_c, i_i, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, n = tl.load(s_bos + i_c), tl.load(s_n + i_c)
    o_c, o_k = tl.arange(0, BC), tl.arange(0, BK)
    m_k = o_k < K
    r_i = i_i * BC + o_c
    m_i = r_i < n
    m_ik = m_i[:, None] & m_k[None, :]
    off_i = ((bos + r_i) * H + i_h)[:, None] * K + o_k[None, :]
    b_g = tl.load(gc + off_i, mask=m_ik, other=0.0)
    dA_base = dA + (i_c * H + i_h) * BT * BT
    # reference points: first row of sub-chunk i (for dq), its last valid row (for dk)
    b_gn = tl.load(gc + ((bos + i_i * BC) * H + i_h) * K + o_k, mask=m_k & ((o_k * 0 + i_i * BC) < n), other=0.0)
    r_last = tl.maximum(tl.minimum(i_i * BC + BC, n) - 1, 0)
    b_gr = tl.load(gc + ((bos + r_last) * H + i_h) * K + o_k, mask=m_k & (o_k * 0 < n), other=0.0)
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    for j in range(0, i_i):
        r_j = j * BC + o_c
        off_j = ((bos + r_j) * H + i_h)[:, None] * K + o_k[None, :]
        m_jk = (r_j < n)[:, None] & m_k[None, :]
        b_kj = tl.load(k + off_j, mask=m_jk, other=0.0).to(tl.float32)
        b_gj = tl.load(gc + off_j, mask=m_jk, other=0.0)
        b_kg = tl.where(m_jk, b_kj * tl.exp(b_gn[None, :] - b_gj), 0.0).to(k.dtype.element_ty)
        b_dAij = tl.load(dA_base + r_i[:, None] * BT + r_j[None, :]).to(k.dtype.element_ty)
        b_dq += tl.dot(b_dAij, b_kg, input_precision=PREC)
    b_dq = tl.where(m_ik, b_dq * tl.exp(b_g - b_gn[None, :]), 0.0)
    b_dk = tl.zeros([BC, BK], dtype=tl.float32)
    for j in range(i_i + 1, NC):
        r_j = j * BC + o_c
        off_j = ((bos + r_j) * H + i_h)[:, None] * K + o_k[None, :]
        m_jk = (r_j < n)[:, None] & m_k[None, :]
        b_qj = tl.load(q + off_j, mask=m_jk, other=0.0).to(tl.float32)
        b_gj = tl.load(gc + off_j, mask=m_jk, other=0.0)
        b_qg = tl.where(m_jk, b_qj * tl.exp(b_gj - b_gr[None, :]), 0.0).to(q.dtype.element_ty)
        b_dAji = tl.load(dA_base + r_j[None, :] * BT + r_i[:, None]).to(q.dtype.element_ty)  # [s in i, t in j]
        b_dk += tl.dot(b_dAji, b_qg, input_precision=PREC)
    b_dk = tl.where(m_ik, b_dk * tl.exp(b_gr[None, :] - b_g), 0.0)
    # diagonal block, one row j at a time: j as the key (for dq) and as the query (for dk)
    for j in range(0, BC):
        r = i_i * BC + j
        m_r = (o_k * 0 + r) < n
        m_rc = (o_c * 0 + r) < n
        off_r = ((bos + r) * H + i_h) * K + o_k
        b_kr = tl.load(k + off_r, mask=m_k & m_r, other=0.0).to(tl.float32)
        b_qr = tl.load(q + off_r, mask=m_k & m_r, other=0.0).to(tl.float32)
        b_gr_ = tl.load(gc + off_r, mask=m_k & m_r, other=0.0)
        col = tl.load(dA_base + r_i * BT + r, mask=m_i & m_rc, other=0.0)     # dA[t in i, s = r]
        rw = tl.load(dA_base + r * BT + r_i, mask=m_i & m_rc, other=0.0)      # dA[t = r, s in i]
        keep_q = (o_c >= j)[:, None] & m_ik & m_r[None, :]                             # t >= s = r
        e_q = tl.exp(tl.where(keep_q, b_g - b_gr_[None, :], 0.0))
        b_dq += tl.where(keep_q, col[:, None] * b_kr[None, :] * e_q, 0.0)
        keep_k = (o_c <= j)[:, None] & m_ik & m_r[None, :]                             # s <= t = r
        e_k = tl.exp(tl.where(keep_k, b_gr_[None, :] - b_g, 0.0))
        b_dk += tl.where(keep_k, rw[:, None] * b_qr[None, :] * e_k, 0.0)
    tl.store(dq + off_i, b_dq, mask=m_ik)
    tl.store(dk + off_i, b_dk, mask=m_ik)


@triton.jit
def _bwd_inter(
    q, k, v, gc, h, do, dh, dq_in, dk_in, dq, dk, dg, s_bos, s_n,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    PREC: tl.constexpr, BV: tl.constexpr,
):
    """Adds the inter-chunk parts to dq, dk and forms dg = revcumsum(q dq - k dk) + chunk-end terms."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, n = tl.load(s_bos + i_c), tl.load(s_n + i_c)
    o_t, o_k = tl.arange(0, BT), tl.arange(0, BK)
    m_t, m_k = o_t < n, o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    row = (bos + o_t) * H + i_h
    off = row[:, None] * K + o_k[None, :]
    last = bos + tl.maximum(n, 1) - 1
    b_q = tl.load(q + off, mask=m_tk, other=0.0)
    b_k = tl.load(k + off, mask=m_tk, other=0.0)
    b_g = tl.load(gc + off, mask=m_tk, other=0.0)
    b_gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=m_k & (o_k * 0 < n), other=0.0)
    b_dqi = tl.zeros([BT, BK], dtype=tl.float32)
    b_dki = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    hbase = (i_c * H + i_h) * K * V
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :] & (o_k * 0 < n)[:, None]
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(b_q.dtype)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(b_q.dtype)
        b_h = tl.load(h + hbase + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        b_dh = tl.load(dh + hbase + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
        b_dqi += tl.dot(b_do, tl.trans(b_h.to(b_q.dtype)), input_precision=PREC)
        b_dki += tl.dot(b_v, tl.trans(b_dh.to(b_q.dtype)), input_precision=PREC)
    b_dq = tl.load(dq_in + off, mask=m_tk, other=0.0) + tl.where(m_tk, b_dqi * tl.exp(b_g), 0.0)
    b_dkx = tl.where(m_tk, b_dki * tl.exp(b_gl[None, :] - b_g), 0.0)
    b_dk = tl.load(dk_in + off, mask=m_tk, other=0.0) + b_dkx
    qf, kf = b_q.to(tl.float32), b_k.to(tl.float32)
    b_x = b_hdh * tl.exp(b_gl) + tl.sum(kf * b_dkx, 0)
    b_dgam = tl.where(m_tk, qf * b_dq - kf * b_dk, 0.0)
    b_dg = tl.sum(b_dgam, 0)[None, :] - tl.cumsum(b_dgam, 0) + b_dgam + b_x[None, :]
    tl.store(dq + off, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + off, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + off, b_dg, mask=m_tk)


# ---------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------


def _slots(cu: Tensor, M: int, C: int):
    """Device-side chunk table. Returns (chunk offsets per segment ccu [S + 1], slot token starts
    [NS], slot valid-token counts [NS] (0 for unused slots), NS)."""
    S = cu.numel() - 1
    NS = M // C + S
    lens = cu[1:] - cu[:-1]
    nch = (lens + C - 1) // C
    ccu = torch.cat([nch.new_zeros(1), nch.cumsum(0)])
    j = torch.arange(NS, device=cu.device, dtype=ccu.dtype)
    seg = torch.searchsorted(ccu[1:].contiguous(), j, right=True).clamp_(max=max(S - 1, 0))
    it = j - ccu[seg]
    bos = cu[seg] + it * C
    n = (cu[seg + 1] - bos).clamp(0, C)
    n = torch.where(j < ccu[-1], n, torch.zeros_like(n))
    i32 = torch.int32
    return ccu.to(i32), bos.to(i32).contiguous(), n.to(i32).contiguous(), NS


def _states(k, v, gc, h0, cu, ccu, NS, C, state_dtype):
    M, H, K = k.shape
    V = v.shape[-1]
    S = cu.numel() - 1
    h = torch.empty((NS, H, K, V), device=k.device, dtype=state_dtype)
    ht = new_output((S, H, K, V), k.device)
    BK, BV = min(BK_H, _bs(K)), min(BV_H, _bs(V))
    _fwd_h[(triton.cdiv(K, BK), triton.cdiv(V, BV), S * H)](
        k, v, gc, h, h0, ht, cu, ccu, H, K, V, C, h0 is not None, dot_precision(k.dtype), BK, BV, num_warps=WARPS)
    return h, ht


class GLAVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, h0, cu, chunk_size, out_dtype):
        M, H, K = q.shape
        V = v.shape[-1]
        C = chunk_size
        S = cu.numel() - 1
        ccu, s_bos, s_n, NS = _slots(cu, M, C)
        BK = _bs(K)
        gc = torch.empty_like(g)
        _cumsum[(NS, H)](g, gc, s_bos, s_n, H, K, C, BK, num_warps=WARPS)
        sdt = torch.float32 if q.dtype == torch.float32 else q.dtype
        h, ht = _states(k, v, gc, h0, cu, ccu, NS, C, sdt)
        A = torch.empty((NS, H, C, C), device=q.device, dtype=torch.float32)
        _fwd_A[(NS, C // BC, H)](q, k, gc, A, s_bos, s_n, H, K, C, BC, BK, dot_precision(q.dtype), num_warps=WARPS)
        o = new_output((M, H, V), q.device, out_dtype)
        BV = min(BV_O, _bs(V))
        _fwd_o[(triton.cdiv(V, BV), NS, H)](q, v, gc, h, A, o, s_bos, s_n, H, K, V, C, BK, dot_precision(q.dtype), BV,
                                           num_warps=WARPS_WIDE)
        ctx.save_for_backward(q, k, v, gc, h0, cu, A, ccu, s_bos, s_n)
        ctx.C, ctx.NS, ctx.S = C, NS, S
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gc, h0, cu, A, ccu, s_bos, s_n = ctx.saved_tensors
        C, NS, S = ctx.C, ctx.NS, ctx.S
        M, H, K = q.shape
        V = v.shape[-1]
        prec = dot_precision(q.dtype)
        BK = _bs(K)
        sdt = torch.float32 if q.dtype == torch.float32 else q.dtype
        do = torch.zeros_like(v) if do is None else do.to(v.dtype).contiguous()
        if dht is not None:
            dht = dht.float().contiguous()
        h, _ = _states(k, v, gc, h0, cu, ccu, NS, C, sdt)
        dh = torch.empty((NS, H, K, V), device=q.device, dtype=sdt)
        dh0 = new_output((S, H, K, V), q.device)
        BKh, BVh = min(BK_H, _bs(K)), min(BV_H, _bs(V))
        _bwd_dh[(triton.cdiv(K, BKh), triton.cdiv(V, BVh), S * H)](
            q, do, gc, dh, dht, dh0, cu, ccu, H, K, V, C, dht is not None, prec, BKh, BVh, num_warps=WARPS)
        BV = min(BV_O, _bs(V))
        dA = torch.empty((NS, H, C, C), device=q.device, dtype=torch.float32)
        _bwd_dA[(NS, H)](v, do, dA, s_bos, s_n, H, V, C, BV, prec, num_warps=WARPS)
        dv = new_output(v.shape, v.device, v.dtype)
        _bwd_dv[(triton.cdiv(V, BV), NS, H)](k, gc, A, do, dh, dv, s_bos, s_n, H, K, V, C, BK, prec, BV,
                                            num_warps=WARPS_WIDE)
        dq_in = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        dk_in = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        _bwd_intra[(NS, C // BC, H)](q, k, gc, dA, dq_in, dk_in, s_bos, s_n, H, K, C, BC, BK, C // BC, prec,
                                     num_warps=WARPS)
        dq, dk = new_output(q.shape, q.device, q.dtype), new_output(k.shape, k.device, k.dtype)
        dg = new_output(q.shape, q.device)
        _bwd_inter[(NS, H)](q, k, v, gc, h, do, dh, dq_in, dk_in, dq, dk, dg, s_bos, s_n, H, K, V, C, BK, prec, BV,
                            num_warps=WARPS_WIDE)
        return dq, dk, dv, dg, (dh0 if h0 is not None else None), None, None, None


def gla_varlen_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, cu_seqlens: Tensor,
                      initial_state: Tensor | None = None, chunk_size: int = 64,
                      out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Chunked GLA over packed variable-length segments on the Triton kernels, same contract as
    `gla_varlen` (differentiable in q, k, v, g and the initial states; no host synchronisation).

    q, k, g: [M, H, K], v: [M, H, V] (q's dtype is the compute dtype of the dots: bf16 / fp16 /
    fp32), cu_seqlens: [S + 1] on the device, initial_state: [S, H, K, V]. K, V <= 128; chunk_size
    a power of two, 16..64. Returns (o [M, H, V] in `out_dtype` (default q's dtype), final states
    [S, H, K, V] fp32)."""
    M, H, K = q.shape
    V = v.shape[-1]
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    if K > 128 or V > 256:
        raise ValueError(f"head dims up to K = 128, V = 256 are supported; got K = {K}, V = {V}")
    dt = q.dtype
    S = cu_seqlens.numel() - 1
    q, k, v = q.contiguous(), k.to(dt).contiguous(), v.to(dt).contiguous()
    g = g.float().contiguous()
    cu = cu_seqlens.to(torch.int32).contiguous()
    h0 = None
    if initial_state is not None:
        if initial_state.shape != (S, H, K, V):
            raise ValueError(f"initial_state must be [S={S}, H={H}, K={K}, V={V}]; got {list(initial_state.shape)}")
        h0 = initial_state.float().contiguous()
    return GLAVarlen.apply(q, k, v, g, h0, cu, chunk_size, out_dtype or dt)
