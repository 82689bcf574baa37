"""Backward of the block-major sparse branch and residual correction (`triton_blocks`) over the same
segments of (token, slot) pairs, grouped by (batch x KV head, window, block): `blocks_bwd_dq_kernel`
for dq, then `blocks_bwd_dkdv_kernel` for dk, dv (once for both branches, plan bwd="split", or once
per branch, bwd="split3": fewer registers, no spills at d128), or the dk/dv kernel computing dq too,
all three in one pass (bwd="fused", the default at d <= 64 over blocks of up to 64 keys).

Per segment a program loads the block's K, V and phi(k) once; per chunk (BMQ tokens x G heads as
rows) it recomputes P = exp(S - lse) and A = phi(q) phi(k)^T (causal-masked), then
  dq = dS K * scale + J_phi(q)(dA phi(k)),  dS = P (dO V^T - Delta),  dA = dOt V^T (masked),
added to the chunk's rows with fp32 atomics (one add per pair and head; the window order keeps those
rows in L2; with the plan's dq "pairs", stored in the pair's own row instead and summed over the
slots by one reduction after the kernel), and on key-major tiles [keys, rows]
  dv += P^T dO + A^T dOt,  dk += dS^T Q * scale + J_phi(k)(dA^T phi(q)),
accumulated over the segment and added to the block's slots once. Delta = rowsum(dO * O);
J_phi(x) g = phi(x) * (g - sum(g * phi(x))) is the softmax feature map's Jacobian (linear in g, so
applied per chunk). The dq and dk/dv kernels recompute P (and A) apart: four more dots per chunk than
the fused kernel, which at d128 spilled 1.5-2 KB of registers a thread and measured slower (forward +
backward, 32k iid: docs/benchmarks.md); `blocks_plan` picks it where it measured faster.
"""

from __future__ import annotations

import math

import torch

from ..triton_launch import jit
from ..triton_utils import cdiv, rows_per_program
from ..utils import import_triton
from .triton_blocks_common import (
    ATOMIC_MODES,
    BlockPairs,
    BlocksPlan,
    add_rows,
    chunk_rows,
    dot,
    kernel_operands,
    query_rows,
    row_max,
    segment_kv,
    segments,
)
from .triton_common import softmax_rows

triton, tl = import_triton()

#: The most bytes of per-pair dq rows (fp32, T x HQ x NSEL x D) the backward allocates with
#: `BlocksPlan.dq` "pairs"; a call that needs more adds dq with atomics.
DQ_PAIR_BYTES = 8 << 30


@jit
def row_dots_kernel(A, B, OUT, N, D: tl.constexpr, ROWS: tl.constexpr):
    """OUT[r] = sum_d A[r, d] B[r, d] in fp32 for ROWS rows of contiguous [N, D] tensors of any dtypes."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < N
    offs = r.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    a = tl.load(A + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(OUT + r, tl.sum(a * b, 1), mask=ok)


def row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(a * b).sum(-1) in fp32 for a, b [..., D] (D a power of two) in one pass, without fp32 copies
    of 16-bit inputs: the backward's Delta = rowsum(dO * O)."""
    a, b = a.contiguous(), b.contiguous()
    D = a.shape[-1]
    out = torch.empty(a.shape[:-1], device=a.device, dtype=torch.float32)
    n = out.numel()
    rows = rows_per_program(D, 4096, 128)
    if n:
        row_dots_kernel[(cdiv(n, rows),)](a, b, out, n, D=D, ROWS=rows, num_warps=4)
    return out


@jit
def _grad_rows(PAIRS, QPOS, Q, LSE, DELTA, first, c0, count, b, b64, h, stride_qb, stride_qh, stride_qt, T, H, NSEL,
               G: tl.constexpr, R: tl.constexpr, BMQ: tl.constexpr, D: tl.constexpr):
    """A chunk's rows for the backward: (t, positions, g, ok, q [R, D], lse, delta, the rows' offsets
    [R, D] into the [B, T, HQ, D] gradients, the rows' pairs e)."""
    e, t, tpos, g, ok = chunk_rows(PAIRS, QPOS, first, c0, count, T, H, NSEL, b, G, R, BMQ)
    q, row = query_rows(Q, b64, h, t, g, ok, stride_qb, stride_qh, stride_qt, T, H, G, D)
    lse = tl.load(LSE + row, mask=ok, other=0.0)
    delta = tl.load(DELTA + row, mask=ok, other=0.0)
    return t, tpos, g, ok, q, row, lse, delta, row[:, None] * D + tl.arange(0, D)[None, :], e


