"""Triton kernels of SPLA (forward: prefill and decode). Imported only where Triton is installed.

`spla_sparse_kernel` runs one program per (query token, batch x KV head, split): the G query
heads of the group are the rows of one tile (padded to at least 16 for tl.dot), and the program
loops over the token's selected KV blocks doing the online softmax of the sparse branch and, on
the same K/V tiles, the correction otilde = sum_{selected j} (phi(q).phi(k_j)) v_j of the residual
term. Unselected blocks are never read. Decode splits the selected blocks over several programs
(split-K) and merges the partial softmax states afterwards.

Selection (block scores from the running block statistics, group top-k) and the global causal
linear term phi(q)^T Sbar_t (chunked matmuls) run in PyTorch around the kernel. The backward pass
is not written yet: when gradients are needed the dispatcher uses the PyTorch reference.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # the package's reference path needs no Triton
    raise ImportError("the SPLA Triton kernels need `pip install triton`") from e

from ..positions import left_pad_offsets
from .reference import BlockStats, acc_dtype, feature_map, select_blocks

NEG = tl.constexpr(-1e30)  # finite "minus infinity" for masked scores
SCORE_KERNEL_MAX_TQ = 64
#: Launch settings of the decode path (blocks per scoring program; tf32 scores; decode kernel warps).
DECODE_SCORE_BN = 32
DECODE_SCORE_IEEE = True
DECODE_WARPS = 4


@triton.jit
def spla_sparse_kernel(
    Q, K, V, IDX, QPOS, KOFF, O_ACC, O_TIL, M_OUT, L_OUT,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    T, H, NSEL, PER_SPLIT, scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    USE_RLA: tl.constexpr, IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    bh = tl.program_id(1)
    sp = tl.program_id(2)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, GP)
    row_ok = rows < G
    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    q_ptr = Q + b * stride_qb + (h * G + rows)[:, None] * stride_qh + t * stride_qt + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)
    tpos = tl.load(QPOS + b * T + t)
    koff = tl.load(KOFF + b)
    m_i = tl.full([GP], NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    ot = tl.zeros([GP, D], tl.float32)
    if USE_RLA:
        qf = q.to(tl.float32)
        eq = tl.exp(qf - tl.max(qf, 1)[:, None])
        phiq = eq / tl.sum(eq, 1)[:, None]
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    idx_base = IDX + (b * T + t) * H * NSEL + h * NSEL
    for i in range(0, PER_SPLIT):
        kk = sp * PER_SPLIT + i
        blk = tl.load(idx_base + kk, mask=kk < NSEL, other=-1)
        pos = blk * BS + j
        kmask = (blk >= 0) & (pos <= tpos)
        slot = koff + pos
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(kmask[None, :], s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(kmask[None, :], tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        if USE_RLA:
            kf = k.to(tl.float32)
            ek = tl.exp(kf - tl.max(kf, 1)[:, None])
            phik = ek / tl.sum(ek, 1)[:, None]
            if IEEE:
                a = tl.dot(phiq, tl.trans(phik), input_precision="ieee")
                a = tl.where(kmask[None, :], a, 0.0)
                ot += tl.dot(a, v.to(tl.float32), input_precision="ieee")
            else:
                a = tl.dot(phiq, tl.trans(phik))
                a = tl.where(kmask[None, :], a, 0.0)
                ot += tl.dot(a, v.to(tl.float32))
    HQ = H * G
    out_row = ((sp * (tl.num_programs(1) // H) + b) * T + t) * HQ + h * G + rows  # [nsp, B, T, HQ]
    tl.store(M_OUT + out_row, m_i, mask=row_ok)
    tl.store(L_OUT + out_row, l_i, mask=row_ok)
    tl.store(O_ACC + out_row[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    if USE_RLA:
        tl.store(O_TIL + out_row[:, None] * D + d[None, :], ot, mask=row_ok[:, None])


@triton.jit
def spla_score_kernel(
    Q, SUMK, SUMK2, CNT, QPOS, SC,
    stride_qb, stride_qh, stride_qt,
    T, H, NB, block_size, n_sink, n_local, scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, TAYLOR: tl.constexpr,
    IEEE: tl.constexpr = True,
):
    """Block scores of the G query heads of one (token, batch x KV head) for BN blocks:
    qs.mu + log(1 + qs^2.s2 / 2) ("taylor") or qs.mu, NEG for blocks that are not candidates
    (complete past blocks that are not forced). SC: [B, T, H, G, NB]."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, GP)
    row_ok = rows < G
    d = tl.arange(0, D)
    n = tl.program_id(2) * BN + tl.arange(0, BN)
    q = tl.load(Q + b * stride_qb + (h * G + rows)[:, None] * stride_qh + t * stride_qt + d[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32) * scale
    tpos = tl.load(QPOS + b * T + t)
    cur = tl.where(tpos >= 0, tpos // block_size, -1)
    cand = (n < cur) & (n >= n_sink) & (n <= cur - n_local)
    stat = (b * H + h) * NB + n
    cnt = tl.maximum(tl.load(CNT + b * NB + n, mask=n < NB, other=1.0), 1.0)
    mu = tl.load(SUMK + stat[:, None] * D + d[None, :], mask=(n < NB)[:, None], other=0.0) / cnt[:, None]
    if IEEE:
        sc = tl.dot(q, tl.trans(mu), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(mu))
    if TAYLOR:
        s2 = tl.load(SUMK2 + stat[:, None] * D + d[None, :], mask=(n < NB)[:, None], other=0.0)
        s2 = tl.maximum(s2 / cnt[:, None] - mu * mu, 0.0)
        if IEEE:
            sc += tl.log(1.0 + 0.5 * tl.dot(q * q, tl.trans(s2), input_precision="ieee"))
        else:
            sc += tl.log(1.0 + 0.5 * tl.dot(q * q, tl.trans(s2)))
    sc = tl.where(cand[None, :], sc, NEG)
    out = (((b * T + t) * H + h) * G + rows)[:, None] * NB + n[None, :]
    tl.store(SC + out, sc, mask=row_ok[:, None] & (n < NB)[None, :])


@triton.jit
def spla_topk_kernel(
    SC, QPOS, GS, IDX,
    T, H, NB, block_size, n_sink, n_local, top_k, NSEL,
    G: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr, NBP: tl.constexpr,
):
    """Group top-k of one (token, batch x KV head) from the raw scores SC [B, T, H, G, NB]: softmax
    over the candidate blocks per query head, summed over the group (written to the scratch GS
    [B, T, H, NB]), then the forced blocks (local, then sinks) and the best `top_k - forced`
    candidates into IDX [B, T, H, NSEL] (-1 = none)."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, GP)
    row_ok = rows < G
    tpos = tl.load(QPOS + b * T + t)
    cur = tl.where(tpos >= 0, tpos // block_size, -1)
    sc_base = SC + (((b * T + t) * H + h) * G + rows)[:, None] * NB
    gs_base = GS + ((b * T + t) * H + h) * NB
    m_i = tl.full([GP], NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    for n0 in range(0, NB, BN):  # softmax statistics per query head over the candidates
        n = n0 + tl.arange(0, BN)
        cand = (n < cur) & (n >= n_sink) & (n <= cur - n_local)
        sc = tl.load(sc_base + n[None, :], mask=row_ok[:, None] & (n < NB)[None, :], other=NEG)
        sc = tl.where(cand[None, :], sc, NEG)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.where(cand[None, :], tl.exp(sc - m_new[:, None]), 0.0), 1)
        m_i = m_new
    inv_l = tl.where(row_ok & (l_i > 0), 1.0 / tl.maximum(l_i, 1e-30), 0.0)
    for n0 in range(0, NB, BN):  # group score of each candidate, -1 elsewhere
        n = n0 + tl.arange(0, BN)
        cand = (n < cur) & (n >= n_sink) & (n <= cur - n_local)
        sc = tl.load(sc_base + n[None, :], mask=row_ok[:, None] & (n < NB)[None, :], other=NEG)
        p = tl.exp(sc - m_i[:, None]) * inv_l[:, None]
        tl.store(gs_base + n, tl.where(cand, tl.sum(p, 0), -1.0), mask=n < NB)
    out = IDX + ((b * T + t) * H + h) * NSEL
    n_forced = tl.full([], 0, tl.int32)
    for i in range(0, n_local):  # the current block and the ones before it
        blk = cur - i
        tl.store(out + i, tl.where(blk >= 0, blk, -1))
        n_forced += tl.where(blk >= 0, 1, 0)
    for i in range(0, n_sink):  # sinks not already local
        ok = i <= cur - n_local
        tl.store(out + n_local + i, tl.where(ok, i, -1))
        n_forced += tl.where(ok, 1, 0)
    free = top_k - n_forced
    tl.debug_barrier()  # the group scores written above are read back by other threads
    nn = tl.arange(0, NBP)
    g = tl.load(gs_base + nn, mask=nn < NB, other=-1.0)  # all group scores in registers
    for r in range(0, top_k):  # iterative arg-max
        best_v = tl.max(g, 0)
        best_i = tl.argmax(g, 0)
        ok = (best_v >= 0) & (r < free)
        tl.store(out + n_local + n_sink + r, tl.where(ok, best_i, -1))
        g = tl.where(nn == best_i, -2.0, g)


@triton.jit
def spla_decode_kernel(
    Q, K, V, IDX, QPOS, KOFF, SBAR, O_SP, O_RLA, SBAR_NEW,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    H, NSEL, scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, DC: tl.constexpr,
    USE_RLA: tl.constexpr, IEEE: tl.constexpr,
):
    """One decode token for one (batch, KV head), everything after the selection in one program:
    online softmax over the selected blocks, the correction otilde on the same tiles, the read-out
    phi(q)^T Sbar_t, the residual o_rla = phi(q)^T Sbar_t - otilde (exactly 0 when every causal key
    was selected), and Sbar_t = Sbar_{t-1} + phi(k_t) v_t^T. Outputs O_SP, O_RLA [B, HQ, D] (fp32)."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, GP)
    row_ok = rows < G
    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    q_row = Q + b * stride_qb + (h * G + rows)[:, None] * stride_qh
    q = tl.load(q_row + d[None, :], mask=row_ok[:, None], other=0.0)
    tpos = tl.load(QPOS + b)
    koff = tl.load(KOFF + b)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    m_i = tl.full([GP], NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    ot = tl.zeros([GP, D], tl.float32)
    n_sel = tl.full([], 0, tl.int32)
    qf = q.to(tl.float32)
    q_max = tl.max(qf, 1)
    q_sum = tl.sum(tl.exp(qf - q_max[:, None]), 1)
    if USE_RLA:
        phiq = tl.exp(qf - q_max[:, None]) / q_sum[:, None]
    idx_base = IDX + (b * H + h) * NSEL
    for i in range(0, NSEL):
        blk = tl.load(idx_base + i)
        pos = blk * BS + j
        kmask = (blk >= 0) & (pos <= tpos)
        n_sel += tl.sum(kmask.to(tl.int32), 0)
        slot = koff + pos
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(kmask[None, :], s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(kmask[None, :], tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        if USE_RLA:
            kf = k.to(tl.float32)
            ek = tl.exp(kf - tl.max(kf, 1)[:, None])
            phik = ek / tl.sum(ek, 1)[:, None]
            if IEEE:
                a = tl.dot(phiq, tl.trans(phik), input_precision="ieee")
                ot += tl.dot(tl.where(kmask[None, :], a, 0.0), v.to(tl.float32), input_precision="ieee")
            else:
                a = tl.dot(phiq, tl.trans(phik))
                ot += tl.dot(tl.where(kmask[None, :], a, 0.0), v.to(tl.float32))
    valid = tpos >= 0
    o = tl.where(valid & (l_i > 0)[:, None], acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    out = (b * H * G + h * G + rows)[:, None] * D + d[None, :]
    tl.store(O_SP + out, o, mask=row_ok[:, None])
    if USE_RLA:
        # the new token's key and value (slot koff + tpos) update Sbar and enter the read-out
        slot_t = koff + tl.maximum(tpos, 0)
        kt = tl.load(k_base + slot_t * stride_ks + d).to(tl.float32)
        kt_max = tl.max(kt, 0)
        kt_sum = tl.sum(tl.exp(kt - kt_max), 0)
        vt = tl.load(v_base + slot_t * stride_vs + d).to(tl.float32)
        vt = tl.where(valid, vt, 0.0)
        dc = tl.arange(0, DC)
        lin = tl.zeros([GP, D], tl.float32)
        sb_base = SBAR + (b * H + h) * D * D
        sbn_base = SBAR_NEW + (b * H + h) * D * D
        for c0 in range(0, D, DC):
            qc = tl.load(q_row + c0 + dc[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            phiq_c = tl.exp(qc - q_max[:, None]) / q_sum[:, None]
            phik_c = tl.exp(tl.load(k_base + slot_t * stride_ks + c0 + dc).to(tl.float32) - kt_max) / kt_sum
            sb = tl.load(sb_base + (c0 + dc)[:, None] * D + d[None, :])
            sb = sb + phik_c[:, None] * vt[None, :]
            tl.store(sbn_base + (c0 + dc)[:, None] * D + d[None, :], sb)
            lin += tl.dot(phiq_c, sb, input_precision="ieee")
        rla = tl.where(valid & (n_sel != tpos + 1), lin - ot, 0.0)
        tl.store(O_RLA + out, rla, mask=row_ok[:, None])


def spla_decode_triton(q, k, v, q_pos, stats, sbar, koff, *, block_size, top_k_blocks, num_sink_blocks,
                       num_local_blocks, selection="taylor", use_rla=True):
    """One token per row (q [B, HQ, 1, D]) in three launches: scores, group top-k, decode kernel."""
    B, HQ, _, D = q.shape
    H, NB = stats.sum_k.shape[1], stats.num_blocks
    G = HQ // H
    GP = max(16, triton.next_power_of_2(G))
    dev = q.device
    qpos = q_pos.to(torch.int32).contiguous()
    BN = DECODE_SCORE_BN
    sc = _new((B, 1, H, G, NB), dev)
    spla_score_kernel[(1, B * H, triton.cdiv(NB, BN))](
        q, stats.sum_k.float().contiguous(), stats.sum_k2.float().contiguous(), stats.count.float().contiguous(),
        qpos, sc, q.stride(0), q.stride(1), q.stride(2),
        1, H, NB, block_size, num_sink_blocks, num_local_blocks, 1.0 / math.sqrt(D),
        G=G, GP=GP, D=D, BN=BN, TAYLOR=selection == "taylor", IEEE=DECODE_SCORE_IEEE, num_warps=4,
    )
    nsel = num_local_blocks + num_sink_blocks + top_k_blocks
    idx = _new((B, 1, H, nsel), dev, torch.int32)
    gs = _new((B, 1, H, NB), dev)
    spla_topk_kernel[(1, B * H)](
        sc, qpos, gs, idx, 1, H, NB, block_size, num_sink_blocks, num_local_blocks, top_k_blocks, nsel,
        G=G, GP=GP, BN=128, NBP=max(16, triton.next_power_of_2(NB)), num_warps=4 if NB <= 4096 else 8,
    )
    o_sp = _new((B, HQ, 1, D), dev)
    o_rla = _new((B, HQ, 1, D), dev) if use_rla else o_sp
    sbar_new = _new(tuple(sbar.shape), dev) if use_rla else sbar
    spla_decode_kernel[(B * H,)](
        q, k, v, idx, qpos, koff, sbar.float().contiguous(), o_sp, o_rla, sbar_new,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        H, nsel, 1.0 / math.sqrt(D),
        G=G, GP=GP, D=D, BS=block_size, DC=min(32, D), USE_RLA=use_rla, IEEE=q.dtype == torch.float32,
        num_warps=DECODE_WARPS, num_stages=2,
    )
    if not use_rla:
        valid = (q_pos >= 0)[:, None, :, None]
        kv_t = torch.einsum("bhsd,bhse->bhde", feature_map(k[:, :, -1:]) * valid, v[:, :, -1:].float())
        return o_sp.to(q.dtype), None, sbar + kv_t
    return o_sp.to(q.dtype), o_rla.to(q.dtype), sbar_new


#: Tests set this to fill every kernel output with NaN before the launch (poisoned outputs).
POISON_OUTPUTS = False


def _new(shape, device, dtype=torch.float32):
    if POISON_OUTPUTS:
        return torch.full(shape, -1 if dtype == torch.int32 else float("nan"), device=device, dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype)



def select_block_indices(q, stats, q_pos, *, block_size, top_k_blocks, num_sink_blocks, num_local_blocks,
                         selection="taylor") -> torch.Tensor:
    """The selected blocks of every query as int32 indices [B, Tq, H, sink + local + top_k] (-1 = none),
    from the scoring kernel plus one top-k, with no host synchronisation. Same selection as
    `reference.select_blocks`."""
    B, HQ, Tq, D = q.shape
    H, NB = stats.sum_k.shape[1], stats.num_blocks
    G = HQ // H
    dev = q.device
    BN = 32
    sc = _new((B, Tq, H, G, NB), dev)
    spla_score_kernel[(Tq, B * H, triton.cdiv(NB, BN))](
        q, stats.sum_k.float().contiguous(), stats.sum_k2.float().contiguous(), stats.count.float().contiguous(),
        q_pos.to(torch.int32).contiguous(), sc, q.stride(0), q.stride(1), q.stride(2),
        Tq, H, NB, block_size, num_sink_blocks, num_local_blocks, 1.0 / math.sqrt(D),
        G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BN=BN, TAYLOR=selection == "taylor", num_warps=4,
    )
    cur = torch.where(q_pos >= 0, q_pos // block_size, -1)  # [B, Tq]
    nb = torch.arange(NB, device=dev)
    cand = (nb < cur[..., None]) & (nb >= num_sink_blocks) & (nb <= cur[..., None] - num_local_blocks)
    gs = torch.softmax(sc, dim=-1).sum(-2).masked_fill(~cand[:, :, None], -1.0)  # [B, Tq, H, NB] group score
    # forced blocks: local ones (cur - n_local, cur], then sinks below them
    loc = cur[..., None] - torch.arange(num_local_blocks, device=dev)  # [B, Tq, nl]
    sink = torch.arange(num_sink_blocks, device=dev).expand(B, Tq, num_sink_blocks)
    sink = torch.where(sink <= cur[..., None] - num_local_blocks, sink, -1)
    forced = torch.cat([torch.where(loc >= 0, loc, -1), sink], -1)  # [B, Tq, nl + ns]
    free = top_k_blocks - (forced >= 0).sum(-1)  # [B, Tq]
    kk = min(top_k_blocks, NB)
    val, top = gs.topk(kk, dim=-1) if kk else (gs[..., :0], gs[..., :0].long())
    ok = (val >= 0) & (torch.arange(kk, device=dev) < free[:, :, None, None])
    picked = torch.where(ok, top, -1)
    forced = forced[:, :, None, :].expand(B, Tq, H, forced.shape[-1])
    return torch.cat([forced, picked], -1).to(torch.int32).contiguous()


def selected_block_indices(sel: torch.Tensor, top_k: int) -> torch.Tensor:
    """bool [B, H, T, NB] -> int32 [B, T, H, top_k] block indices (descending), -1 for none."""
    NB = sel.shape[-1]
    ar = torch.arange(NB, device=sel.device, dtype=torch.int32)
    idx = torch.where(sel, ar, torch.full_like(ar, -1))
    idx = idx.sort(dim=-1, descending=True).values[..., : min(top_k, NB)]
    if idx.shape[-1] < top_k:
        idx = torch.nn.functional.pad(idx, (0, top_k - idx.shape[-1]), value=-1)
    return idx.permute(0, 2, 1, 3).contiguous()


def causal_linear_term(phiq, phik, v, sbar, valid, chunk: int = 64):
    """phi(q_t)^T (Sbar + sum_{new j <= t} phi(k_j) v_j^T) for the new tokens, chunked; returns (o, new Sbar).
    phiq: [B, H, G, T, D], phik, v: [B, H, T, D] (fp32), valid: [B, T]."""
    B, H, G, T, D = phiq.shape
    phik = phik * valid[:, None, :, None]
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:
        phiq = torch.nn.functional.pad(phiq, (0, 0, 0, pad))
        phik = torch.nn.functional.pad(phik, (0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    qc = phiq.view(B, H, G, n, chunk, D)
    kc = phik.view(B, H, n, chunk, D)
    vc = v.view(B, H, n, chunk, D)
    kv = torch.einsum("bhncd,bhnce->bhnde", kc, vc)  # per-chunk sums
    states = torch.cumsum(kv, dim=2) - kv + sbar[:, :, None]  # state before each chunk
    inter = torch.einsum("bhgncd,bhnde->bhgnce", qc, states)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    a = torch.einsum("bhgncd,bhnsd->bhgncs", qc, kc) * causal
    intra = torch.einsum("bhgncs,bhnse->bhgnce", a, vc)
    o = (inter + intra).reshape(B, H, G, n * chunk, D)[..., :T, :]
    return o, sbar + kv.sum(2)


def spla_attention_triton(
    q, k, v, q_pos, k_pos, stats: BlockStats, sbar, *, block_size, top_k_blocks, num_sink_blocks,
    num_local_blocks, selection="taylor", use_rla=True, query_chunk=None, num_splits=None, k_offsets=None,
):
    """Same contract as `spla_attention_reference` (q [B, HQ, Tq, D], k, v [B, H, S, D] with the new
    tokens last); returns (o_sp, o_rla or None, new Sbar). `k_offsets` [B]: slot of each row's position
    0 (`left_pad_offsets(k_pos)`, computed here when not given); rows padded elsewhere than on the left
    take the reference path."""
    from .reference import spla_attention_reference

    B, HQ, Tq, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = HQ // H
    koff = left_pad_offsets(k_pos) if k_offsets is None else k_offsets
    if koff is None or D not in (16, 32, 64, 128, 256) or block_size < 16:
        return spla_attention_reference(
            q, k, v, q_pos, k_pos, stats, sbar, block_size=block_size, top_k_blocks=top_k_blocks,
            num_sink_blocks=num_sink_blocks, num_local_blocks=num_local_blocks, selection=selection,
            use_rla=use_rla, query_chunk=query_chunk,
        )
    kw = dict(block_size=block_size, top_k_blocks=top_k_blocks, num_sink_blocks=num_sink_blocks,
              num_local_blocks=num_local_blocks, selection=selection)
    if Tq == 1 and q.dtype != torch.float64 and num_splits is None:  # decode: three launches
        return spla_decode_triton(q, k, v, q_pos, stats, sbar, koff, use_rla=use_rla, **kw)
    if Tq <= SCORE_KERNEL_MAX_TQ:  # decode and short chunks: fused scoring, no host sync
        idx = select_block_indices(q, stats, q_pos, **kw)  # [B, Tq, H, K]
    else:  # long prefill: scores as batched matmuls
        idx = selected_block_indices(select_blocks(q, stats, q_pos, **kw), top_k_blocks)
    K_sel = idx.shape[-1]
    if num_splits is None:
        num_splits = max(1, min(K_sel, 264 // max(1, B * H * Tq))) if Tq <= 8 else 1
    per = -(-K_sel // num_splits)
    num_splits = -(-K_sel // per)
    GP = max(16, triton.next_power_of_2(G))
    dev = q.device
    o_part = _new((num_splits, B, Tq, HQ, D), dev)
    ot_part = _new((num_splits, B, Tq, HQ, D), dev) if use_rla else o_part
    m_part = _new((num_splits, B, Tq, HQ), dev)
    l_part = _new((num_splits, B, Tq, HQ), dev)
    qpos = q_pos.to(torch.int32).contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    ieee = q.dtype in (torch.float32, torch.float64)
    if q.dtype == torch.float64:  # fp64 inputs (tests) run the kernel in fp32
        q, k, v = q.float(), k.float(), v.float()
    spla_sparse_kernel[(Tq, B * H, num_splits)](
        q, k, v, idx, qpos, koff, o_part, ot_part, m_part, l_part,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        Tq, H, K_sel, per, 1.0 / math.sqrt(D),
        G=G, GP=GP, D=D, BS=block_size, USE_RLA=use_rla, IEEE=ieee,
        num_warps=4, num_stages=2,
    )
    m = m_part.max(0).values
    w = torch.exp(m_part - m[None])  # [nsp, B, Tq, HQ]
    l_sum = (w * l_part).sum(0)
    o_sp = (w[..., None] * o_part).sum(0) / l_sum.clamp(min=1e-30)[..., None]
    q_ok = (q_pos >= 0)[:, :, None, None]
    o_sp = (o_sp * q_ok).transpose(1, 2)  # [B, HQ, Tq, D]
    out_dtype = torch.float64 if sbar.dtype == torch.float64 else q.dtype
    acc = acc_dtype(sbar)
    if not use_rla:
        kv_new = torch.einsum("bhsd,bhse->bhde", feature_map(k[:, :, S - Tq:]).to(acc) *
                              (q_pos >= 0)[:, None, :, None], v[:, :, S - Tq:].to(acc))
        return o_sp.to(out_dtype), None, sbar + kv_new
    otilde = ot_part.sum(0)  # [B, Tq, HQ, D]
    phiq = feature_map(q).to(acc).view(B, H, G, Tq, D)
    o_lin, sbar_new = causal_linear_term(
        phiq, feature_map(k[:, :, S - Tq:]).to(acc), v[:, :, S - Tq:].to(acc), sbar.to(acc), q_pos >= 0,
        chunk=min(64, Tq),
    )
    o_rla = o_lin.reshape(B, HQ, Tq, D) - otilde.transpose(1, 2).to(acc)
    # every causal key selected -> the residual term is exactly zero (not a cancellation)
    start = idx.long() * block_size  # [B, Tq, H, K]
    tp = q_pos[:, :, None, None].long()
    n_sel = torch.where(idx >= 0, (tp - start + 1).clamp(0, block_size), 0).sum(-1)  # [B, Tq, H]
    all_sel = (n_sel == (q_pos[:, :, None] + 1)).permute(0, 2, 1)  # [B, H, Tq]
    o_rla = o_rla.view(B, H, G, Tq, D).masked_fill(all_sel[:, :, None, :, None], 0.0).view(B, HQ, Tq, D)
    o_rla = o_rla * q_ok.transpose(1, 2)
    return o_sp.to(out_dtype), o_rla.to(out_dtype), sbar_new
