"""SPLA decode with Triton: one new token per row in four launches (scores, group top-k, the split
decode kernel, the merge), reading only the selected KV blocks; and `append_token_triton`, which
writes the token into a static cache (its key and value at their slot, its block sums) in one
launch. No host synchronisation."""

from __future__ import annotations

import math

import torch

from ..triton_launch import jit
from ..triton_utils import next_power_of_2
from ..utils import import_triton, new_output
from .plan import Launch, SPLAParams
from .stats import feature_map, new_tokens
from .triton_common import NEG, selected_blocks, softmax_rows
from .triton_select import select_indices

triton, tl = import_triton()


@jit
def spla_decode_kernel(
    Q, K, V, IDX, QPOS, KOFF, SBAR, M_PART, L_PART, O_PART, OT_PART, N_PART, LIN, SBAR_NEW,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    H, NSEL, PER_SPLIT, NSPLIT, scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, DC: tl.constexpr,
    USE_RLA: tl.constexpr, IEEE: tl.constexpr,
):
    """One decode token of one (batch, KV head), split over NSPLIT + 1 programs. Program sp < NSPLIT
    takes selected-block slots [sp * PER_SPLIT, (sp + 1) * PER_SPLIT): the partial online softmax
    (M, L, O parts), the correction otilde on the same tiles (OT part) and the number of causal keys it
    saw (N part). Program NSPLIT (with the residual term) reads out phi(q)^T Sbar_t into LIN and writes
    Sbar_t = Sbar_{t-1} + phi(k_t) v_t^T. `spla_decode_merge_kernel` combines the parts."""
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, GP)
    row_ok = rows < G
    d = tl.arange(0, D)
    q_row = Q + b * stride_qb + (h * G + rows)[:, None] * stride_qh
    tpos = tl.load(QPOS + b)
    koff = tl.load(KOFF + b)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    part = (sp * tl.num_programs(0) + bh) * G + rows
    if sp < NSPLIT:
        q = tl.load(q_row + d[None, :], mask=row_ok[:, None], other=0.0)
        phiq = q
        if USE_RLA:
            phiq = softmax_rows(q)
        m_i, l_i, acc, ot, n_sel = selected_blocks(
            q, phiq, IDX + (b * H + h) * NSEL, sp * PER_SPLIT, PER_SPLIT, NSEL, tpos, koff, k_base, v_base, k_base,
            stride_ks, stride_vs, stride_ks, scale,
            GP=GP, D=D, BS=BS, USE_RLA=USE_RLA, IEEE=IEEE, PRE_PHIK=False, RLA_FP32=True,
        )
        tl.store(M_PART + part, m_i, mask=row_ok)
        tl.store(L_PART + part, l_i, mask=row_ok)
        tl.store(O_PART + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(N_PART + sp * tl.num_programs(0) + bh, n_sel)
        if USE_RLA:
            tl.store(OT_PART + part[:, None] * D + d[None, :], ot, mask=row_ok[:, None])
    elif USE_RLA:
        # the new token's key and value (slot koff + tpos) update Sbar and enter the read-out
        valid = tpos >= 0
        qf = tl.load(q_row + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        q_max = tl.max(qf, 1)
        q_sum = tl.sum(tl.exp(qf - q_max[:, None]), 1)
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
        tl.store(LIN + ((b * H + h) * G + rows)[:, None] * D + d[None, :], lin, mask=row_ok[:, None])


@jit
def spla_decode_merge_kernel(
    QPOS, M_PART, L_PART, O_PART, OT_PART, N_PART, LIN, O_SP, O_RLA,
    H, NSPLIT, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, USE_RLA: tl.constexpr,
):
    """Combine the decode parts of one (batch, KV head): o_sp = sum_s w_s O_s / sum_s w_s L_s with
    w_s = exp(M_s - max M), and o_rla = LIN - sum_s OT_s, exactly 0 when every causal key was
    selected. O_SP, O_RLA: [B, HQ, D] in the output dtype (the store rounds)."""
    bh = tl.program_id(0)
    BH = tl.num_programs(0)
    rows = tl.arange(0, GP)
    row_ok = rows < G
    d = tl.arange(0, D)
    m = tl.full([GP], NEG, tl.float32)
    for sp in range(0, NSPLIT):
        m = tl.maximum(m, tl.load(M_PART + (sp * BH + bh) * G + rows, mask=row_ok, other=NEG))
    l_sum = tl.zeros([GP], tl.float32)
    o = tl.zeros([GP, D], tl.float32)
    ot = tl.zeros([GP, D], tl.float32)
    n_sel = tl.full([], 0, tl.int32)
    for sp in range(0, NSPLIT):
        part = (sp * BH + bh) * G + rows
        w = tl.exp(tl.load(M_PART + part, mask=row_ok, other=NEG) - m)
        l_sum += w * tl.load(L_PART + part, mask=row_ok, other=0.0)
        o += w[:, None] * tl.load(O_PART + part[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        n_sel += tl.load(N_PART + sp * BH + bh)
        if USE_RLA:
            ot += tl.load(OT_PART + part[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    out = (bh * G + rows)[:, None] * D + d[None, :]
    o = tl.where((l_sum > 0)[:, None], o / tl.maximum(l_sum, 1e-30)[:, None], 0.0)
    tl.store(O_SP + out, o, mask=row_ok[:, None])
    if USE_RLA:
        tpos = tl.load(QPOS + bh // H)
        rla = tl.load(LIN + out, mask=row_ok[:, None], other=0.0) - ot
        rla = tl.where((tpos >= 0) & (n_sel != tpos + 1), rla, 0.0)
        tl.store(O_RLA + out, rla, mask=row_ok[:, None])


def spla_decode_triton(q, k, v, q_pos, stats, sbar, koff, params: SPLAParams, *, launch: Launch | None = None,
                       new_kv=None, precision: str = "ieee"):
    """SPLA of one new token per row in four launches: block scores, group top-k, the split decode
    kernel (selected tiles in parallel with the Sbar read-out and update), and the merge; `launch`
    sets them (default `Launch()`); the selected tiles' dots of fp32 operands at `precision` ("ieee"
    or "tf32").

    q [B, 1, HQ, D], k, v [B, S, H, D] (any strides with unit stride in D: the cache's [B, H, S, D]
    buffers pass as transposed views), the new token at slot koff + q_pos (last in a growing cache;
    anywhere in a static cache's whole buffers, with its key and value also in `new_kv` [B, 1, H, D]
    each); koff [B] int32: slot of each row's position 0 (`slot_offsets`). Returns (o_sp [B, 1, HQ, D],
    o_rla or None, new Sbar). No host synchronisation and no data-dependent shapes."""
    B, _, HQ, D = q.shape
    H = stats.sum_k.shape[1]
    G = HQ // H
    GP = max(16, next_power_of_2(G))
    dev = q.device
    qpos = q_pos.to(torch.int32).contiguous()
    launch = Launch() if launch is None else launch
    block_size, use_rla = params.block_size, params.use_rla
    idx = select_indices(q, stats, qpos, params, launch=launch)
    nsel = idx.shape[-1]
    per = min(nsel, launch.decode_blocks_per_split)
    nsplit = -(-nsel // per)
    m_part = new_output((nsplit, B * H * G), dev)
    l_part = new_output((nsplit, B * H * G), dev)
    o_part = new_output((nsplit, B * H * G, D), dev)
    ot_part = new_output((nsplit, B * H * G, D), dev) if use_rla else o_part
    n_part = new_output((nsplit, B * H), dev, torch.int32)
    qv, kv_, vv = (x.transpose(1, 2) for x in (q, k, v))  # views [B, H, T, D]
    lin = new_output((B, HQ, 1, D), dev) if use_rla else o_part
    sbar_new = new_output(tuple(sbar.shape), dev) if use_rla else sbar
    spla_decode_kernel[(B * H, nsplit + int(use_rla))](
        qv, kv_, vv, idx, qpos, koff, sbar.float().contiguous(), m_part, l_part, o_part, ot_part, n_part, lin,
        sbar_new, qv.stride(0), qv.stride(1), kv_.stride(0), kv_.stride(1), kv_.stride(2),
        vv.stride(0), vv.stride(1), vv.stride(2),
        H, nsel, per, nsplit, 1.0 / math.sqrt(D),
        G=G, GP=GP, D=D, BS=block_size, DC=min(32, D), USE_RLA=use_rla,
        IEEE=q.dtype == torch.float32 and precision == "ieee",
        num_warps=launch.decode_warps, num_stages=2,
    )
    o_sp = new_output((B, 1, HQ, D), dev, q.dtype)  # the merge writes [B, HQ, D] rows
    o_rla = new_output((B, 1, HQ, D), dev, q.dtype) if use_rla else o_sp
    spla_decode_merge_kernel[(B * H,)](
        qpos, m_part, l_part, o_part, ot_part, n_part, lin, o_sp, o_rla, H, nsplit,
        G=G, GP=GP, D=D, USE_RLA=use_rla, num_warps=4,
    )
    if not use_rla:
        valid = (q_pos >= 0)[:, None, :, None]
        k_new, v_new = (x.transpose(1, 2) for x in new_tokens(k, v, 1, new_kv))
        kv_t = torch.einsum("bhsd,bhse->bhde", feature_map(k_new) * valid, v_new.float())
        return o_sp, None, sbar + kv_t
    return o_sp, o_rla, sbar_new


@jit
def spla_append_kernel(
    KNEW, VNEW, K, V, SLOT, POS, SUMK, SUMK2, CNT,
    stride_nb, stride_nh, stride_vnb, stride_vnh,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_sb, stride_sh, stride_sn, stride_cb,
    H, block_size, D: tl.constexpr,
):
    """One new token of one (batch, KV head): its key and value into slot SLOT of K, V, and (a real
    token, POS >= 0) its key into the sums of its block; the count by the head-0 program."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    d = tl.arange(0, D)
    k = tl.load(KNEW + b * stride_nb + h * stride_nh + d)
    v = tl.load(VNEW + b * stride_vnb + h * stride_vnh + d)
    slot = tl.load(SLOT)
    tl.store(K + b * stride_kb + h * stride_kh + slot * stride_ks + d, k)
    tl.store(V + b * stride_vb + h * stride_vh + slot * stride_vs + d, v)
    pos = tl.load(POS + b)
    if pos >= 0:
        blk = pos // block_size
        kf = k.to(tl.float32)
        s = b * stride_sb + h * stride_sh + blk * stride_sn + d
        tl.store(SUMK + s, tl.load(SUMK + s) + kf)
        tl.store(SUMK2 + s, tl.load(SUMK2 + s) + kf * kf)
        if h == 0:
            c = CNT + b * stride_cb + blk
            tl.store(c, tl.load(c) + 1.0)


def append_token_triton(K, V, stats, k, v, slot, pos, block_size: int) -> None:
    """Write one new token per row, k, v [B, H, 1, D], at slot `slot` (a device scalar, the same for
    every row) of K, V [B, H, S, D] and add the real ones (pos [B, 1] >= 0) to the block sums of
    `stats` (fp32, unit stride in D), in place: `append_token`'s one-launch form."""
    B, H, _, D = k.shape
    spla_append_kernel[(B * H,)](
        k, v, K, V, slot, pos[:, 0].contiguous(), stats.sum_k, stats.sum_k2, stats.count,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        K.stride(0), K.stride(1), K.stride(2), V.stride(0), V.stride(1), V.stride(2),
        stats.sum_k.stride(0), stats.sum_k.stride(1), stats.sum_k.stride(2), stats.count.stride(0),
        H, block_size, D=D, num_warps=1,
    )
