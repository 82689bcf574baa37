"""SPLA prefill and training with Triton (`spla_parallel_triton`), which executes an `SPLAPlan`
("triton" path): the selection the plan names (`select_indices_fast`, one launch per query tile;
`select_indices_stream`, streamed; or `triton_select.select_indices`), then the sparse kernels of
its form, the block-major kernels of `triton_blocks` ("blocks": the selected (token, block) pairs
grouped by block, forward and backward; the training default), the query-tile kernels of
`triton_tile` ("tile": the union of a query tile's blocks loaded once per tile, forward and
backward; the prefill default) or the per-token kernels of this module ("token", with split-K for
a few tokens without gradients), then the residual term, all at the plan's dot precision.

The per-token form: `spla_sparse_kernel` runs one program per (query token,
batch x KV head, split): the G query heads of the group are the rows of one tile (padded to at least
16 for tl.dot), and the program loops over the token's selected KV blocks (`selected_blocks`) doing
the online softmax of the sparse branch and, on the same K/V tiles, the correction
otilde = sum_{selected j} (phi(q).phi(k_j)) v_j of the residual term. Unselected blocks are never
read. Short query chunks split the selected blocks over several programs (split-K) and merge the
partial softmax states afterwards. The global causal linear term phi(q)^T Sbar_t runs on the chunked
linear-attention kernels of `kernels/gla` (`causal_linear_term`, forward and backward); the sparse
branch's backward is `triton_parallel_bwd`.
"""

from __future__ import annotations

import math

import torch

from ..gla.triton_chunk import chunk_linear_attention
from ..triton_launch import jit
from ..triton_utils import cdiv, half_or_fp32, next_power_of_2, rows_per_program
from ..utils import acc_dtype, import_triton, new_output
from .plan import UNION_TILE_MAX, SPLAParams, SPLAPlan, UnionHint
from .stats import BlockStats, feature_map, new_tokens, state_increment
from .triton_blocks import RLAEpilogue, blocks_sparse_attention
from .triton_common import key_features, selected_blocks, softmax_rows
from .triton_parallel_bwd import sparse_backward
from .triton_select import select_indices
from .triton_select_stream import select_indices_stream
from .triton_tile import query_tile_union, select_indices_fast, tile_sparse_attention

triton, tl = import_triton()

__all__ = ["FeatureRows", "ResidualTerm", "SparseAttention", "causal_linear_term", "dropped_rows",
           "dropped_rows_reference", "feature_rows", "key_features", "residual_term", "residual_term_reference",
           "sparse_forward", "spla_parallel_triton"]


