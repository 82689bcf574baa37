"""The Triton kernels of `window_attention` (sliding-window softmax attention with attention sinks over
causal rows, module `window_attention.py`), forward and backward, in the manner of flash attention:
online softmax in fp32 over key tiles, nothing of size [T, T] or [T, W] in memory.

Query t of a row sees key j when j <= t and (t - j < W or j < SINKS) (the index is the position). A
query tile [m0, m0 + BM) reads two key ranges: the sinks [0, SINKS), counted only where t - j >= W (the
window counts the rest), and the window [m0 - W + 1, m0 + BM). Kernels:
  `window_fwd`   o [B, T, HQ, D] and the log-sum-exp [B, HQ, T] (fp32) of every query row;
  `window_bwd_dq`  dq over the same tiles, and each query row's delta = rowsum(do o) for the kernels after it;
  `window_bwd_dkdv`  dk, dv of a key tile [n0, n0 + BN) from the queries whose window holds it
                  (t in [n0, n0 + BN + W - 1)), the G query heads of its KV head in one program (no atomics);
  `window_bwd_sinks`  the sinks' dk, dv from the queries past their window, per chunk of queries,
                  summed over chunks and heads by the caller;
  `window_step_fwd`  a static cache's one-token step (`window_attention.window_step`): the new key /
                  value written into the window's ring (and the sinks), the G query heads of a KV head
                  attending over both in one program;
  `fresh_ring_fill`  a first call's ring and sinks (`window_attention.fresh_ring`): the last W keys /
                  values into their slots, the first ones into the sinks, the slots' positions, one
                  program a (row, KV head).
fp32 accumulation everywhere (the dots are `spla.triton_common.mm`); 16-bit operands on the tensor cores,
fp32 ones exact ("ieee") or TF32.
"""

from __future__ import annotations

import torch

from .spla.triton_common import NEG, mm
from .triton_launch import jit
from .triton_utils import block_size, cdiv
from .utils import import_triton, new_output

triton, tl = import_triton()

#: Query rows / key columns of a tile.
BM = 64
BN = 64
#: Query tiles of one program of the sinks' backward.
SINK_TILES = 8


def _warps(BD: int) -> int:
    return 4 if BD <= 64 else 8


@jit
def _tile(P, s_t, rows, n_rows, cols, D: tl.constexpr):
    """The [len(rows), BD] tile of rows `rows` (< n_rows) of a [T, D] matrix at P with row stride s_t."""
    m = (rows < n_rows)[:, None] & (cols < D)[None, :]
    return tl.load(P + rows.to(tl.int64)[:, None] * s_t + cols[None, :], mask=m, other=0.0)


@jit
def _heads(i_bh, Q, K, V, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, HQ: tl.constexpr, G: tl.constexpr):
    """Batch row, query head and the bases of its q and of its KV head's k, v, for program i_bh."""
    b, h = i_bh // HQ, i_bh % HQ
    kh = h // G
    bb = b.to(tl.int64)
    return b, h, Q + bb * s_qb + h * s_qh, K + bb * s_kb + kh * s_kh, V + bb * s_vb + kh * s_vh


@jit
def _kv(Kp, Vp, s_kt, s_vt, keys, n_rows, cols, D: tl.constexpr):
    """The k and v tiles of `keys` (< n_rows)."""
    return _tile(Kp, s_kt, keys, n_rows, cols, D), _tile(Vp, s_vt, keys, n_rows, cols, D)


@jit
def _query_tile(i_m, Qp, s_qt, T, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, W: tl.constexpr):
    """Query tile i_m: its rows, the head-dim columns, its q tile and the range [lo, hi) of the window's keys."""
    m0 = i_m * BM
    rows = m0 + tl.arange(0, BM)
    cols = tl.arange(0, BD)
    return rows, cols, _tile(Qp, s_qt, rows, T, cols, D), tl.maximum(m0 - W + 1, 0), tl.minimum(m0 + BM, T)


