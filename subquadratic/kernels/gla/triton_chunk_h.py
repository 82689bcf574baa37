"""The state walk of the chunked linear-attention kernels, forward and backward, one kernel each
for every decay kind (see `triton_chunk.py` for the op):

    S_t = decay_t S_{t-1} + k_t^T v_t        per sequence and KV head, from its initial state

`chunk_fwd_h`: one program per (K block, V block, sequence x KV head) walks the sequence's chunks
in order, stores the state before each chunk, h [NC, H, K, V] (chunk c of the chunk list), and the
final state [N, H, K, V] (fp32; the walk accumulates in fp32 whatever h is stored in).
`chunk_bwd_dh`: walks them backwards: dh [NC, H, K, V] = the gradient of the state at the end of
each chunk, starting from the final state's gradient, summed over the G query heads that read the
KV head; the initial state's gradient at the end.

Decay kinds, the constexpr DECAY: 0 none, 1 one log decay per (token, KV head) (gc [M, H]), 2 one
per (token, KV head, key dim) (gc [M, H, K]); gc is the in-chunk cumulative sum of the log decays
(<= 0, non-increasing inside a chunk), so every exponent below is <= 0: exp(gc_last - gc_t) for a
key's decay to the chunk end, exp(gc_t) for a query's decay from the chunk start, exp(gc_last) for
the state across the chunk.

Sequences: packed tokens [M, heads, dim]; dense inputs (IS_VARLEN False) are B sequences of T
tokens (chunk c = (b, c % NT)), varlen ones are cut by `cu` [N + 1] with `ccu` [N + 1] the first
chunk of each sequence (`seq_bounds`, `chunk_bounds`: no host synchronisation either way).
"""

from __future__ import annotations

from ..triton_utils import autotune
from ..utils import import_triton

triton, tl = import_triton()

#: (BK, BV, warps, stages) the walks are autotuned over on the GPU.
CONFIGS = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (32, 64, 4, 3), (32, 32, 4, 2), (32, 32, 2, 3),
           (64, 64, 8, 2)]
KEY = ["K", "V", "BT", "G", "DECAY", "PREC"]


@triton.jit
def seq_bounds(cu, ccu, i_n, T, NT, IS_VARLEN: tl.constexpr):
    """(first token, end token, first chunk) of sequence i_n."""
    if IS_VARLEN:
        bos = tl.load(cu + i_n)
        eos = tl.load(cu + i_n + 1)
        c0 = tl.load(ccu + i_n)
    else:
        bos = i_n * T
        eos = bos + T
        c0 = i_n * NT
    return bos, eos, c0


@triton.jit
def chunk_bounds(s_bos, s_n, i_c, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first token, valid tokens) of chunk i_c; varlen chunk slots past the last chunk have 0."""
    if IS_VARLEN:
        bos = tl.load(s_bos + i_c)
        n = tl.load(s_n + i_c)
    else:
        i_t = i_c % NT
        bos = (i_c // NT) * T + i_t * BT
        n = tl.minimum(T - i_t * BT, BT)
    return bos, n


@autotune(CONFIGS, KEY)
@triton.jit
def chunk_fwd_h(
    k, v, gc, h, h0, ht, cu, ccu, T, NT,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, c0 = seq_bounds(cu, ccu, i_n, T, NT, IS_VARLEN)
    nt = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0)
    for i_t in range(0, nt):
        tl.store(h + ((c0 + i_t) * H + i_h).to(tl.int64) * K * V + off_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        tok = (bos + i_t * BT + o_t).to(tl.int64)
        m_t = tok < eos
        m_tk = m_t[:, None] & m_k[None, :]
        last = tl.minimum(bos + i_t * BT + BT, eos) - 1
        row = tok * H + i_h
        b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        if DECAY == 1:
            b_g = tl.load(gc + row, mask=m_t, other=0.0)
            b_gl = tl.load(gc + last.to(tl.int64) * H + i_h)
            b_k = tl.where(m_tk, b_k.to(tl.float32) * tl.exp(b_gl - b_g)[:, None], 0.0).to(b_k.dtype)
            b_h *= tl.exp(b_gl)
        elif DECAY == 2:
            b_g = tl.load(gc + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_gl = tl.load(gc + (last.to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.0)
            b_k = tl.where(m_tk, b_k.to(tl.float32) * tl.exp(b_gl[None, :] - b_g), 0.0).to(b_k.dtype)
            b_h *= tl.exp(b_gl)[:, None]
        b_h += tl.dot(tl.trans(b_k), b_v.to(b_k.dtype), input_precision=PREC)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + off_kv, b_h, mask=m_kv)


@autotune(CONFIGS, KEY)
@triton.jit
def chunk_bwd_dh(
    q, do, gc, dh, dht, dh0, cu, ccu, T, NT,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, c0 = seq_bounds(cu, ccu, i_n, T, NT, IS_VARLEN)
    nt = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_nh.to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0)
    for j in range(0, nt):
        i_t = nt - 1 - j
        tl.store(dh + ((c0 + i_t) * H + i_h).to(tl.int64) * K * V + off_kv, b_dh.to(dh.dtype.element_ty),
                 mask=m_kv)
        tok = (bos + i_t * BT + o_t).to(tl.int64)
        m_t = tok < eos
        m_tk = m_t[:, None] & m_k[None, :]
        last = tl.minimum(bos + i_t * BT + BT, eos) - 1
        row = tok * H + i_h
        if DECAY == 1:
            b_e = tl.exp(tl.load(gc + row, mask=m_t, other=0.0))[:, None]
            b_dh *= tl.exp(tl.load(gc + last.to(tl.int64) * H + i_h))
        elif DECAY == 2:
            b_e = tl.exp(tl.load(gc + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0))
            b_dh *= tl.exp(tl.load(gc + (last.to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.0))[:, None]
        for i_g in range(0, G):  # the query heads of this KV head
            row_q = tok * (H * G) + i_h * G + i_g
            b_q = tl.load(q + row_q[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_do = tl.load(do + row_q[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
            if DECAY != 0:
                b_q = tl.where(m_tk, b_q.to(tl.float32) * b_e, 0.0).to(b_do.dtype)
            b_dh += tl.dot(tl.trans(b_q.to(b_do.dtype)), b_do, input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + off_kv, b_dh, mask=m_kv)