@jit
def spla_sparse_kernel(
    Q, K, V, PHIK, IDX, QPOS, KOFF, O_ACC, O_TIL, M_OUT, L_OUT,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_pb, stride_ph, stride_ps,
    T, H, NSEL, PER_SPLIT, scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    USE_RLA: tl.constexpr, IEEE: tl.constexpr, PRE_PHIK: tl.constexpr = False,
):
    """One (query token, batch x KV head, split) over its selected-block slots [sp * PER_SPLIT,
    (sp + 1) * PER_SPLIT): the partial softmax state (M, L, unnormalised O) and the correction
    otilde, written as rows [nsp, B, T, HQ]."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    sp = tl.program_id(2)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, GP)
    row_ok = rows < G
    d = tl.arange(0, D)
    q_ptr = Q + b * stride_qb + (h * G + rows)[:, None] * stride_qh + t * stride_qt + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)
    tpos = tl.load(QPOS + b * T + t)
    koff = tl.load(KOFF + b)
    phiq = q
    if USE_RLA:
        phiq = softmax_rows(q)
    m_i, l_i, acc, ot, _ = selected_blocks(
        q, phiq, IDX + (b * T + t) * H * NSEL + h * NSEL, sp * PER_SPLIT, PER_SPLIT, NSEL, tpos, koff,
        K + b * stride_kb + h * stride_kh, V + b * stride_vb + h * stride_vh, PHIK + b * stride_pb + h * stride_ph,
        stride_ks, stride_vs, stride_ps, scale,
        GP=GP, D=D, BS=BS, USE_RLA=USE_RLA, IEEE=IEEE, PRE_PHIK=PRE_PHIK, RLA_FP32=False,
    )
    HQ = H * G
    out_row = ((sp * (tl.num_programs(1) // H) + b) * T + t) * HQ + h * G + rows  # [nsp, B, T, HQ]
    tl.store(M_OUT + out_row, m_i, mask=row_ok)
    tl.store(L_OUT + out_row, l_i, mask=row_ok)
    tl.store(O_ACC + out_row[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    if USE_RLA:
        tl.store(O_TIL + out_row[:, None] * D + d[None, :], ot, mask=row_ok[:, None])


@jit
def residual_term_kernel(A, B, DROP, OUT, N, G, D: tl.constexpr, ROWS: tl.constexpr, BACKWARD: tl.constexpr):
    """Forward: OUT = (A - B) rounded to OUT's dtype, 0 on dropped rows; backward (A the incoming
    gradient): OUT = A in fp32, 0 on dropped rows, and B = -OUT. Rows of D; row r's flag DROP[r // G]."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < N
    keep = ok & (tl.load(DROP + r // G, mask=ok, other=1) == 0)
    offs = r.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    a = tl.load(A + offs, mask=keep[:, None], other=0.0).to(tl.float32)
    if BACKWARD:
        tl.store(OUT + offs, a, mask=ok[:, None])
        tl.store(B + offs, -a, mask=ok[:, None])
    else:
        b = tl.load(B + offs, mask=keep[:, None], other=0.0).to(tl.float32)
        tl.store(OUT + offs, (a - b).to(OUT.dtype.element_ty), mask=ok[:, None])


def _residual_launch(a, b, drop, out, backward: bool) -> None:
    D = a.shape[-1]
    n = a.numel() // D
    rows = rows_per_program(D, 4096, 128)
    if n:
        residual_term_kernel[(cdiv(n, rows),)](a, b, drop, out, n, n // drop.numel(), D=D, ROWS=rows,
                                                     BACKWARD=backward, num_warps=4)


class ResidualTerm(torch.autograd.Function):
    """o_rla = o_lin - otilde on the kept rows, 0 on the dropped ones, in `out_dtype`: one pass forward
    and one backward (the PyTorch form, `residual_term_reference`, takes three or four each way)."""

    @staticmethod
    def forward(ctx, o_lin, otilde, drop, out_dtype):
        o_lin, otilde = o_lin.contiguous(), otilde.contiguous()
        out = new_output(o_lin.shape, o_lin.device, out_dtype)
        drop = drop.contiguous().view(torch.uint8)
        _residual_launch(o_lin, otilde, drop, out, False)
        ctx.save_for_backward(drop)
        ctx.dtypes = o_lin.dtype, otilde.dtype
        return out

    @staticmethod
    def backward(ctx, g):
        (drop,) = ctx.saved_tensors
        g = g.contiguous()
        da, db = (new_output(g.shape, g.device) for _ in range(2))
        _residual_launch(g, db, drop, da, True)
        return da.to(ctx.dtypes[0]), db.to(ctx.dtypes[1]), None, None


def residual_term_reference(o_lin, otilde, drop, out_dtype):
    """`ResidualTerm`'s values in PyTorch: o_lin, otilde [B, T, HQ, D], drop [B, T, H] bool."""
    B, T, H = drop.shape
    o = (o_lin - otilde).reshape(B, T, H, -1, o_lin.shape[-1]).masked_fill(drop[..., None, None], 0.0)
    return o.reshape(o_lin.shape).to(out_dtype)


def residual_term(o_lin, otilde, drop, out_dtype):
    """o_rla = o_lin - otilde, 0 where drop [B, T, H] (every causal key selected, or padding), in
    `out_dtype`: one Triton pass each way (`ResidualTerm`); fp64 outputs (tests) in PyTorch."""
    if out_dtype == torch.float64:
        return residual_term_reference(o_lin, otilde, drop, out_dtype)
    return ResidualTerm.apply(o_lin, otilde, drop, out_dtype)


@jit
def dropped_rows_kernel(IDX, QPOS, DROP, N, H, NSEL, BS, ROWS: tl.constexpr, KP: tl.constexpr):
    """DROP[r] = 1 where (token, KV head) row r = (b * T + t) * H + h of IDX [B, T, H, NSEL] selects every
    causal key of its token (sum over the slots of the causal keys each holds == tpos + 1) or is a
    padded query (tpos < 0), else 0."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < N
    r64 = r.to(tl.int64)
    tpos = tl.load(QPOS + r64 // H, mask=ok, other=-1)
    i = tl.arange(0, KP)
    blk = tl.load(IDX + r64[:, None] * NSEL + i[None, :], mask=ok[:, None] & (i[None, :] < NSEL), other=-1)
    held = tl.minimum(tl.maximum(tpos[:, None] - blk * BS + 1, 0), BS)
    n_sel = tl.sum(tl.where(blk >= 0, held, 0), 1)
    drop = (n_sel == tpos + 1) | (tpos < 0)
    tl.store(DROP + r64, drop.to(tl.uint8), mask=ok)


def dropped_rows_reference(idx: torch.Tensor, q_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """`dropped_rows` in PyTorch: bool [B, T, H]."""
    start = idx.long() * block_size  # [B, T, H, K]
    tp = q_pos[:, :, None, None].long()
    n_sel = torch.where(idx >= 0, (tp - start + 1).clamp(0, block_size), 0).sum(-1)  # [B, T, H]
    return (n_sel == (q_pos[:, :, None] + 1)) | (q_pos < 0)[:, :, None]


def dropped_rows(idx: torch.Tensor, q_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Which (token, KV head) rows the residual term is exactly 0 on, bool [B, T, H]: the row's selection
    idx [B, T, H, NSEL] (int32, -1 = none) holds every causal key of its token at position q_pos [B, T]
    (nothing is left for the linear term: not a cancellation), or the token is padding (q_pos < 0). One
    Triton launch (`dropped_rows_kernel`) in place of the PyTorch form's six."""
    B, T, H, K = idx.shape
    drop = torch.empty(B, T, H, device=idx.device, dtype=torch.bool)
    n = B * T * H
    if n:
        rows = 128
        dropped_rows_kernel[(cdiv(n, rows),)](idx.contiguous(), q_pos.to(torch.int32).contiguous(),
                                              drop.view(torch.uint8), n, H, K, block_size, ROWS=rows,
                                              KP=max(2, next_power_of_2(K)), num_warps=4)
    return drop


@jit
def feature_rows_kernel(X, GRAD, OUT, N, A1, A2, stride_0, stride_1, stride_2,
                        D: tl.constexpr, ROWS: tl.constexpr, BACKWARD: tl.constexpr):
    """phi(x) = softmax over D in fp32 for rows r = (i0 A1 + i1) A2 + i2 of X [A0, A1, A2, D] (any strides,
    unit in D), written to the contiguous OUT in its dtype; BACKWARD: OUT = phi * (g - sum(g phi)) for the
    contiguous gradient rows GRAD, phi recomputed from X."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < N
    r64 = r.to(tl.int64)
    i2 = r64 % A2
    i1 = (r64 // A2) % A1
    i0 = r64 // (A2 * A1)
    d = tl.arange(0, D)[None, :]
    x = tl.load(X + (i0 * stride_0 + i1 * stride_1 + i2 * stride_2)[:, None] + d, mask=ok[:, None], other=0.0)
    phi = softmax_rows(x)
    dst = r64[:, None] * D + d
    if BACKWARD:
        g = tl.load(GRAD + dst, mask=ok[:, None], other=0.0).to(tl.float32)
        phi = phi * (g - tl.sum(g * phi, 1)[:, None])
    tl.store(OUT + dst, phi.to(OUT.dtype.element_ty), mask=ok[:, None])


def _feature_rows_launch(x, grad, out, backward: bool) -> None:
    A0, A1, A2, D = x.shape
    n = A0 * A1 * A2
    rows = rows_per_program(D, 4096, 128)
    if n:
        feature_rows_kernel[(cdiv(n, rows),)](x, grad, out, n, A1, A2, x.stride(0), x.stride(1), x.stride(2),
                                                    D=D, ROWS=rows, BACKWARD=backward, num_warps=4)


class FeatureRows(torch.autograd.Function):
    """phi(x) (softmax over the head dim in fp32) of x [B, T, heads, D] (any strides, unit in D) in
    `out_dtype`, contiguous: one pass forward, one backward (phi recomputed from x), against the
    PyTorch form's softmax, cast and their two backward ops."""

    @staticmethod
    def forward(ctx, x, out_dtype):
        out = new_output(x.shape, x.device, out_dtype)
        _feature_rows_launch(x, x, out, False)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        dx = new_output(x.shape, x.device, x.dtype)
        _feature_rows_launch(x, g.contiguous(), dx, True)
        return dx, None


def feature_rows(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`feature_map(x).to(out_dtype)` for x [B, T, heads, D]: `FeatureRows` (one Triton pass each way) where
    x has unit stride in D and is not fp64, else PyTorch."""
    if x.dtype == torch.float64 or x.stride(-1) != 1:
        return feature_map(x).to(out_dtype)
    return FeatureRows.apply(x, out_dtype)


def causal_linear_term(phiq, phik, v, sbar, valid, precision=None):
    """phi(q_t)^T (Sbar + sum_{new j <= t} phi(k_j) v_j^T) for the new tokens on the chunked kernels of
    `kernels/gla` (the chunk states once per KV head, read by its G query heads); returns (o [B, T, HQ, D]
    fp32, new Sbar). phiq: [B, T, HQ, D], phik, v: [B, T, H, D] of one dtype (fp64 runs in fp32), valid:
    [B, T] (padding writes nothing; None: every token real); `precision` for fp32: "tf32" (default) or
    "ieee"."""
    dt = torch.float32 if phiq.dtype == torch.float64 else phiq.dtype
    phik = phik.to(dt) if valid is None else phik.to(dt) * valid[..., None, None]
    o, s = chunk_linear_attention(phiq.to(dt), phik, v.to(dt), initial_state=sbar,
                                  precision=precision or "tf32", out_dtype=torch.float32)
    return o, s.to(sbar.dtype)


def sparse_forward(q, k, v, idx, qpos, koff, use_rla, block_size, num_splits=1, phik=None, precision="ieee"):
    """The sparse kernel over the selected blocks idx [B, Tq, H, K] (split-K over `num_splits`
    programs, merged here); `phik` (`key_features(k)`, optional) spares the kernel the feature map
    of every loaded tile; `precision`: the dots of fp32 operands, "ieee" or "tf32". Returns o_sp
    (normalised), otilde (or None) [B, Tq, HQ, D] fp32 and the log-sum-exp [B, Tq, HQ] of the
    sparse softmax."""
    B, HQ, Tq, D = q.shape
    H = k.shape[1]
    G = HQ // H
    K_sel = idx.shape[-1]
    per = -(-K_sel // num_splits)
    num_splits = -(-K_sel // per)
    dev = q.device
    o_part = new_output((num_splits, B, Tq, HQ, D), dev)
    ot_part = new_output((num_splits, B, Tq, HQ, D), dev) if use_rla else o_part
    m_part = new_output((num_splits, B, Tq, HQ), dev)
    l_part = new_output((num_splits, B, Tq, HQ), dev)
    pk = k if phik is None else phik
    spla_sparse_kernel[(Tq, B * H, num_splits)](
        q, k, v, pk, idx, qpos, koff, o_part, ot_part, m_part, l_part,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        pk.stride(0), pk.stride(1), pk.stride(2),
        Tq, H, K_sel, per, 1.0 / math.sqrt(D),
        G=G, GP=max(16, next_power_of_2(G)), D=D, BS=block_size, USE_RLA=use_rla,
        IEEE=q.dtype == torch.float32 and precision == "ieee", PRE_PHIK=phik is not None, num_warps=4, num_stages=2,
    )
    if num_splits == 1:
        m, l_sum, o = m_part[0], l_part[0], o_part[0]
    else:
        m = m_part.max(0).values
        w = torch.exp(m_part - m[None])  # [nsp, B, Tq, HQ]
        l_sum = (w * l_part).sum(0)
        o = (w[..., None] * o_part).sum(0)
    o_sp = o / l_sum.clamp(min=1e-30)[..., None]
    lse = torch.where(l_sum > 0, m + torch.log(l_sum.clamp(min=1e-30)), 0.0)
    otilde = (ot_part[0] if num_splits == 1 else ot_part.sum(0)) if use_rla else None
    return o_sp, otilde, lse


class SparseAttention(torch.autograd.Function):
    """The sparse branch and the correction otilde with Triton kernels for the backward pass too:
    dq per query token over its selected blocks, dk/dv per key block over the queries that selected
    it. The selection itself (idx) carries no gradient, as in the reference."""

    @staticmethod
    def forward(ctx, q, k, v, idx, qpos, koff, use_rla, block_size, precompute_phik=False, precision="ieee"):
        phik = key_features(k) if use_rla and precompute_phik else None
        o, ot, lse = sparse_forward(q, k, v, idx, qpos, koff, use_rla, block_size, phik=phik, precision=precision)
        ctx.save_for_backward(q, k, v, idx, qpos, koff, o, lse, phik)
        ctx.use_rla, ctx.block_size, ctx.precision = use_rla, block_size, precision
        return o, ot

    @staticmethod
    def backward(ctx, do, dot_):
        q, k, v, idx, qpos, koff, o, lse, phik = ctx.saved_tensors
        dq, dk, dv = sparse_backward(q, k, v, idx, qpos, koff, o, lse, phik, do, dot_, ctx.use_rla, ctx.block_size,
                                     precision=ctx.precision)
        return dq, dk, dv, None, None, None, None, None, None, None


def spla_parallel_triton(q, k, v, q_pos, k_pos, stats: BlockStats, sbar, koff, params: SPLAParams, plan: SPLAPlan,
                         new_kv=None, causal: bool = False, union_hint: UnionHint | None = None, rla_norm=None):
    """SPLA of the new tokens with the Triton kernels the plan names, the contract of
    `parallel.spla_parallel`: q [B, Tq, HQ, D], k, v [B, S, H, D] (any strides with unit stride in D)
    with the new tokens last; koff [B] int32: the slot of each row's position 0 (`slot_offsets`, not
    None: each row's tokens in consecutive slots); returns (o_sp [B, Tq, HQ, D], o_rla or None, new
    Sbar). Differentiable (Triton backward) when `plan.grad`. fp64 inputs (tests) run the kernels in
    fp32 (exact dots). `new_kv`: as in `parallel.spla_parallel`. `causal`: every query is a real token
    (`SequenceInfo.causal`), so no output or new key needs the padding mask. `union_hint`: the form
    "union" decides by the previous layer's measurement it holds (`plan.UnionHint`), else by this call's
    (one host read). `rla_norm`: (weight [HQ, D], eps) of the norm the caller adds, o_sp +
    RMSNorm_weight(o_rla); with `plan.fuse_norm`, on the block-major form without gradients, the
    combine adds it (`triton_blocks.RLAEpilogue`) and the call returns (that sum, None, new Sbar)."""
    B, Tq, HQ, D = q.shape
    H = k.shape[2]
    G = HQ // H
    block_size, use_rla = params.block_size, params.use_rla
    qpos = q_pos.to(torch.int32).contiguous()  # no copy when the caller passes int32 positions
    if plan.select == "tile":
        idx = select_indices_fast(q, stats, qpos, params, prec=plan.select_prec)  # [B, Tq, H, K]
    elif plan.select == "stream":
        idx = select_indices_stream(q, stats, qpos, params, precision=plan.select_prec)  # [B, Tq, H, K]
    else:
        idx = select_indices(q, stats, qpos, params, matmul=plan.select == "matmul", launch=plan.launch)
    qv, kv_, vv = (x.transpose(1, 2) for x in (q, k, v))  # views [B, H, T, D]
    # kernel operands: unit stride in the head dimension; fp64 inputs (tests) run the kernels in fp32
    kq, kk, kv = (x if x.stride(-1) == 1 else x.contiguous() for x in (qv, kv_, vv))
    if q.dtype == torch.float64:
        kq, kk, kv = kq.float(), kk.float(), kv.float()
    pre, prec = plan.precompute_phik, plan.precision
    form, union = plan.form, None
    if form == "union":  # tile or block-major by the measured union (one host read)
        union = query_tile_union(idx, kk.shape[2], G, block_size, plan.tile_rows)
        mean = union[2].float().mean()
        form = "blocks" if (float(mean) if union_hint is None else union_hint.decide(mean)) > UNION_TILE_MAX else "tile"
    out_dtype = torch.float64 if sbar.dtype == torch.float64 else q.dtype
    acc = acc_dtype(sbar)
    k_tok, v_tok = new_tokens(k, v, Tq, new_kv)  # [B, Tq, H, D]

    def linear_term():
        """(o_lin fp32, new Sbar, dropped rows): the causal linear term in the kernels' dtype (q's) at the
        sparse kernels' precision, and the rows where every causal key is selected, so the residual term
        is exactly zero (not a cancellation), or the token is padding."""
        o_lin, sbar_new = causal_linear_term(feature_rows(q, kq.dtype), feature_rows(k_tok, kq.dtype), v_tok,
                                             sbar.to(acc), None if causal else q_pos >= 0, prec)
        return o_lin, sbar_new, dropped_rows(idx, q_pos, block_size)

    if (plan.fuse_norm and form == "blocks" and use_rla and rla_norm is not None and not plan.grad
            and out_dtype != torch.float64):
        # the residual term's subtraction and the norm-add in the sparse kernels' combine
        o_lin, sbar_new, drop = linear_term()
        o, _ = blocks_sparse_attention(kq, kk, kv, idx, qpos, koff, True, block_size, precision=prec,
                                       o_dtype=half_or_fp32(q.dtype), epilogue=RLAEpilogue(o_lin, drop, *rla_norm))
        return o.to(out_dtype), None, sbar_new
    if form == "blocks":  # differentiable when gradients are needed; else the forward alone
        o_sp, otilde = blocks_sparse_attention(kq, kk, kv, idx, qpos, koff, use_rla, block_size, precision=prec,
                                               o_dtype=half_or_fp32(q.dtype))
    elif form == "tile":  # differentiable with plan.grad; without, the forward alone
        o_sp, otilde = tile_sparse_attention(kq, kk, kv, idx, qpos, koff, use_rla, block_size, pre, grad=plan.grad,
                                             rows=plan.tile_rows, precision=prec, union=union)
    elif plan.grad:
        o_sp, otilde = SparseAttention.apply(kq, kk, kv, idx, qpos, koff, use_rla, block_size, pre, prec)
    else:
        o_sp, otilde, _ = sparse_forward(kq, kk, kv, idx, qpos, koff, use_rla, block_size, plan.splits,
                                         phik=key_features(kk) if use_rla and pre else None, precision=prec)
    q_ok = None if causal else (q_pos >= 0)[:, :, None, None]
    if q_ok is not None:
        o_sp = o_sp * q_ok  # [B, Tq, HQ, D]
    if not use_rla:
        k_new, v_new = (x.transpose(1, 2) for x in (k_tok, v_tok))  # [B, H, Tq, D]
        phik = feature_map(k_new).to(acc)
        if not causal:
            phik = phik * (q_pos >= 0)[:, None, :, None]
        return o_sp.to(out_dtype), None, sbar + state_increment(phik, v_new, acc)
    o_lin, sbar_new, drop = linear_term()  # after the sparse kernels: their partials are freed by now
    return o_sp.to(out_dtype), residual_term(o_lin, otilde, drop, out_dtype), sbar_new  # o_rla [B, Tq, HQ, D]
