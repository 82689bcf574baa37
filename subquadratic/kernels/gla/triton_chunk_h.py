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
chunk of each sequence (`seq_bounds`, `chunk_bounds`: no host synchronisation either way). The jit
helpers here (`chunk_rows`, `load_decays`, `load_state`, `walk_program`, `walk_chunk`) are the
pieces the walks and the output kernels of `triton_chunk_o.py` share.
"""

from __future__ import annotations

from ..triton_launch import jit
from ..triton_utils import autotune
from ..utils import import_triton

triton, tl = import_triton()

#: (BK, BV, warps, stages) the walks are autotuned over on the GPU.
CONFIGS = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (32, 64, 4, 3), (32, 32, 4, 2), (32, 32, 2, 3),
           (64, 64, 8, 2)]
KEY = ["K", "V", "BT", "G", "DECAY", "PREC"]


@jit
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


@jit
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


@jit
def chunk_rows(s_bos, s_n, i_c, i_h, T, NT, H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Chunk i_c of the chunk list for KV head i_h: (valid tokens n, row index tok * H + i_h of its
    BT token slots [BT] (int64), which are valid [BT], the row of its last valid token)."""
    bos, n = chunk_bounds(s_bos, s_n, i_c, T, NT, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    row = (bos + o_t).to(tl.int64) * H + i_h
    return n, row, o_t < n, (bos + tl.maximum(n, 1) - 1).to(tl.int64) * H + i_h


@jit
def load_decays(gc, row, row_last, m_t, n, o_k, K: tl.constexpr, DECAY: tl.constexpr):
    """The in-chunk cumulative log decays of rows [BT] and of the chunk's last row (read where the
    chunk has n > 0 tokens): DECAY 1 [BT] and a scalar, DECAY 2 [BT, BK] and [BK]; 0 past K and at
    invalid rows."""
    if DECAY == 1:
        b_g = tl.load(gc + row, mask=m_t, other=0.0)
        b_gl = tl.load(gc + row_last, mask=n > 0, other=0.0)
    else:
        m_k = o_k < K
        b_g = tl.load(gc + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_gl = tl.load(gc + row_last * K + o_k, mask=m_k & (o_k * 0 < n), other=0.0)
    return b_g, b_gl


@jit
def load_state(h, i_c, i_h, n, o_k, o_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """The [BK, BV] tile (o_k, o_v) of the state h[i_c, i_h] [NC, H, K, V]; 0 for an empty chunk slot
    (whose state the walk never wrote)."""
    m = (o_k < K)[:, None] & (o_v < V)[None, :] & (o_k * 0 < n)[:, None]
    return tl.load(h + (i_c * H + i_h).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :], mask=m, other=0.0)


@jit
def state_tile(i_k, i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The [BK, BV] state tile of K block i_k and V block i_v: (key offsets [BK], value offsets [BV],
    its mask and its offsets in a [K, V] state)."""
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    return o_k, o_v, (o_k < K)[:, None] & (o_v < V)[None, :], o_k[:, None] * V + o_v[None, :]


@jit
def cumsum_writer(DECAY: tl.constexpr):
    """`who` of `cumsum_chunk` for a forward walk's program: 0 where it stores gc. Per-key decay: each
    key block's programs of the first V block; one decay per head: the first key block's."""
    if DECAY == 2:
        who = tl.program_id(1)
    else:
        who = tl.program_id(0) + tl.program_id(1)
    return who


@jit
def walk_program(cu, ccu, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """What a walk program (K block, V block, sequence x KV head) covers: (sequence x head i_nh, KV
    head, first and end token, first chunk, chunks, key offsets [BK], value offsets [BV], the mask
    and offsets of its [BK, BV] state tile)."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, c0 = seq_bounds(cu, ccu, i_nh // H, T, NT, IS_VARLEN)
    o_k, o_v, m_kv, off_kv = state_tile(i_k, i_v, K, V, BK, BV)
    return i_nh, i_nh % H, bos, eos, c0, tl.cdiv(eos - bos, BT), o_k, o_v, m_kv, off_kv


@jit
def walk_chunk(gc, bos, eos, i_t, i_h, o_k, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
               DECAY: tl.constexpr):
    """Chunk i_t of a walk's sequence: (its token rows [BT] (int64), which are valid [BT], the
    decays of `load_decays`, or zeros without decay)."""
    tok = (bos + i_t * BT + tl.arange(0, BT)).to(tl.int64)
    m_t = tok < eos
    row = tok * H + i_h
    if DECAY != 0:
        last = (tl.minimum(bos + i_t * BT + BT, eos) - 1).to(tl.int64)
        b_g, b_gl = load_decays(gc, row, last * H + i_h, m_t, eos - bos, o_k, K, DECAY)
    else:
        b_g = tl.zeros([BT], dtype=tl.float32)
        b_gl = b_g
    return row, m_t, b_g, b_gl


@jit
def cumsum_chunk(g, gc, bos, eos, i_t, i_h, o_k, who, gs, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                 DECAY: tl.constexpr):
    """`walk_chunk` from the raw log decays g: their in-chunk cumulative sum, computed here (and
    stored into gc by the programs whose `who` is 0, for the kernels after the walk) instead of read from gc; the last
    valid row's value is picked from the same sum, so the walk decays by exactly what gc holds. The decays are
    gs g (`gs`: the op's `g_scale`, 1.0 but for a caller that decays by a multiple of its g)."""
    o_t = tl.arange(0, BT)
    tok = (bos + i_t * BT + o_t).to(tl.int64)
    m_t = tok < eos
    row = tok * H + i_h
    is_last = o_t == tl.minimum(eos - bos - i_t * BT, BT) - 1
    store = o_t * 0 + who == 0  # [BT] (a scalar condition as a tensor: the interpreter's masks are tensors)
    if DECAY == 1:
        b_g = tl.cumsum(tl.load(g + row, mask=m_t, other=0.0) * gs, 0)
        b_gl = tl.sum(tl.where(is_last, b_g, 0.0), 0)
        tl.store(gc + row, b_g, mask=m_t & store)
    else:
        m = m_t[:, None] & (o_k < K)[None, :]
        off = row[:, None] * K + o_k[None, :]
        b_g = tl.cumsum(tl.load(g + off, mask=m, other=0.0) * gs, 0)
        b_gl = tl.sum(tl.where(is_last[:, None], b_g, 0.0), 0)
        tl.store(gc + off, b_g, mask=m & store[:, None])
    return row, m_t, b_g, b_gl


@jit
def walk_step(k, v, g, gc, b_h, bos, eos, i_t, i_h, o_k, o_v, who, gs, H: tl.constexpr, K: tl.constexpr,
              V: tl.constexpr, BT: tl.constexpr, DECAY: tl.constexpr, PREC: tl.constexpr, CUMSUM: tl.constexpr):
    """One chunk of a forward walk: the state after chunk i_t of the walk's tokens [bos, eos) from the
    state b_h [BK, BV] before it, and the chunk's last cumulative log decay (`cumsum_chunk` with
    CUMSUM, else `walk_chunk`)."""
    if CUMSUM and DECAY != 0:
        row, m_t, b_g, b_gl = cumsum_chunk(g, gc, bos, eos, i_t, i_h, o_k, who, gs, H, K, BT, DECAY)
    else:
        row, m_t, b_g, b_gl = walk_chunk(gc, bos, eos, i_t, i_h, o_k, H, K, BT, DECAY)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & (o_v < V)[None, :], other=0.0)
    if DECAY == 1:  # k decayed to the chunk end, the state across the chunk
        b_k = tl.where(m_tk, b_k.to(tl.float32) * tl.exp(b_gl - b_g)[:, None], 0.0).to(b_k.dtype)
        b_h *= tl.exp(b_gl)
    elif DECAY == 2:
        b_k = tl.where(m_tk, b_k.to(tl.float32) * tl.exp(b_gl[None, :] - b_g), 0.0).to(b_k.dtype)
        b_h *= tl.exp(b_gl)[:, None]
    b_h += tl.dot(tl.trans(b_k), b_v.to(b_k.dtype), input_precision=PREC)
    return b_h, b_gl


@autotune(CONFIGS, KEY)
@jit
def chunk_fwd_h(
    k, v, g, gc, h, h0, ht, cu, ccu, T, NT, gs,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    PREC: tl.constexpr, CUMSUM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """The forward walk (module doc). With CUMSUM (and a decay) it reads the raw log decays g and
    writes their in-chunk cumulative sum gc on the way (the programs of the first V block, each its
    key block; with one decay per head, the first key block's): one launch less than a separate
    cumsum kernel; without, it reads gc."""
    i_nh, i_h, bos, eos, c0, nt, o_k, o_v, m_kv, off_kv = walk_program(cu, ccu, T, NT, H, K, V, BT, BK, BV,
                                                                       IS_VARLEN)
    who = cumsum_writer(DECAY)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0)
    for i_t in range(0, nt):
        tl.store(h + ((c0 + i_t) * H + i_h).to(tl.int64) * K * V + off_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        b_h, _ = walk_step(k, v, g, gc, b_h, bos, eos, i_t, i_h, o_k, o_v, who, gs, H, K, V, BT, DECAY, PREC, CUMSUM)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + off_kv, b_h, mask=m_kv)


@autotune(CONFIGS, KEY)
@jit
def chunk_bwd_dh(
    q, do, gc, dh, dht, dh0, cu, ccu, T, NT,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_nh, i_h, bos, eos, c0, nt, o_k, o_v, m_kv, off_kv = walk_program(cu, ccu, T, NT, H, K, V, BT, BK, BV,
                                                                       IS_VARLEN)
    m_k, m_v = o_k < K, o_v < V
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_nh.to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0)
    for j in range(0, nt):
        i_t = nt - 1 - j
        tl.store(dh + ((c0 + i_t) * H + i_h).to(tl.int64) * K * V + off_kv, b_dh.to(dh.dtype.element_ty),
                 mask=m_kv)
        row, m_t, b_g, b_gl = walk_chunk(gc, bos, eos, i_t, i_h, o_k, H, K, BT, DECAY)
        m_tk = m_t[:, None] & m_k[None, :]
        if DECAY == 1:  # q decayed from the chunk start, the gradient across the chunk
            b_e = tl.exp(b_g)[:, None]
            b_dh *= tl.exp(b_gl)
        elif DECAY == 2:
            b_e = tl.exp(b_g)
            b_dh *= tl.exp(b_gl)[:, None]
        for i_g in range(0, G):  # the query heads of this KV head
            row_q = (row - i_h) * G + i_h * G + i_g
            b_q = tl.load(q + row_q[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_do = tl.load(do + row_q[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
            if DECAY != 0:
                b_q = tl.where(m_tk, b_q.to(tl.float32) * b_e, 0.0).to(b_q.dtype)
            b_dh += tl.dot(tl.trans(b_q), b_do.to(b_q.dtype), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + off_kv, b_dh, mask=m_kv)


# ---------------------------------------------------------------------------
# The split forward walk: pieces of PIECE chunks walked side by side, then joined
# ---------------------------------------------------------------------------
#
# A sequence of many chunks is cut into pieces of P chunks (the last may be shorter). Varlen inputs
# have a piece table, a chunk table with chunks of P * C tokens (`Chunks.seq` names each piece's
# sequence); dense ones cdiv(NT, P) pieces per sequence (`piece_bounds`). (1) `piece_fwd_h`: one
# program per (K block, V block, piece x KV head) walks its piece from a zero state (its sequence's
# initial state for the first piece), storing the states before its chunks less what enters the
# piece, its end state S [NP, H, K, V] fp32, and with decay the sum of its chunks' log decays
# D [NP, H, K] and per chunk the sum over the piece's chunks before it E [NC, H, K]. (2)
# `piece_carry`: per (sequence, KV head), the state entering each piece after the first,
# X_p = exp(D_{p-1}) X_{p-1} + S_{p-1} (X_1 = S_0), into X [NP, H, K, V] fp32, and the final state.
# (3) `piece_fix`: each chunk of a later piece adds exp(E_c) X_p to its state. The serial part is a
# sequence's pieces, not its chunks.


@jit
def piece_bounds(cu, ccu, p_bos, p_n, p_seq, i_p, T, NT, P: tl.constexpr, BT: tl.constexpr,
                 IS_VARLEN: tl.constexpr):
    """(first token, tokens, sequence, the sequence's first token, the piece's first chunk) of piece
    slot i_p (tokens 0: an unused slot)."""
    if IS_VARLEN:
        bos = tl.load(p_bos + i_p)
        n_tok = tl.load(p_n + i_p)
        seq = tl.load(p_seq + i_p)
        s_bos = tl.load(cu + seq)
        c_first = tl.load(ccu + seq) + (bos - s_bos) // BT
    else:
        nps = tl.cdiv(NT, P)
        seq = i_p // nps
        j = i_p % nps
        s_bos = seq * T
        bos = s_bos + j * P * BT
        n_tok = tl.minimum(T - j * P * BT, P * BT)
        c_first = seq * NT + j * P
    return bos, n_tok, seq, s_bos, c_first


@autotune(CONFIGS, KEY)
@jit
def piece_fwd_h(
    k, v, g, gc, h, h0, S, D, E, cu, ccu, p_bos, p_n, p_seq, T, NT, gs,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, P: tl.constexpr,
    DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, USE_H0: tl.constexpr, PREC: tl.constexpr,
    CUMSUM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_k, i_v, i_ph = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_p, i_h = i_ph // H, i_ph % H
    bos, n_tok, seq, s_bos, c_first = piece_bounds(cu, ccu, p_bos, p_n, p_seq, i_p, T, NT, P, BT, IS_VARLEN)
    eos = bos + n_tok
    o_k, o_v, m_kv, off_kv = state_tile(i_k, i_v, K, V, BK, BV)
    who = cumsum_writer(DECAY)
    m_e = (o_k < K) & (o_k * 0 + i_v == 0)  # D, E: each key block's programs of the first V block
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:  # the sequence's initial state enters its first piece
        first = (o_k * 0 + bos == s_bos)[:, None]
        b_h += tl.load(h0 + (seq * H + i_h).to(tl.int64) * K * V + off_kv, mask=m_kv & first, other=0.0)
    b_e = tl.zeros([BK], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(n_tok, BT)):
        c = (c_first + i_t) * H + i_h
        tl.store(h + c.to(tl.int64) * K * V + off_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        if DECAY != 0:
            tl.store(E + c.to(tl.int64) * K + o_k, b_e, mask=m_e)
        b_h, b_gl = walk_step(k, v, g, gc, b_h, bos, eos, i_t, i_h, o_k, o_v, who, gs, H, K, V, BT, DECAY, PREC,
                              CUMSUM)
        if DECAY != 0:
            b_e += b_gl
    tl.store(S + (i_p * H + i_h).to(tl.int64) * K * V + off_kv, b_h, mask=m_kv)
    if DECAY != 0:
        tl.store(D + (i_p * H + i_h).to(tl.int64) * K + o_k, b_e, mask=m_e)


@jit
def piece_carry(
    S, D, X, h0, ht, pccu, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, DECAY: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        p0 = tl.load(pccu + i_n)
        n_p = tl.load(pccu + i_n + 1) - p0
    else:
        n_p = tl.cdiv(NT, P)
        p0 = i_n * n_p
    o_k, o_v, m_kv, off_kv = state_tile(i_k, i_v, K, V, BK, BV)
    # the first piece's end state (it holds the initial state); an empty sequence keeps its initial state
    b_x = tl.load(S + (p0 * H + i_h).to(tl.int64) * K * V + off_kv, mask=m_kv & (o_k * 0 + n_p > 0)[:, None], other=0.0)
    if USE_H0:
        b_x += tl.load(h0 + i_nh.to(tl.int64) * K * V + off_kv, mask=m_kv & (o_k * 0 + n_p == 0)[:, None], other=0.0)
    for j in range(1, n_p):
        p = (p0 + j) * H + i_h
        tl.store(X + p.to(tl.int64) * K * V + off_kv, b_x, mask=m_kv)
        if DECAY != 0:
            b_x *= tl.exp(tl.load(D + p.to(tl.int64) * K + o_k, mask=o_k < K, other=0.0))[:, None]
        b_x += tl.load(S + p.to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + off_kv, b_x, mask=m_kv)


@jit
def piece_fix(
    h, X, E, cu, ccu, p_bos, p_n, p_seq, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, P: tl.constexpr,
    DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_phj, i_k, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    j, i_ph = i_phj % P, i_phj // P
    i_p, i_h = i_ph // H, i_ph % H
    bos, n_tok, seq, s_bos, c_first = piece_bounds(cu, ccu, p_bos, p_n, p_seq, i_p, T, NT, P, BT, IS_VARLEN)
    c = (c_first + j) * H + i_h
    o_k, o_v, m_kv, off_kv = state_tile(i_k, i_v, K, V, BK, BV)
    # a chunk of this piece, which is not its sequence's first (scalar conditions as tensors: the
    # interpreter's masks are tensors)
    live = (o_k * 0 + j * BT < n_tok) & (o_k * 0 + bos > s_bos)
    m_kv = m_kv & live[:, None]
    b_x = tl.load(X + (i_p * H + i_h).to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0)
    if DECAY != 0:
        b_x *= tl.exp(tl.load(E + c.to(tl.int64) * K + o_k, mask=(o_k < K) & live, other=0.0))[:, None]
    b_h = tl.load(h + c.to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0).to(tl.float32)
    tl.store(h + c.to(tl.int64) * K * V + off_kv, (b_h + b_x).to(h.dtype.element_ty), mask=m_kv)
