"""Triton pieces shared by the SPLA kernels: `mm`, the fp32-accumulating dot; `softmax_rows`, the
feature map in the kernels (`key_features` once per key on the host side); `selected_blocks`, the
loop over a query's selected KV blocks (online softmax of the sparse branch plus the residual
correction on the same tiles) that the per-token prefill (`triton_parallel`) and decode
(`triton_decode`) kernels run; the query-tile kernels (`triton_tile`) and the backward
(`triton_parallel_bwd`) use the dot and the feature map; NEG, the finite "minus infinity". The window
kernels (`kernels/triton_window.py`) take the dot and NEG too."""

from __future__ import annotations

import torch

from ..triton_launch import jit
from ..utils import import_triton

triton, tl = import_triton()

NEG = tl.constexpr(-1e30)  # finite "minus infinity" for masked scores


def key_features(k: torch.Tensor) -> torch.Tensor:
    """phi(k) = softmax over the head dimension, once per key, in k's dtype [B, H, S, D]."""
    return torch.softmax(k.float(), dim=-1).to(k.dtype)


@jit
def mm(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation: with IEEE exact fp32; else on the tensor cores with `a` cast to
    b's dtype (16-bit operands, or fp32 ones as TF32, tl.dot's default for fp32)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@jit
def softmax_rows(x):
    """phi(x) = softmax over the last (head) dimension, in fp32."""
    xf = x.to(tl.float32)
    e = tl.exp(xf - tl.max(xf, 1)[:, None])
    return e / tl.sum(e, 1)[:, None]


@jit
def selected_blocks(
    q, phiq, idx_base, first, count, NSEL, tpos, koff, k_base, v_base, p_base,
    stride_ks, stride_vs, stride_ps, scale,
    GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, USE_RLA: tl.constexpr, IEEE: tl.constexpr,
    PRE_PHIK: tl.constexpr, RLA_FP32: tl.constexpr,
):
    """The G (padded to GP) query rows q [GP, D] of one token over the selected-block slots
    [first, first + count) of idx_base (-1 or slots >= NSEL: none): the online softmax over the
    selected causal keys and, with USE_RLA, the correction otilde = sum_j (phi(q).phi(k_j)) v_j on the
    same tiles (phiq = phi(q) [GP, D]; phi(k) read from p_base when PRE_PHIK, else from the K tile).
    RLA_FP32: the correction's dots in fp32 (decode), else in the inputs' dtype (prefill).
    Returns (m, l, acc, otilde, number of causal keys seen)."""
    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    m_i = tl.full([GP], NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    ot = tl.zeros([GP, D], tl.float32)
    n_sel = tl.full([], 0, tl.int32)
    for i in range(0, count):
        kk = first + i
        blk = tl.load(idx_base + kk, mask=kk < NSEL, other=-1)
        pos = blk * BS + j
        kmask = (pos >= 0) & (pos <= tpos)  # blk == -1 gives pos < 0; tensor comparisons keep a bool mask
        n_sel += tl.sum(kmask.to(tl.int32), 0)
        slot = koff + pos
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kmask[:, None], other=0.0)
        s = mm(q, tl.trans(k), IEEE) * scale
        s = tl.where(kmask[None, :], s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(kmask[None, :], tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mm(p, v, IEEE)
        m_i = m_new
        if USE_RLA:
            if RLA_FP32:  # decode: fp32 feature map, fp32 values
                a = tl.where(kmask[None, :], mm(phiq, tl.trans(softmax_rows(k)), IEEE), 0.0)
                ot += mm(a, v.to(tl.float32), IEEE)
            else:  # prefill: on the tensor cores in the inputs' dtype
                if PRE_PHIK:
                    phik = tl.load(p_base + slot[:, None] * stride_ps + d[None, :], mask=kmask[:, None], other=0.0)
                else:
                    phik = softmax_rows(k)
                a = tl.where(kmask[None, :], mm(phiq, tl.trans(phik.to(k.dtype)), IEEE), 0.0)
                ot += mm(a, v, IEEE)
    return m_i, l_i, acc, ot, n_sel
