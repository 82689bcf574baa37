"""The Triton kernels of `decode_attention` (one query token per row over a long key cache under a mask,
module `decode_attention.py`), split over the keys in the manner of flash decoding: `decode_split`
runs the online softmax of the G query heads of one KV head over one span of keys (each key tile read
once for the whole group) and writes the span's running max, sum and unnormalised output in fp32;
`decode_combine` merges the spans of a row and head. The tiles, the online softmax and the group's
query / output rows are the window kernels' (`triton_window.py`). fp32 accumulation; 16-bit operands
on the tensor cores, fp32 ones exact ("ieee") or TF32.
"""

from __future__ import annotations

import torch

from .spla.triton_common import NEG
from .triton_launch import jit
from .triton_utils import block_size
from .triton_window import _group_queries, _kv, _online_softmax, _store_group
from .utils import import_triton, new_output

triton, tl = import_triton()

#: Keys of a tile.
BN = 64


@jit
def decode_split(Q, K, V, OK, M, L, ACC, S, span, scale, s_qb, s_qh, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_mb,
                 H: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                 BN: tl.constexpr, IEEE: tl.constexpr):
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    n_spans = tl.num_programs(1)
    b, h = i_bh // H, i_bh % H
    bb = b.to(tl.int64)
    cols = tl.arange(0, BD)
    heads = tl.arange(0, BG)
    q = _group_queries(Q, bb, h, s_qb, s_qh, heads, cols, G, D)
    Kp, Vp = K + bb * s_kb + h * s_kh, V + bb * s_vb + h * s_vh
    m_i = tl.full([BG], NEG, tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    lo = i_s * span
    hi = tl.minimum(lo + span, S)
    for n0 in range(lo, hi, BN):
        keys = n0 + tl.arange(0, BN)
        inside = keys < hi
        ok = inside & (tl.load(OK + bb * s_mb + keys.to(tl.int64), mask=inside, other=0) != 0)
        k, v = _kv(Kp, Vp, s_kt, s_vt, keys, hi, cols, D)
        m_i, l_i, acc = _online_softmax(q, k, v, ok[None, :], m_i, l_i, acc, scale, IEEE)
    row = (i_bh * n_spans + i_s).to(tl.int64) * BG + heads  # partials [B H, spans, BG (, BD)]
    tl.store(M + row, m_i)
    tl.store(L + row, l_i)
    tl.store(ACC + row[:, None] * BD + cols[None, :], acc)


@jit
def decode_combine(M, L, ACC, OUT, n_spans, s_ob, s_oh, H: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
                   D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr):
    i_bh = tl.program_id(0)
    b, h = i_bh // H, i_bh % H
    cols = tl.arange(0, BD)
    heads = tl.arange(0, BG)
    m_all = tl.full([BG], NEG, tl.float32)
    for s0 in range(0, n_spans, BS):  # the row's largest max first
        spans = s0 + tl.arange(0, BS)
        idx = (i_bh * n_spans + spans).to(tl.int64)[:, None] * BG + heads[None, :]
        m = tl.load(M + idx, mask=(spans < n_spans)[:, None], other=NEG)
        m_all = tl.maximum(m_all, tl.max(m, 0))
    l_all = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    for i in range(0, n_spans):
        row = (i_bh * n_spans + i).to(tl.int64) * BG + heads
        w = tl.exp(tl.load(M + row) - m_all)
        l_all += tl.load(L + row) * w
        acc += tl.load(ACC + row[:, None] * BD + cols[None, :]) * w[:, None]
    _store_group(OUT, b.to(tl.int64), h, s_ob, s_oh, heads, cols, acc / tl.where(l_all > 0, l_all, 1.0)[:, None], G,
                 D)


def spans_for(S: int, rows_x_heads: int, sms: int) -> int:
    """Keys per span: about two programs per streaming multiprocessor over the B H (row, KV head) pairs,
    at least 4 key tiles a span, a whole number of tiles."""
    want = max(1, -(-2 * sms // rows_x_heads))
    span = max(4 * BN, -(-S // want))
    return -(-span // BN) * BN


def decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                  ieee: bool) -> torch.Tensor:
    """`decode_attention.decode_attention` on the kernels (its checks done by the caller): o [B, HQ, 1, D]."""
    B, HQ, _, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = HQ // H
    BG, BD = block_size(G), block_size(D)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
    span = spans_for(S, B * H, sms)
    n_spans = -(-S // span)
    m = new_output((B * H, n_spans, BG), q.device)
    lsum = new_output((B * H, n_spans, BG), q.device)
    acc = new_output((B * H, n_spans, BG, BD), q.device)
    o = new_output((B, HQ, 1, D), q.device, q.dtype)
    warps = 4 if BD <= 64 else 8
    decode_split[(B * H, n_spans)](
        q, k, v, allowed, m, lsum, acc, S, span, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), allowed.stride(0), H, G, BG, D, BD, BN, ieee,
        num_warps=warps)
    decode_combine[(B * H,)](m, lsum, acc, o, n_spans, o.stride(0), o.stride(1), H, G, BG, D, BD,
                             min(64, block_size(n_spans)), num_warps=warps)
    return o
