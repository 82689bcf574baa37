"""Backward of the block-major sparse branch and residual correction (`triton_blocks`): one fused
kernel over the same segments of (token, slot) pairs, grouped by (batch x KV head, window, block).

Per segment the block's K, V and phi(k) are loaded once and dk, dv of the block accumulate in
registers over the segment's chunks; per chunk (BMQ tokens x G heads as rows) the kernel recomputes
P = exp(S - lse) and A = phi(q) phi(k)^T (causal-masked), then
  dv += P^T dO + A^T dOt,  dS = P (dO V^T - Delta),  dq = dS K * scale + J_phi(q)(dA phi(k)),
  dk += dS^T Q * scale + J_phi(k)(dA^T phi(q)),  dA = dOt V^T (masked),
with Delta = rowsum(dO * O) and J_phi(x) g = phi(x) * (g - sum(g * phi(x))) the softmax feature map's
Jacobian (linear in g, so applied per chunk). dq goes to the chunk's rows with fp32 atomics (one add
per pair and head; the window order keeps those rows in L2), dk and dv to the block's slots once per
segment.
"""

from __future__ import annotations

import math

import torch

from ..utils import import_triton
from .triton_blocks import BlockPairs, BlocksPlan, _chunk_rows, _dot, _operands, _segment, segments
from .triton_common import _softmax_rows

triton, tl = import_triton()


@triton.jit
def blocks_bwd_kernel(
    Q, K, V, PAIRS, SEG_KEY, SEG_FIRST, SEG_COUNT, QPOS, KOFF, LSE, DELTA, DO, DOT, DQ, DK, DV,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    T, H, NW, NB, NSEL, S, scale,
    G: tl.constexpr, R: tl.constexpr, BMQ: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    SEGP: tl.constexpr, USE_RLA: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr,
):
    """dq, dk, dv of one segment through both branches. LSE, DELTA: [B, T, HQ]; DO, DOT: [B, T, HQ, D]
    fp32; DQ [B, T, HQ, D], DK, DV [B, H, S, D]: fp32, zeroed by the caller, fp32 atomics."""
    b, h, first, count, koff, pos, kload = _segment(SEG_KEY, SEG_FIRST, SEG_COUNT, PAIRS, QPOS, KOFF, T, H,
                                                    NW, NB, NSEL, S, BS, SEGP)
    d = tl.arange(0, D)
    b64 = b.to(tl.int64)
    slot = koff + pos
    k = tl.load(K + b64 * stride_kb + h * stride_kh + slot[:, None] * stride_ks + d[None, :],
                mask=kload[:, None], other=0.0)
    v = tl.load(V + b64 * stride_vb + h * stride_vh + slot[:, None] * stride_vs + d[None, :],
                mask=kload[:, None], other=0.0)
    kt = tl.trans(k)
    vt = tl.trans(v)
    dk = tl.zeros([BS, D], tl.float32)
    dv = tl.zeros([BS, D], tl.float32)
    if USE_RLA:
        phik = _softmax_rows(k)
        phik_lp = phik.to(k.dtype)
    HQ = H * G
    for c0 in range(0, count, BMQ):
        e, t, i, tpos, g, ok = _chunk_rows(PAIRS, QPOS, first, c0, count, T, H, NSEL, b, G, R, BMQ)
        head = h * G + g
        q = tl.load(Q + b64 * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                    mask=ok[:, None], other=0.0)
        row = (b64 * T + t) * HQ + head
        lse = tl.load(LSE + row, mask=ok, other=0.0)
        delta = tl.load(DELTA + row, mask=ok, other=0.0)
        rd = row[:, None] * D + d[None, :]
        do = tl.load(DO + rd, mask=ok[:, None], other=0.0).to(k.dtype)
        mask = ok[:, None] & (pos[None, :] <= tpos[:, None])
        p = tl.where(mask, tl.exp(_dot(q, kt, F32, PREC) * scale - lse[:, None]), 0.0)  # [R, BS]
        dv += _dot(tl.trans(p), do, F32, PREC)
        ds = p * (_dot(do, vt, F32, PREC) - delta[:, None]) * scale
        dq = _dot(ds, k, F32, PREC)
        dk += _dot(tl.trans(ds), q, F32, PREC)
        if USE_RLA:
            phiq = _softmax_rows(q)
            phiq_lp = phiq.to(k.dtype)
            dot_ = tl.load(DOT + rd, mask=ok[:, None], other=0.0).to(k.dtype)
            a = tl.where(mask, _dot(phiq_lp, tl.trans(phik_lp), F32, PREC), 0.0)
            dv += _dot(tl.trans(a), dot_, F32, PREC)
            da = tl.where(mask, _dot(dot_, vt, F32, PREC), 0.0)
            dphiq = _dot(da, phik_lp, F32, PREC)  # [R, D]
            dq += phiq * (dphiq - tl.sum(dphiq * phiq, 1)[:, None])
            dphik = _dot(tl.trans(da), phiq_lp, F32, PREC)  # [BS, D]
            dk += phik * (dphik - tl.sum(dphik * phik, 1)[:, None])
        tl.atomic_add(DQ + rd, dq, mask=ok[:, None], sem="relaxed")
    out = ((b64 * H + h) * S + slot)[:, None] * D + d[None, :]
    tl.atomic_add(DK + out, dk, mask=kload[:, None], sem="relaxed")
    tl.atomic_add(DV + out, dv, mask=kload[:, None], sem="relaxed")


def blocks_sparse_backward(q, k, v, qpos, koff, o, lse, pairs: BlockPairs, nsel: int, do, dot_, use_rla: bool,
                           block_size: int, plan: BlocksPlan):
    """dq, dk, dv (in q's, k's, v's dtype and shapes) of `triton_blocks.blocks_sparse_forward` given the
    gradients do, dot_ [B, T, HQ, D] of o_sp and otilde (None: zero)."""
    dtypes = q.dtype, k.dtype, v.dtype
    q, k, v, f32 = _operands(q, k, v)
    B, HQ, T, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = HQ // H
    dev = q.device
    do = torch.zeros_like(o) if do is None else do.float().contiguous()
    delta = (do * o).sum(-1).contiguous()  # [B, T, HQ]
    if use_rla:
        dot_ = torch.zeros_like(o) if dot_ is None else dot_.float().contiguous()
    else:
        dot_ = do
    BMQ = plan.tokens(G, backward=True)
    seg_pairs = plan.seg_pairs(G, backward=True)
    seg_key, seg_first, seg_count = segments(pairs, seg_pairs)
    dq = torch.zeros(B, T, HQ, D, device=dev, dtype=torch.float32)
    dk = torch.zeros(B, H, S, D, device=dev, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    blocks_bwd_kernel[(seg_key.numel(),)](
        q, k, v, pairs.pairs, seg_key, seg_first, seg_count, qpos, koff, lse, delta, do, dot_, dq, dk, dv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        T, H, pairs.num_windows, pairs.num_blocks, nsel, S, 1.0 / math.sqrt(D),
        G=G, R=plan.bwd_rows, BMQ=BMQ, D=D, BS=block_size, SEGP=triton.next_power_of_2(seg_pairs),
        USE_RLA=use_rla, F32=f32, PREC=plan.precision, num_warps=plan.bwd_warps, num_stages=plan.bwd_stages,
    )
    return dq.transpose(1, 2).to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2])