@jit
def blocks_bwd_dkdv_kernel(
    Q, K, V, PAIRS, SEG_KEY, SEG_FIRST, SEG_COUNT, QPOS, KOFF, ROWMAX, LSE, DELTA, DO, DOT, DK, DV, DQ,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    T, H, NW, NB, NSEL, S, scale,
    G: tl.constexpr, R: tl.constexpr, BMQ: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BSK: tl.constexpr,
    USE_RLA: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, ATOMICS: tl.constexpr,
    PART: tl.constexpr, WITH_DQ: tl.constexpr = False,
):
    """dk, dv of BSK keys (part program_id(1) of the block) of one segment, key-major tiles [BSK, R]:
    P^T, dS^T, A^T, dA^T; the feature map's Jacobian applied per chunk. PART 0: both branches, 1: the
    softmax branch, 2: the correction. WITH_DQ (PART 0 over whole blocks, BSK = BS; plan bwd="fused"):
    dq from the same tiles, dS^T^T K and the Jacobian of dA^T^T phi(k), added to the chunk's rows with
    fp32 atomics, so that one pass loads each chunk's rows and computes P, dS, A, dA once (ten dots a
    chunk against the split kernels' fourteen). Layouts as `blocks_bwd_dq_kernel`."""
    b, h, first, count, pos, kload, b64, slot, k, v = segment_kv(
        SEG_KEY, SEG_FIRST, SEG_COUNT, KOFF, ROWMAX, K, V, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
        stride_vs, NW, NB, H, S, BS, BSK, D)
    dk = tl.zeros([BSK, D], tl.float32)
    dv = tl.zeros([BSK, D], tl.float32)
    if USE_RLA:
        phik = softmax_rows(k)
        phik_lp = phik.to(k.dtype)
    for c0 in range(0, count, BMQ):
        t, tpos, g, ok, q, row, lse, delta, rd, e = _grad_rows(PAIRS, QPOS, Q, LSE, DELTA, first, c0, count, b, b64, h,
                                                            stride_qb, stride_qh, stride_qt, T, H, NSEL, G, R, BMQ, D)
        mask_t = ok[None, :] & (pos[:, None] <= tpos[None, :])
        if PART != 2:
            do = tl.load(DO + rd, mask=ok[:, None], other=0.0)
            p_t = tl.where(mask_t, tl.exp(dot(k, tl.trans(q), F32, PREC) * scale - lse[None, :]), 0.0)
            dv += dot(p_t, do, F32, PREC)
            ds_t = p_t * (dot(v, tl.trans(do), F32, PREC) - delta[None, :]) * scale
            dk += dot(ds_t, q, F32, PREC)
            if WITH_DQ:
                dq = dot(tl.trans(ds_t), k, F32, PREC)
        if USE_RLA and PART != 1:
            phiq = softmax_rows(q)
            phiq_lp = phiq.to(k.dtype)
            dot_ = tl.load(DOT + rd, mask=ok[:, None], other=0.0)
            a_t = tl.where(mask_t, dot(phik_lp, tl.trans(phiq_lp), F32, PREC), 0.0)
            dv += dot(a_t, dot_, F32, PREC)
            da_t = tl.where(mask_t, dot(v, tl.trans(dot_), F32, PREC), 0.0)
            dphik = dot(da_t, phiq_lp, F32, PREC)
            dk += phik * (dphik - tl.sum(dphik * phik, 1)[:, None])
            if WITH_DQ:
                dphiq = dot(tl.trans(da_t), phik_lp, F32, PREC)
                dq += phiq * (dphiq - tl.sum(dphiq * phiq, 1)[:, None])
        if WITH_DQ:
            add_rows(DQ, row, dq, ok, D, ATOMICS)
    krow = (b64 * H + h) * S + slot
    add_rows(DK, krow, dk, kload, D, ATOMICS)
    add_rows(DV, krow, dv, kload, D, ATOMICS)


@jit
def blocks_bwd_dq_kernel(
    Q, K, V, PAIRS, SEG_KEY, SEG_FIRST, SEG_COUNT, QPOS, KOFF, ROWMAX, LSE, DELTA, DO, DOT, DQ,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    T, H, NW, NB, NSEL, S, scale,
    G: tl.constexpr, R: tl.constexpr, BMQ: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BSK: tl.constexpr,
    USE_RLA: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, ATOMICS: tl.constexpr,
    PAIR_ROWS: tl.constexpr, ONE_PART: tl.constexpr,
):
    """dq of one segment's rows over BSK keys (part program_id(1) of the block): dS K * scale and the
    feature map's Jacobian of dA phi(k), added with fp32 atomics into DQ [B, T, HQ, D]; with
    PAIR_ROWS into the pairs' own rows of DQ [P, G, D] (row e G + g of pair e), stored without atomics
    where the block is one part (ONE_PART: no other program writes the row). LSE, DELTA: [B, T, HQ]
    fp32; DO, DOT: [B, T, HQ, D] in the operands' dtype; DQ (and the dk/dv kernel's DK, DV
    [B, H, S, D]): fp32, zeroed by the caller."""
    b, h, first, count, pos, kload, b64, slot, k, v = segment_kv(
        SEG_KEY, SEG_FIRST, SEG_COUNT, KOFF, ROWMAX, K, V, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
        stride_vs, NW, NB, H, S, BS, BSK, D)
    kt = tl.trans(k)
    vt = tl.trans(v)
    if USE_RLA:
        phik_lp = softmax_rows(k).to(k.dtype)
    for c0 in range(0, count, BMQ):
        t, tpos, g, ok, q, row, lse, delta, rd, e = _grad_rows(PAIRS, QPOS, Q, LSE, DELTA, first, c0, count, b, b64, h,
                                                            stride_qb, stride_qh, stride_qt, T, H, NSEL, G, R, BMQ, D)
        do = tl.load(DO + rd, mask=ok[:, None], other=0.0)
        mask = ok[:, None] & (pos[None, :] <= tpos[:, None])
        p = tl.where(mask, tl.exp(dot(q, kt, F32, PREC) * scale - lse[:, None]), 0.0)
        ds = p * (dot(do, vt, F32, PREC) - delta[:, None]) * scale
        dq = dot(ds, k, F32, PREC)
        if USE_RLA:
            phiq = softmax_rows(q)
            dot_ = tl.load(DOT + rd, mask=ok[:, None], other=0.0)
            da = tl.where(mask, dot(dot_, vt, F32, PREC), 0.0)
            dphiq = dot(da, phik_lp, F32, PREC)
            dq += phiq * (dphiq - tl.sum(dphiq * phiq, 1)[:, None])
        dst = e.to(tl.int64) * G + g if PAIR_ROWS else row
        if PAIR_ROWS and ONE_PART:  # no other program writes the row
            tl.store(DQ + dst[:, None] * D + tl.arange(0, D)[None, :], dq, mask=ok[:, None])
        else:
            add_rows(DQ, dst, dq, ok, D, ATOMICS)


