"""Backward of SPLA's sparse branch and residual correction with Triton: `spla_bwd_dq_kernel` walks
each token's selected blocks again for dq; `spla_bwd_dkv_kernel` runs one program per (key block,
batch x KV head) over the queries that selected that block (CSR lists inverted from the block
indices), so dk and dv need no atomics. Both go through the sparse softmax and the correction term,
the feature map's Jacobian included."""

from __future__ import annotations

import math

import torch

from ..triton_launch import jit
from ..triton_utils import cdiv, next_power_of_2
from ..utils import import_triton, new_output
from .triton_common import mm, softmax_rows

triton, tl = import_triton()


@jit
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
        phiq = softmax_rows(q)
        dot_ = tl.load(DOT + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        dphiq = tl.zeros([GP, D], tl.float32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    p_base = PHIK + b * stride_pb + h * stride_ph
    idx_base = IDX + (b * T + t) * H * NSEL + h * NSEL
    for i in range(0, NSEL):
        blk = tl.load(idx_base + i)
        pos = blk * BS + j
        kmask = (pos >= 0) & (pos <= tpos)  # blk == -1 gives pos < 0
        slot = koff + pos
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kmask[:, None], other=0.0)
        s = mm(q, tl.trans(k), IEEE) * scale
        p = tl.where(kmask[None, :], tl.exp(s - lse[:, None]), 0.0)
        ds = p * (mm(do, tl.trans(v), IEEE) - delta[:, None])
        dq += mm(ds, k, IEEE)
        if USE_RLA:
            if PRE_PHIK:
                phik = tl.load(p_base + slot[:, None] * stride_ps + d[None, :], mask=kmask[:, None], other=0.0)
            else:
                phik = softmax_rows(k)
            da = tl.where(kmask[None, :], mm(dot_, tl.trans(v), IEEE), 0.0)
            dphiq += mm(da, phik.to(k.dtype), IEEE)
    dq = dq * scale
    if USE_RLA:  # softmax Jacobian: dx = phi * (dphi - <dphi, phi>)
        dq += phiq * (dphiq - tl.sum(dphiq * phiq, 1)[:, None])
    tl.store(DQ + row[:, None] * D + d[None, :], dq, mask=row_ok[:, None])


@jit
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
        phik = softmax_rows(k)
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
        p = tl.where(causal, tl.exp(mm(k, tl.trans(q), IEEE) * scale - lse[None, :]), 0.0)
        dv += mm(p, do, IEEE)
        ds = p * (mm(v, tl.trans(do), IEEE) - delta[None, :])
        dk += mm(ds, q, IEEE)
        if USE_RLA:
            phiq = softmax_rows(q).to(k.dtype)
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


def sparse_backward(q, k, v, idx, qpos, koff, o, lse, phik, do, dot_, use_rla: bool, bs: int,
                    precision: str = "ieee"):
    """dq, dk, dv of `triton_parallel.sparse_forward` (internal [B, H, T, D] views) given the
    gradients do, dot_ [B, Tq, HQ, D] of o_sp and otilde (None: zero); dots of fp32 operands at
    `precision` ("ieee" or "tf32")."""
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
    ieee = q.dtype == torch.float32 and precision == "ieee"
    scale = 1.0 / math.sqrt(D)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    dq = new_output((B, Tq, HQ, D), dev)
    pk = k if phik is None else phik
    spla_bwd_dq_kernel[(Tq, B * H)](
        q, k, v, pk, idx, qpos, koff, lse, delta, do, dot_, dq, *strides, pk.stride(0), pk.stride(1),
        pk.stride(2), Tq, H, idx.shape[-1], scale, G=G, GP=max(16, next_power_of_2(G)), D=D, BS=bs,
        USE_RLA=use_rla, IEEE=ieee, PRE_PHIK=phik is not None, num_warps=4, num_stages=2,
    )
    NB = cdiv(S, bs)
    csr_t, csr_off = queries_by_block(idx, NB)
    # padding slots belong to no block: their gradient is 0
    dk = torch.zeros(B, H, S, D, device=dev, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    R = max(16, next_power_of_2(G), 64 if D <= 64 else 32)
    spla_bwd_dkv_kernel[(NB, B * H)](
        q, k, v, qpos, koff, lse, delta, do, dot_, csr_t, csr_off, dk, dv, *strides,
        Tq, H, NB, S, scale, G=G, R=R, D=D, BS=bs, USE_RLA=use_rla, IEEE=ieee,
        num_warps=4 if D <= 64 else 8, num_stages=1,
    )
    return dq.transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