@jit
def _sees_sink(rows, keys, SINKS: tl.constexpr, W: tl.constexpr):
    """Which sink keys each query row counts as sinks: those W or more positions back (the window counts the rest)."""
    return (keys < SINKS)[None, :] & (rows[:, None] - keys[None, :] >= W)


@jit
def _sees_in_window(rows, keys, W: tl.constexpr):
    """Which keys each query row sees through its window: 0 <= t - j < W."""
    d = rows[:, None] - keys[None, :]
    return (d >= 0) & (d < W)


@jit
def _online_softmax(q, k, v, ok, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """One key tile of the online softmax: the running max m_i, sum l_i and output acc [BM, BD] after the
    keys where `ok`."""
    s = tl.where(ok, mm(q, tl.trans(k), IEEE) * scale, NEG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.where(ok, tl.exp(s - m_new[:, None]), 0.0)
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + mm(p, v, IEEE)


@jit
def window_fwd(Q, K, V, OUT, LSE, T, scale,
               s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_ob, s_ot, s_oh,
               HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, W: tl.constexpr,
               SINKS: tl.constexpr, SP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    b, h, Qp, Kp, Vp = _heads(i_bh, Q, K, V, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, HQ, G)
    rows, cols, q, lo, hi = _query_tile(i_m, Qp, s_qt, T, D, BD, BM, W)
    m_i = tl.full([BM], NEG, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    if SINKS > 0:  # the sinks, where they are W or more positions back (own names: the loop's differ in shape)
        sink = tl.arange(0, SP)
        sk, sv = _kv(Kp, Vp, s_kt, s_vt, sink, T, cols, D)
        m_i, l_i, acc = _online_softmax(q, sk, sv, _sees_sink(rows, sink, SINKS, W), m_i, l_i, acc, scale, IEEE)
    for n0 in range(lo, hi, BN):
        keys = n0 + tl.arange(0, BN)
        k, v = _kv(Kp, Vp, s_kt, s_vt, keys, hi, cols, D)
        ok = _sees_in_window(rows, keys, W) & (keys < hi)[None, :]
        m_i, l_i, acc = _online_softmax(q, k, v, ok, m_i, l_i, acc, scale, IEEE)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    Op = OUT + b.to(tl.int64) * s_ob + h * s_oh
    tl.store(Op + rows.to(tl.int64)[:, None] * s_ot + cols[None, :], o.to(OUT.dtype.element_ty),
             mask=(rows < T)[:, None] & (cols < D)[None, :])
    tl.store(LSE + i_bh.to(tl.int64) * T + rows, m_i + tl.log(l_safe), mask=rows < T)


@jit
def _scores_grad(q, k, v, do, lse, delta, rows, keys, ok, scale, IEEE: tl.constexpr):
    """For a [BM] x [BN] tile: p (the softmax weights, 0 where not `ok`) and ds = p * (dp - delta)."""
    s = mm(q, tl.trans(k), IEEE) * scale
    p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
    dp = mm(do, tl.trans(v), IEEE)
    return p, p * (dp - delta[:, None])


@jit
def window_bwd_dq(Q, K, V, DO, OUT, LSE, DELTA, DQ, T, scale,
                  s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_ob, s_ot, s_oh, s_pb, s_pt, s_ph,
                  s_db, s_dh, s_dt,
                  HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, W: tl.constexpr,
                  SINKS: tl.constexpr, SP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    """dq of a query tile, and its rows' delta = rowsum(do o) [B, HQ, T] (fp32), stored for the
    kernels after it."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    b, h, Qp, Kp, Vp = _heads(i_bh, Q, K, V, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, HQ, G)
    rows, cols, q, lo, hi = _query_tile(i_m, Qp, s_qt, T, D, BD, BM, W)
    do = _tile(DO + b.to(tl.int64) * s_ob + h * s_oh, s_ot, rows, T, cols, D)
    o = _tile(OUT + b.to(tl.int64) * s_pb + h * s_ph, s_pt, rows, T, cols, D)
    lse = tl.load(LSE + i_bh.to(tl.int64) * T + rows, mask=rows < T, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DELTA + i_bh.to(tl.int64) * T + rows, delta, mask=rows < T)
    dq = tl.zeros([BM, BD], tl.float32)
    if SINKS > 0:  # own names: the loop's differ in shape
        sink = tl.arange(0, SP)
        sk, sv = _kv(Kp, Vp, s_kt, s_vt, sink, T, cols, D)
        sok = _sees_sink(rows, sink, SINKS, W) & (rows < T)[:, None]
        sp, sds = _scores_grad(q, sk, sv, do, lse, delta, rows, sink, sok, scale, IEEE)
        dq += mm(sds, sk, IEEE)
    for n0 in range(lo, hi, BN):
        keys = n0 + tl.arange(0, BN)
        k, v = _kv(Kp, Vp, s_kt, s_vt, keys, hi, cols, D)
        ok = _sees_in_window(rows, keys, W) & (keys < hi)[None, :] & (rows < T)[:, None]
        p, ds = _scores_grad(q, k, v, do, lse, delta, rows, keys, ok, scale, IEEE)
        dq += mm(ds, k, IEEE)
    tl.store(DQ + b.to(tl.int64) * s_db + h * s_dh + rows.to(tl.int64)[:, None] * s_dt + cols[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=(rows < T)[:, None] & (cols < D)[None, :])


@jit
def window_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, T, scale,
                    s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_ob, s_ot, s_oh,
                    HQ: tl.constexpr, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                    W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    """dk, dv [B, H, T, D] fp32 of a key tile from the queries that see it through the window."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    b, kh = i_bh // H, i_bh % H
    n0 = i_n * BN
    keys = n0 + tl.arange(0, BN)
    cols = tl.arange(0, BD)
    k, v = _kv(K + b.to(tl.int64) * s_kb + kh * s_kh, V + b.to(tl.int64) * s_vb + kh * s_vh, s_kt, s_vt, keys, T,
               cols, D)
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BD], tl.float32)
    hi = tl.minimum(n0 + BN + W - 1, T)
    for g in range(G):
        h = kh * G + g
        Qp = Q + b.to(tl.int64) * s_qb + h * s_qh
        DOp = DO + b.to(tl.int64) * s_ob + h * s_oh
        base = (b * HQ + h).to(tl.int64) * T
        for m0 in range(n0, hi, BM):
            rows = m0 + tl.arange(0, BM)
            q = _tile(Qp, s_qt, rows, hi, cols, D)
            do = _tile(DOp, s_ot, rows, hi, cols, D)
            lse = tl.load(LSE + base + rows, mask=rows < hi, other=0.0)
            delta = tl.load(DELTA + base + rows, mask=rows < hi, other=0.0)
            ok = _sees_in_window(rows, keys, W) & (rows < hi)[:, None] & (keys < T)[None, :]
            p, ds = _scores_grad(q, k, v, do, lse, delta, rows, keys, ok, scale, IEEE)
            dv += mm(tl.trans(p), do, IEEE)
            dk += mm(tl.trans(ds), q, IEEE)
    off = (i_bh.to(tl.int64) * T + keys)[:, None] * D + cols[None, :]
    m = (keys < T)[:, None] & (cols < D)[None, :]
    tl.store(DK + off, dk * scale, mask=m)
    tl.store(DV + off, dv, mask=m)


@jit
def window_bwd_sinks(Q, K, V, DO, LSE, DELTA, DKS, DVS, T, scale,
                     s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_ob, s_ot, s_oh,
                     HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, W: tl.constexpr,
                     SINKS: tl.constexpr, SP: tl.constexpr, BM: tl.constexpr, TILES: tl.constexpr,
                     IEEE: tl.constexpr):
    """The sinks' dk, dv [chunks, B, HQ, SP, D] fp32 from the queries of one chunk of TILES query tiles
    that see them past their window."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    b, h, Qp, Kp, Vp = _heads(i_bh, Q, K, V, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, HQ, G)
    keys = tl.arange(0, SP)
    cols = tl.arange(0, BD)
    k, v = _kv(Kp, Vp, s_kt, s_vt, keys, T, cols, D)
    DOp = DO + b.to(tl.int64) * s_ob + h * s_oh
    base = i_bh.to(tl.int64) * T
    dk = tl.zeros([SP, BD], tl.float32)
    dv = tl.zeros([SP, BD], tl.float32)
    for i in range(TILES):
        rows = (i_c * TILES + i) * BM + tl.arange(0, BM)
        q = _tile(Qp, s_qt, rows, T, cols, D)
        do = _tile(DOp, s_ot, rows, T, cols, D)
        lse = tl.load(LSE + base + rows, mask=rows < T, other=0.0)
        delta = tl.load(DELTA + base + rows, mask=rows < T, other=0.0)
        ok = _sees_sink(rows, keys, SINKS, W) & (rows < T)[:, None]
        p, ds = _scores_grad(q, k, v, do, lse, delta, rows, keys, ok, scale, IEEE)
        dv += mm(tl.trans(p), do, IEEE)
        dk += mm(tl.trans(ds), q, IEEE)
    off = ((i_c * tl.num_programs(1) + i_bh).to(tl.int64) * SP + keys)[:, None] * D + cols[None, :]
    m = (cols < D)[None, :] & (keys < SP)[:, None]
    tl.store(DKS + off, dk * scale, mask=m)
    tl.store(DVS + off, dv, mask=m)


@jit
def _group_queries(Q, bb, h, s_qb, s_qh, heads, cols, G: tl.constexpr, D: tl.constexpr):
    """The one-token queries [BG, BD] of the G query heads of KV head h (row bb), 0 past G and D."""
    return tl.load(Q + bb * s_qb + (h * G + heads)[:, None] * s_qh + cols[None, :],
                   mask=(heads < G)[:, None] & (cols < D)[None, :], other=0.0)


@jit
def _store_group(OUT, bb, h, s_ob, s_oh, heads, cols, o, G: tl.constexpr, D: tl.constexpr):
    """Store the outputs o [BG, BD] of the G query heads of KV head h (row bb) in OUT's dtype."""
    tl.store(OUT + bb * s_ob + (h * G + heads)[:, None] * s_oh + cols[None, :], o.to(OUT.dtype.element_ty),
             mask=(heads < G)[:, None] & (cols < D)[None, :])


@jit
def _step_keys(kn, vn, pos, Kp, Vp, Pp, s_kt, s_vt, rows, n_rows, cols, at, D: tl.constexpr):
    """A window step's key tile `rows` (< n_rows) of a ring or of the sinks, with row `at` holding the new
    key / value / position (from registers: the buffer's row may be written by now): k, v, positions."""
    k, v = _kv(Kp, Vp, s_kt, s_vt, rows, n_rows, cols, D)
    new = rows == at
    k = tl.where(new[:, None], kn[None, :], k)
    v = tl.where(new[:, None], vn[None, :], v)
    return k, v, tl.where(new, pos, tl.load(Pp + rows, mask=rows < n_rows, other=-1))


@jit
def window_step_fwd(Q, K, V, RK, RV, RP, SK, SV, SPOS, POS, OUT, scale, s_pos,
                    s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_rkb, s_rkh, s_rkt, s_rvb, s_rvh, s_rvt, s_rpb,
                    s_skb, s_skh, s_skt, s_svb, s_svh, s_svt, s_spb, s_ob, s_oh,
                    H: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                    W: tl.constexpr, BW: tl.constexpr, SINKS: tl.constexpr, SP: tl.constexpr, IEEE: tl.constexpr):
    """One program per (row b, KV head h): the new key / value of q's token (position POS[b]) go into
    ring slot pos % W (and sink slot pos while pos < SINKS), and the G query heads of the group attend
    over the ring's keys 0 <= pos - j < W and the sinks W or more back."""
    i = tl.program_id(0)
    b, h = i // H, i % H
    bb = b.to(tl.int64)
    pos = tl.load(POS + bb * s_pos)
    cols = tl.arange(0, BD)
    heads = tl.arange(0, BG)
    q = _group_queries(Q, bb, h, s_qb, s_qh, heads, cols, G, D)
    kn = tl.load(K + bb * s_kb + h * s_kh + cols, mask=cols < D, other=0.0)
    vn = tl.load(V + bb * s_vb + h * s_vh + cols, mask=cols < D, other=0.0)
    Kp, Vp, Pp = RK + bb * s_rkb + h * s_rkh, RV + bb * s_rvb + h * s_rvh, RP + bb * s_rpb
    slot = pos % W
    m_i = tl.full([BG], NEG, tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    for n0 in range(0, W, BW):
        rows = n0 + tl.arange(0, BW)
        k, v, kp = _step_keys(kn, vn, pos, Kp, Vp, Pp, s_rkt, s_rvt, rows, W, cols, slot, D)
        back = pos - kp
        ok = (kp >= 0) & (back >= 0) & (back < W) & (rows < W)
        m_i, l_i, acc = _online_softmax(q, k, v, ok[None, :], m_i, l_i, acc, scale, IEEE)
    tl.store(Kp + slot * s_rkt + cols, kn.to(RK.dtype.element_ty), mask=cols < D)
    tl.store(Vp + slot * s_rvt + cols, vn.to(RV.dtype.element_ty), mask=cols < D)
    tl.store(Pp + slot, pos, mask=h == 0)
    if SINKS > 0:  # the sinks, where they are W or more positions back; the first SINKS tokens are written there
        Kp, Vp, Pp = SK + bb * s_skb + h * s_skh, SV + bb * s_svb + h * s_svh, SPOS + bb * s_spb
        rows = tl.arange(0, SP)
        sk, sv, sp = _step_keys(kn, vn, pos, Kp, Vp, Pp, s_skt, s_svt, rows, SINKS, cols, pos, D)
        back = pos - sp
        ok = (sp >= 0) & (back >= W) & (rows < SINKS)
        m_i, l_i, acc = _online_softmax(q, sk, sv, ok[None, :], m_i, l_i, acc, scale, IEEE)
        if pos < SINKS:
            tl.store(Kp + pos * s_skt + cols, kn.to(SK.dtype.element_ty), mask=cols < D)
            tl.store(Vp + pos * s_svt + cols, vn.to(SV.dtype.element_ty), mask=cols < D)
            tl.store(Pp + pos, pos, mask=h == 0)
    _store_group(OUT, bb, h, s_ob, s_oh, heads, cols, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], G, D)


def window_step_triton(q, k, v, ring_k, ring_v, ring_pos, sink_k, sink_v, sink_pos, position, window: int,
                       scale: float, ieee: bool) -> torch.Tensor:
    """`window_attention.window_step` on the kernel (its checks done by the caller): o [B, HQ, 1, D]."""
    B, HQ, _, D = q.shape
    H = k.shape[1]
    sinks = 0 if sink_k is None else sink_k.shape[2]
    if not sinks:  # the kernel reads no sinks: any tensors of the right kind stand in
        sink_k, sink_v, sink_pos = ring_k, ring_v, ring_pos
    o = new_output((B, HQ, 1, D), q.device, q.dtype)
    G, BD = HQ // H, block_size(D)
    BW = min(block_size(window), max(16, 8192 // BD))
    window_step_fwd[(B * H,)](
        q, k, v, ring_k, ring_v, ring_pos, sink_k, sink_v, sink_pos, position, o, scale, position.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *_strides(ring_k),
        *_strides(ring_v), ring_pos.stride(0), *_strides(sink_k), *_strides(sink_v), sink_pos.stride(0),
        o.stride(0), o.stride(1), H, G, block_size(G), D, BD, window, BW, sinks, _sink_pad(sinks), ieee,
        num_warps=_warps(BD))
    return o


@jit
def _copy_rows(Kp, Vp, s_kt, s_vt, src, real, OK, OV, dst, keep, cols, D: tl.constexpr):
    """Rows src of a head's keys / values (zeros where not `real`) into rows dst of OK / OV (D wide, where
    `keep`)."""
    load = real[:, None] & (cols < D)[None, :]
    k = tl.load(Kp + src[:, None] * s_kt + cols[None, :], mask=load, other=0.0)
    v = tl.load(Vp + src[:, None] * s_vt + cols[None, :], mask=load, other=0.0)
    out = dst[:, None] * D + cols[None, :]
    store = keep[:, None] & (cols < D)[None, :]
    tl.store(OK + out, k.to(OK.dtype.element_ty), mask=store)
    tl.store(OV + out, v.to(OV.dtype.element_ty), mask=store)


@jit
def fresh_ring_fill(K, V, RK, RV, RP, SK, SV, SPOS, T, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt,
                    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
                    SINKS: tl.constexpr, SP: tl.constexpr):
    """Row b, KV head h of `fresh_ring`: ring slot s takes the position p in [T - W, T) with p % W = s
    (T >= W), else token s while s < T (zeros and position -1 after); sink slot j takes token j while
    j < T. The positions are written by the programs of head 0."""
    i_bh = tl.program_id(0)
    b, h = i_bh // H, i_bh % H
    cols = tl.arange(0, BD)
    Kp = K + b.to(tl.int64) * s_kb + h * s_kh
    Vp = V + b.to(tl.int64) * s_vb + h * s_vh
    full = T >= W
    for s0 in range(0, W, BW):
        s = s0 + tl.arange(0, BW)
        src = tl.where(full, T - W + (s + W - T % W) % W, s).to(tl.int64)
        real = (s < W) & (src < T)
        _copy_rows(Kp, Vp, s_kt, s_vt, src, real, RK, RV, i_bh.to(tl.int64) * W + s, s < W, cols, D)
        if h == 0:
            tl.store(RP + b.to(tl.int64) * W + s, tl.where(real, src, -1), mask=s < W)
    if SINKS > 0:
        j = tl.arange(0, SP)
        real = (j < SINKS) & (j < T)
        _copy_rows(Kp, Vp, s_kt, s_vt, j.to(tl.int64), real, SK, SV, i_bh.to(tl.int64) * SINKS + j, j < SINKS,
                   cols, D)
        if h == 0:
            tl.store(SPOS + b.to(tl.int64) * SINKS + j, tl.where(real, j, -1).to(tl.int64), mask=j < SINKS)


def fresh_ring_triton(k: torch.Tensor, v: torch.Tensor, window: int, sinks: int) -> tuple:
    """`window_attention.fresh_ring` on the kernel (its checks done by the caller): one launch."""
    B, H, T, D = k.shape
    dev = k.device
    ring_k, ring_v = new_output((B, H, window, D), dev, k.dtype), new_output((B, H, window, D), dev, v.dtype)
    ring_pos = new_output((B, window), dev, torch.int64)
    if sinks:
        sink_k, sink_v = new_output((B, H, sinks, D), dev, k.dtype), new_output((B, H, sinks, D), dev, v.dtype)
        sink_pos = new_output((B, sinks), dev, torch.int64)
    else:  # the kernel writes no sinks: the ring's tensors stand in
        sink_k, sink_v, sink_pos = ring_k, ring_v, ring_pos
    BD = block_size(D)
    BW = min(block_size(window), max(16, 8192 // BD))
    fresh_ring_fill[(B * H,)](k, v, ring_k, ring_v, ring_pos, sink_k, sink_v, sink_pos, T, k.stride(0), k.stride(1),
                              k.stride(2), v.stride(0), v.stride(1), v.stride(2), H, D, BD, window, BW, sinks,
                              _sink_pad(sinks), num_warps=4)
    if not sinks:
        return ring_k, ring_v, ring_pos, None, None, None
    return ring_k, ring_v, ring_pos, sink_k, sink_v, sink_pos


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _sink_pad(sinks: int) -> int:
    return block_size(max(sinks, 1))


class WindowAttention(torch.autograd.Function):
    """o [B, T, HQ, D] = `window_attention` of q [B, HQ, T, D], k, v [B, H, T, D] (unit stride in D)."""

    @staticmethod
    def forward(ctx, q, k, v, window: int, sinks: int, scale: float, ieee: bool):
        B, HQ, T, D = q.shape
        H = k.shape[1]
        o = new_output((B, T, HQ, D), q.device, q.dtype)
        lse = new_output((B, HQ, T), q.device)
        BD, SP = block_size(D), _sink_pad(sinks)
        window_fwd[(cdiv(T, BM), B * HQ)](
            q, k, v, o, lse, T, scale, *_strides(q), *_strides(k), *_strides(v), o.stride(0), o.stride(1),
            o.stride(2), HQ, HQ // H, D, BD, window, sinks, SP, BM, BN, ieee, num_warps=_warps(BD))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.window, ctx.sinks, ctx.scale, ctx.ieee = window, sinks, scale, ieee
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        W, sinks, scale, ieee = ctx.window, ctx.sinks, ctx.scale, ctx.ieee
        B, HQ, T, D = q.shape
        H = k.shape[1]
        G, BD, SP = HQ // H, block_size(D), _sink_pad(sinks)
        do = do.to(q.dtype)
        if do.stride(-1) != 1:
            do = do.contiguous()
        delta = new_output((B, HQ, T), q.device)  # rowsum(do o), written by the dq kernel
        dq = torch.empty_like(q)
        strides = (*_strides(q), *_strides(k), *_strides(v), do.stride(0), do.stride(1), do.stride(2))
        window_bwd_dq[(cdiv(T, BM), B * HQ)](
            q, k, v, do, o, lse, delta, dq, T, scale, *strides, o.stride(0), o.stride(1), o.stride(2), *_strides(dq),
            HQ, G, D, BD, W, sinks, SP, BM, BN, ieee, num_warps=_warps(BD))
        dk = new_output((B, H, T, D), q.device)
        dv = new_output((B, H, T, D), q.device)
        window_bwd_dkdv[(cdiv(T, BN), B * H)](
            q, k, v, do, lse, delta, dk, dv, T, scale, *strides, HQ, H, G, D, BD, W, BM, BN, ieee, num_warps=_warps(BD))
        if sinks and T > W:
            chunks = cdiv(T, BM * SINK_TILES)
            dks = new_output((chunks, B, HQ, SP, D), q.device)
            dvs = new_output((chunks, B, HQ, SP, D), q.device)
            window_bwd_sinks[(chunks, B * HQ)](
                q, k, v, do, lse, delta, dks, dvs, T, scale, *strides, HQ, G, D, BD, W, sinks, SP, BM, SINK_TILES,
                ieee, num_warps=_warps(BD))
            n = min(sinks, T)
            # the chunks' and a KV head's query heads' sums in one reduction each
            dk[:, :, :n] += dks.view(chunks, B, H, G, SP, D).sum((0, 3))[:, :, :n]
            dv[:, :, :n] += dvs.view(chunks, B, H, G, SP, D).sum((0, 3))[:, :, :n]
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