def blocks_sparse_backward(q, k, v, qpos, koff, o, lse, pairs: BlockPairs, nsel: int, do, dot_, use_rla: bool,
                           block_size: int, plan: BlocksPlan):
    """dq, dk, dv (in q's, k's, v's dtype and shapes) of `triton_blocks.blocks_sparse_forward` given the
    gradients do, dot_ [B, T, HQ, D] of o_sp and otilde (None: zero)."""
    dtypes = q.dtype, k.dtype, v.dtype
    q, k, v, f32 = kernel_operands(q, k, v)
    B, HQ, T, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = HQ // H
    dev = q.device
    if do is None:
        do = torch.zeros(o.shape, device=dev, dtype=q.dtype)
        delta = torch.zeros(o.shape[:-1], device=dev, dtype=torch.float32)
    else:
        delta = row_dots(do, o)  # [B, T, HQ] fp32
    # the output gradients as dot operands: in the inputs' dtype (fp32 for fp32 inputs)
    do = do.to(q.dtype).contiguous()
    if use_rla:
        dot_ = torch.zeros_like(do) if dot_ is None else dot_.to(q.dtype).contiguous()
    else:
        dot_ = do
    BMQ = plan.tokens(G, backward=True)
    seg_pairs = plan.seg_pairs(G, backward=True)
    seg_key, seg_first, seg_count = segments(pairs, seg_pairs)
    pair_rows = plan.dq == "pairs" and B * T * H * nsel * G * D * 4 <= DQ_PAIR_BYTES
    # dq: added per (token, head) row with atomics, or written per pair (token, slot, head) and summed
    dq = torch.zeros(B * T * H * nsel * G if pair_rows else B * T * HQ, D, device=dev, dtype=torch.float32)
    dk = torch.zeros(B, H, S, D, device=dev, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    common = (T, H, pairs.num_windows, pairs.num_blocks, nsel, S, 1.0 / math.sqrt(D))
    meta = dict(G=G, R=plan.bwd_rows, BMQ=BMQ, D=D, BS=block_size,
                USE_RLA=use_rla, F32=f32, PREC=plan.precision, num_warps=plan.bwd_warps, num_stages=plan.bwd_stages,
                ATOMICS=ATOMIC_MODES[plan.atomics])
    seg = (q, k, v, pairs.pairs, seg_key, seg_first, seg_count, qpos, koff, row_max(qpos), lse, delta, do, dot_)
    NSEG = seg_key.numel()
    if plan.bwd == "fused" and not pair_rows and block_size <= 64:  # one pass for dq, dk and dv
        blocks_bwd_dkdv_kernel[(NSEG, 1)](*seg, dk, dv, dq, *strides, *common, BSK=block_size, PART=0, WITH_DQ=True,
                                          **meta)
        return dq.view(B, T, HQ, D).transpose(1, 2).to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2])
    dqk = min(block_size, plan.dq_keys)  # dq, then dk and dv (both branches at once, or a launch per branch)
    blocks_bwd_dq_kernel[(NSEG, block_size // dqk)](*seg, dq, *strides, *common, BSK=dqk, PAIR_ROWS=pair_rows,
                                                      ONE_PART=dqk == block_size, **meta)
    dq = dq.view(B, T, H, nsel, G, D).sum(3) if pair_rows else dq
    dq = dq.view(B, T, HQ, D)
    bsk = min(block_size, plan.dkdv_keys)
    for part in (1, 2) if plan.bwd == "split3" and use_rla else (0,):
        blocks_bwd_dkdv_kernel[(NSEG, block_size // bsk)](*seg, dk, dv, dk, *strides, *common, BSK=bsk, PART=part,
                                                          **meta)
    return dq.transpose(1, 2).to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2])
