"""Block-major ("routed") Triton kernels of SPLA's sparse branch and residual correction, forward and
backward: the work is the selected (token, block) pairs only, whatever the query tiles' unions are.

Same contract and values as `triton_tile.tile_sparse_attention` and `triton_parallel.SparseAttention`
(q [B, HQ, T, D], k, v [B, H, S, D] views with unit stride in D; idx [B, T, H, NSEL] int32 selected
block ids, -1 = none; qpos [B, T] int32 positions, -1 = padded query; koff [B] int32 slot of each
row's position 0): o_sp [B, T, HQ, D] normalised and otilde [B, T, HQ, D] fp32 (None without the
residual term), differentiable w.r.t. q, k, v.

The selection is inverted on the device, as grouped GEMMs route tokens to experts (`block_pairs`):
every pair (token t, slot i) of KV head h whose block n = idx[b, t, h, i] holds a causal key of t is
keyed by (batch x KV head, window of `window` consecutive query slots, block n) and the pairs sorted
by key (a stable `torch.sort`, or a counting sort: per-key counts, exclusive cumsum, scatter), with
the start of each key's run. `segments` cuts each run into segments of at most `seg_pairs` pairs,
numbered through a fixed-size table whose length is bounded from shapes (ceil(P / seg_pairs) + number
of keys, P = B*T*H*NSEL): no host synchronisation, no data-dependent shape; programs past the real
segments find a count of 0 and exit.

One program per segment loads its block's K (and V, phi(k)) tile once and walks its pairs in chunks
of BMQ tokens, the G query heads of each token as rows (BMQ * G <= `rows`, unpadded, so tl.dot sees
about `rows` rows whatever G is). The forward has two forms (`BlocksPlan.forward`):
  "split" (the default; flash-decoding's split over the slots): one pass (`blocks_split_kernel`)
    computes S = q k^T * scale with the causal mask (only where the block is the token's current
    one) once, and stores each (token, head, slot)'s softmax over its block, O_i = softmax(S) V,
    with its log-sum-exp lse_i (and, with the residual term, its otilde_i = (phi(q) phi(k)^T,
    causal-masked) V), plain stores into [B, T, H, NSEL, G, D] partials; a combine
    (`blocks_combine_kernel`, one program per (token, KV head)) gives O = sum_i exp(lse_i - lse) O_i,
    lse = logsumexp_i lse_i, otilde = sum_i otilde_i. Its partials cost T x HQ x NSEL x D values
    (in 16-bit inputs' dtype, else fp32: `BlocksPlan.partials`), written once and read once; past
    SPLIT_BYTES of them (very long calls) a call without a backward runs the split form over query
    chunks that each stay within it, and a call with one takes the atomic form. The split form
    measured the faster of the two, with and without the residual term (docs/benchmarks.md);
  "atomic": pass 1 (`blocks_lse_kernel`) the log-sum-exp of each (token, head, slot) into
    [B, T, H, NSEL, G] and one torch.logsumexp over the slots; pass 2 (`blocks_out_kernel`) the
    scores again, P = exp(S - lse) (already normalised), O += P V and otilde += (phi(q) phi(k)^T) V
    added with fp32 atomics: no partials, the scores computed twice.
The backward (`triton_blocks_bwd`) walks the same segments: dq with atomics per chunk (or, with
`BlocksPlan.dq` "pairs", stored per pair and summed over the slots after), dk and dv accumulated per
segment.

The windows keep the atomics in L2: the table runs key by key, so the programs in flight work on one
window of one KV head, whose output rows (window x G x D fp32, O and otilde) stay resident while all
their slots are added (fp32 atomic adds of random rows measured faster inside such a window than
spread over 32k tokens, and plain stores faster still: docs/benchmarks.md). A smaller window
costs more partly filled chunks (one per key and window).

Forced blocks (the sinks, chosen by every token, and the banded local blocks) need no structure of
their own: a key's run is cut into segments of bounded size, so the sink block's thousands of pairs
are as many uniform programs as any other block's and the load stays balanced. (A banded kernel for
them could write its part of O with stores instead of atomics: 3 of 16 pairs a token, a small share
of pass 2; not done.)

The atomics make O, otilde and the gradients reproducible only up to the order of fp32 additions
(a deterministic order would need per-pair partial outputs written and summed: T x HQ x NSEL x D
floats, 8.6 GB at 32k, far more bytes than the atomics move).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..triton_launch import jit
from ..triton_utils import cdiv, half_or_fp32, next_power_of_2
from ..utils import import_triton, new_output
from .triton_blocks_common import (
    ATOMIC_MODES,
    BlockPairs,
    BlocksPlan,
    RLAEpilogue,
    add_rows,
    blocks_plan,
    chunk_rows,
    dot,
    kernel_operands,
    key_tile,
    program_segment,
    query_rows,
    row_max,
    segment_kv,
    segments,
)
from .triton_common import NEG, softmax_rows

triton, tl = import_triton()

__all__ = ["BlockPairs", "BlocksPlan", "BlocksSparseAttention", "RLAEpilogue", "block_pairs", "blocks_plan",
           "blocks_sparse_attention", "blocks_sparse_forward", "lse_pass", "out_pass", "segments", "split_pass"]


#: The most bytes of per-slot partials (O_i and otilde_i) the split forward allocates; a call that
#: needs more takes the atomic form (at d64 with 19 slots, bf16, no residual term: 32k tokens x 32
#: heads need 2.5 GB, 128k 10 GB).
SPLIT_BYTES = 4 << 30



@jit
def pair_keys_kernel(
    IDX, QPOS, KEYS, COUNTS, P, T, H, NSEL, NW, NB, NK, window, BS,
    COUNT: tl.constexpr, BLOCK: tl.constexpr,
):
    """Key of each pair e of IDX [B, T, H, NSEL] into KEYS [P] int32 (NK where the pair holds no
    causal key of its token: idx -1, a padded query, a block after the token); with COUNT, the
    histogram of the keys into COUNTS [NK + 1] too."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = e < P
    blk = tl.load(IDX + e, mask=ok, other=-1)
    bt = e // (H * NSEL)  # b * T + t
    h = (e // NSEL) % H
    t = bt % T
    b = bt // T
    tpos = tl.load(QPOS + bt, mask=ok, other=-1)
    valid = ok & (blk >= 0) & (tpos >= 0) & (blk * BS <= tpos) & (blk < NB)
    key = ((b * H + h) * NW + t // window) * NB + blk
    key = tl.where(valid, key, NK)
    tl.store(KEYS + e, key, mask=ok)
    if COUNT:
        tl.atomic_add(COUNTS + key, tl.full([BLOCK], 1, tl.int32), mask=ok, sem="relaxed")


@jit
def pair_scatter_kernel(KEYS, CURSOR, PAIRS, P, NK, BLOCK: tl.constexpr):
    """Counting sort's scatter: each valid pair e to PAIRS[CURSOR[key]++] (CURSOR [NK] starts as the
    exclusive cumsum of the counts; the order within a key is the atomics' order)."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = e < P
    key = tl.load(KEYS + e, mask=ok, other=NK)
    valid = ok & (key < NK)
    dst = tl.atomic_add(CURSOR + tl.where(valid, key, 0), tl.full([BLOCK], 1, tl.int32), mask=valid, sem="relaxed")
    tl.store(PAIRS + dst, e, mask=valid)


def block_pairs(idx: torch.Tensor, qpos: torch.Tensor, num_blocks: int, block_size: int, window: int,
                sort: str = "sort") -> BlockPairs:
    """Invert the selection idx [B, T, H, NSEL] int32 (qpos [B, T] int32) into pairs grouped by
    (batch x KV head, window of query slots, block) (`BlockPairs`), on the device and without a host
    synchronisation: one key launch, then a stable torch.sort and a searchsorted of the key starts
    (sort="sort"), or the histogram of that launch, an exclusive cumsum and an atomic scatter
    (sort="count", the order within a key unspecified)."""
    B, T, H, K = idx.shape
    P = B * T * H * K
    NW = cdiv(T, window)
    NB = max(1, num_blocks)
    NK = B * H * NW * NB
    if P >= 2**31 or NK >= 2**31 - 1:
        raise ValueError(f"{P} (token, slot) pairs or {NK} keys exceed int32; split the batch")
    dev = idx.device
    idx = idx.contiguous()
    keys = torch.empty(P, device=dev, dtype=torch.int32)
    counts = torch.zeros(NK + 1, device=dev, dtype=torch.int32) if sort == "count" else keys
    BLOCK = 1024
    grid = (cdiv(P, BLOCK),)
    pair_keys_kernel[grid](idx, qpos, keys, counts, P, T, H, K, NW, NB, NK, window, block_size,
                           COUNT=sort == "count", BLOCK=BLOCK)
    if sort == "sort":
        skeys, order = torch.sort(keys, stable=True)
        starts = torch.searchsorted(skeys, torch.arange(NK + 1, device=dev, dtype=torch.int32)).to(torch.int32)
        pairs = order.to(torch.int32)
    elif sort == "count":
        starts = torch.zeros(NK + 1, device=dev, dtype=torch.int32)
        torch.cumsum(counts[:NK], 0, out=starts[1:])
        cursor = starts[:NK].clone()
        pairs = torch.empty(P, device=dev, dtype=torch.int32)
        pair_scatter_kernel[grid](keys, cursor, pairs, P, NK, BLOCK=BLOCK)
    else:
        raise ValueError(f"sort must be 'sort' or 'count', got {sort!r}")
    return BlockPairs(pairs, starts, window, NW, NB)




@jit
def _block_softmax(q, kt, mask, scale, F32: tl.constexpr, PREC: tl.constexpr):
    """The rows' softmax over one block's keys (mask: the causal selected ones): (P unnormalised
    [R, BS], the rows' max score, their sum of P, at least 1e-30)."""
    sc = tl.where(mask, dot(q, kt, F32, PREC) * scale, NEG)
    mx = tl.max(sc, 1)
    p = tl.where(mask, tl.exp(sc - mx[:, None]), 0.0)
    return p, mx, tl.maximum(tl.sum(p, 1), 1e-30)


@jit
def _residual_rows(q, phikt, v, mask, F32: tl.constexpr, PREC: tl.constexpr):
    """The rows' correction over one block, (phi(q) phi(k)^T masked) V: [R, D] fp32."""
    a = tl.where(mask, dot(softmax_rows(q), phikt, F32, PREC), 0.0)
    return dot(a, v, F32, PREC)


@jit
def blocks_lse_kernel(
    Q, K, PAIRS, SEG_KEY, SEG_FIRST, SEG_COUNT, QPOS, KOFF, ROWMAX, LSE_SLOT,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks,
    T, H, NW, NB, NSEL, S, scale,
    G: tl.constexpr, R: tl.constexpr, BMQ: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    F32: tl.constexpr, PREC: tl.constexpr,
):
    """Pass 1, one segment: the log-sum-exp of the scores of each (token, head, slot) over the
    segment's block (causal keys only) into LSE_SLOT [B, T, H, NSEL, G] at e * G + g."""
    b, h, first, count, koff, pos, kload = program_segment(SEG_KEY, SEG_FIRST, SEG_COUNT, KOFF, ROWMAX, NW, NB, H, S,
                                                           BS, BS)
    b64 = b.to(tl.int64)
    slot = koff + pos
    k = key_tile(K, b64, h, slot, kload, stride_kb, stride_kh, stride_ks, D)
    kt = tl.trans(k)
    for c0 in range(0, count, BMQ):
        e, t, tpos, g, ok = chunk_rows(PAIRS, QPOS, first, c0, count, T, H, NSEL, b, G, R, BMQ)
        q, _ = query_rows(Q, b64, h, t, g, ok, stride_qb, stride_qh, stride_qt, T, H, G, D)
        mask = ok[:, None] & (pos[None, :] <= tpos[:, None])
        _, mx, lsum = _block_softmax(q, kt, mask, scale, F32, PREC)
        tl.store(LSE_SLOT + e * G + g, mx + tl.log(lsum), mask=ok)


@jit
def blocks_out_kernel(
    Q, K, V, PAIRS, SEG_KEY, SEG_FIRST, SEG_COUNT, QPOS, KOFF, ROWMAX, LSE, OUT, OT,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    T, H, NW, NB, NSEL, S, scale,
    G: tl.constexpr, R: tl.constexpr, BMQ: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    USE_RLA: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, ATOMICS: tl.constexpr,
):
    """Pass 2, one segment: P = exp(S - lse) of each row (LSE [B, T, HQ], over all its slots), then
    OUT += P V and, with USE_RLA, OT += (phi(q) phi(k)^T masked) V (OUT, OT: [B, T, HQ, D] fp32, zeroed
    by the caller, fp32 atomics)."""
    b, h, first, count, pos, kload, b64, slot, k, v = segment_kv(
        SEG_KEY, SEG_FIRST, SEG_COUNT, KOFF, ROWMAX, K, V, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
        stride_vs, NW, NB, H, S, BS, BS, D)
    kt = tl.trans(k)
    if USE_RLA:
        phikt = tl.trans(softmax_rows(k).to(k.dtype))
    for c0 in range(0, count, BMQ):
        _, t, tpos, g, ok = chunk_rows(PAIRS, QPOS, first, c0, count, T, H, NSEL, b, G, R, BMQ)
        q, row = query_rows(Q, b64, h, t, g, ok, stride_qb, stride_qh, stride_qt, T, H, G, D)
        lse = tl.load(LSE + row, mask=ok, other=0.0)
        mask = ok[:, None] & (pos[None, :] <= tpos[:, None])
        p = tl.where(mask, tl.exp(dot(q, kt, F32, PREC) * scale - lse[:, None]), 0.0)
        add_rows(OUT, row, dot(p, v, F32, PREC), ok, D, ATOMICS)
        if USE_RLA:
            add_rows(OT, row, _residual_rows(q, phikt, v, mask, F32, PREC), ok, D, ATOMICS)


@jit
def blocks_split_kernel(
    Q, K, V, PAIRS, SEG_KEY, SEG_FIRST, SEG_COUNT, QPOS, KOFF, ROWMAX, LSE_SLOT, PART, PART_T, OT,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    T, H, NW, NB, NSEL, S, scale,
    G: tl.constexpr, R: tl.constexpr, BMQ: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    USE_RLA: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, RLA_ATOMIC: tl.constexpr,
    ATOMICS: tl.constexpr,
):
    """The split forward's one pass, one segment: for each (token, head, slot) row e * G + g its
    block's softmax output O_i = softmax(S) V into PART, its log-sum-exp into LSE_SLOT and, with
    USE_RLA, otilde_i = (phi(q) phi(k)^T masked) V into PART_T (PART, PART_T: [B, T, H, NSEL, G, D];
    rows of pairs without a causal key are left as they are), or with RLA_ATOMIC added to its
    (token, head) row of OT [B, T, HQ, D] fp32 (zeroed by the caller) with fp32 atomics: otilde is a
    plain sum over the slots, so it needs no partials."""
    b, h, first, count, pos, kload, b64, slot, k, v = segment_kv(
        SEG_KEY, SEG_FIRST, SEG_COUNT, KOFF, ROWMAX, K, V, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
        stride_vs, NW, NB, H, S, BS, BS, D)
    kt = tl.trans(k)
    if USE_RLA:
        phikt = tl.trans(softmax_rows(k).to(k.dtype))
    d = tl.arange(0, D)
    for c0 in range(0, count, BMQ):
        e, t, tpos, g, ok = chunk_rows(PAIRS, QPOS, first, c0, count, T, H, NSEL, b, G, R, BMQ)
        q, row = query_rows(Q, b64, h, t, g, ok, stride_qb, stride_qh, stride_qt, T, H, G, D)
        mask = ok[:, None] & (pos[None, :] <= tpos[:, None])
        p, mx, lsum = _block_softmax(q, kt, mask, scale, F32, PREC)
        prow = e.to(tl.int64) * G + g
        tl.store(LSE_SLOT + prow, mx + tl.log(lsum), mask=ok)
        o = dot(p, v, F32, PREC) / lsum[:, None]
        tl.store(PART + prow[:, None] * D + d[None, :], o.to(PART.dtype.element_ty), mask=ok[:, None])
        if USE_RLA:
            ot = _residual_rows(q, phikt, v, mask, F32, PREC)
            if RLA_ATOMIC:
                add_rows(OT, row, ot, ok, D, ATOMICS)
            else:
                tl.store(PART_T + prow[:, None] * D + d[None, :], ot.to(PART_T.dtype.element_ty), mask=ok[:, None])


@jit
def blocks_combine_kernel(LSE_SLOT, PART, PART_T, OUT, OT, LSE, NSEL, O_LIN, DROP, W, eps, H,
                          G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, USE_RLA: tl.constexpr,
                          EPILOGUE: tl.constexpr = False):
    """The split forward's combine, one (token, KV head) (b * T + t) * H + h: its G rows over the NSEL
    slots, O = sum_i exp(lse_i - lse) O_i, lse = logsumexp_i lse_i (0 and O = 0 where no slot holds a
    causal key: lse_i = -inf), otilde = sum_i otilde_i; partials of such slots are never read.
    EPILOGUE (`RLAEpilogue`): OUT = O + RMSNorm_W(o_rla) with o_rla = O_LIN - otilde (0 where DROP
    [B, T, H] is set), in fp32 and rounded once; OT is not written."""
    pid = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GP)
    gok = g < G
    d = tl.arange(0, D)
    m = tl.full([GP], float("-inf"), tl.float32)
    for i in range(NSEL):
        m = tl.maximum(m, tl.load(LSE_SLOT + (pid * NSEL + i) * G + g, mask=gok, other=float("-inf")))
    has = m > float("-inf")
    m = tl.where(has, m, 0.0)
    acc = tl.zeros([GP, D], tl.float32)
    acc_t = tl.zeros([GP, D], tl.float32)
    lsum = tl.zeros([GP], tl.float32)
    for i in range(NSEL):
        row = (pid * NSEL + i) * G + g
        ls = tl.load(LSE_SLOT + row, mask=gok, other=float("-inf"))
        valid = ls > float("-inf")
        w = tl.where(valid, tl.exp(ls - m), 0.0)
        x = tl.load(PART + row[:, None] * D + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        acc += w[:, None] * x
        lsum += w
        if USE_RLA:
            acc_t += tl.load(PART_T + row[:, None] * D + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    out = pid * G + g  # (b * T + t) * HQ + h * G + g
    o = acc / tl.maximum(lsum, 1e-30)[:, None]
    if EPILOGUE:
        x = tl.load(O_LIN + out[:, None] * D + d[None, :], mask=gok[:, None], other=0.0) - acc_t
        x = tl.where(tl.load(DROP + pid) != 0, 0.0, x)
        w = tl.load(W + ((pid % H) * G + g)[:, None] * D + d[None, :], mask=gok[:, None], other=0.0).to(tl.float32)
        o += x * (1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps))[:, None] * w
    tl.store(OUT + out[:, None] * D + d[None, :], o, mask=gok[:, None])
    tl.store(LSE + out, tl.where(has, m + tl.log(tl.maximum(lsum, 1e-30)), 0.0), mask=gok)
    if USE_RLA and not EPILOGUE:
        tl.store(OT + out[:, None] * D + d[None, :], acc_t, mask=gok[:, None])



def _check(q, k, v, idx, qpos, koff, block_size):
    B, HQ, T, D = q.shape
    H = k.shape[1]
    if HQ % H or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"q {tuple(q.shape)} and k, v {tuple(k.shape)}, {tuple(v.shape)} do not match "
                         "([B, HQ, T, D] and [B, H, S, D] with HQ a multiple of H)")
    if tuple(idx.shape[:3]) != (B, T, H) or idx.dtype != torch.int32:
        raise ValueError(f"idx must be int32 [B, T, H, NSEL] = [{B}, {T}, {H}, NSEL], got {idx.dtype} "
                         f"{tuple(idx.shape)}")
    if tuple(qpos.shape) != (B, T) or qpos.dtype != torch.int32 or tuple(koff.shape) != (B,) \
            or koff.dtype != torch.int32:
        raise ValueError("qpos must be int32 [B, T] and koff int32 [B]")
    if D & (D - 1) or D < 16 or block_size & (block_size - 1) or block_size < 16:
        raise ValueError(f"head_dim {D} and block_size {block_size} must be powers of two >= 16")


def _launch(q, k, pairs: BlockPairs, nsel: int, block_size: int, plan: BlocksPlan, f32: bool):
    """The segment table and the launch arguments of the forward passes: (grid, segment operands,
    scalars, the log-sum-exp pass's constexprs, those of the output pass and of the split pass)."""
    B, HQ, T, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = HQ // H
    seg_pairs = plan.seg_pairs(G)
    seg_key, seg_first, seg_count = segments(pairs, seg_pairs)
    common = (T, H, pairs.num_windows, pairs.num_blocks, nsel, S, 1.0 / math.sqrt(D))
    meta = dict(G=G, D=D, BS=block_size, F32=f32, PREC=plan.precision)
    lse_rows = max(plan.lse_rows, next_power_of_2(G))
    meta1 = dict(meta, R=lse_rows, BMQ=max(1, lse_rows // G), num_warps=plan.lse_warps, num_stages=plan.stages)
    meta2 = dict(meta, R=plan.rows, BMQ=plan.tokens(G), num_warps=plan.warps, num_stages=plan.stages)
    return (seg_key.numel(), 1), (pairs.pairs, seg_key, seg_first, seg_count), common, meta1, meta2



def lse_pass(q, k, pairs: BlockPairs, qpos, koff, nsel: int, block_size: int, plan: BlocksPlan, f32: bool,
             launch=None):
    """Pass 1: the log-sum-exp [B, T, HQ] fp32 of each row over its selected causal keys (0 for a
    row without any). q, k: kernel operands (`kernel_operands`); `launch`: `_launch`'s result, if made."""
    B, HQ, T, D = q.shape
    H = k.shape[1]
    grid, seg, common, meta, _ = launch or _launch(q, k, pairs, nsel, block_size, plan, f32)
    lse_slot = torch.full((B, T, H, nsel, HQ // H), float("-inf"), device=q.device, dtype=torch.float32)
    blocks_lse_kernel[grid](
        q, k, *seg, qpos, koff, row_max(qpos), lse_slot,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), *common, **meta,
    )
    lse = torch.logsumexp(lse_slot, dim=3)  # [B, T, H, G]
    return torch.where(torch.isfinite(lse), lse, 0.0).reshape(B, T, HQ).contiguous()


def out_pass(q, k, v, pairs: BlockPairs, qpos, koff, lse, nsel: int, use_rla: bool, block_size: int,
             plan: BlocksPlan, f32: bool, launch=None):
    """Pass 2: (o_sp, otilde or None) [B, T, HQ, D] fp32 given the rows' log-sum-exp lse [B, T, HQ]."""
    B, HQ, T, D = q.shape
    grid, seg, common, _, meta = launch or _launch(q, k, pairs, nsel, block_size, plan, f32)
    o = torch.zeros(B, T, HQ, D, device=q.device, dtype=torch.float32)
    ot = torch.zeros_like(o) if use_rla else o
    blocks_out_kernel[grid](
        q, k, v, *seg, qpos, koff, row_max(qpos), lse, o, ot,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *common, USE_RLA=use_rla, ATOMICS=ATOMIC_MODES[plan.atomics], **meta,
    )
    return o, (ot if use_rla else None)


def partial_dtype(q: torch.Tensor, plan: BlocksPlan) -> torch.dtype:
    """The split forward's partial dtype for the inputs q (`BlocksPlan.partials`)."""
    if plan.partials == "input":
        return half_or_fp32(q.dtype)
    return torch.bfloat16 if plan.partials == "bf16" else torch.float32


def split_bytes(q, nsel: int, use_rla: bool, plan: BlocksPlan) -> int:
    """Bytes of the split forward's partials for q [B, HQ, T, D] with nsel slots."""
    B, HQ, T, D = q.shape
    per = partial_dtype(q, plan).itemsize
    return B * T * HQ * nsel * D * per * (2 if use_rla and plan.rla_sum == "partials" else 1)


def query_chunk(q, nsel: int, use_rla: bool, plan: BlocksPlan) -> int:
    """Query rows per call of the split forward whose partials stay within SPLIT_BYTES (all T rows
    where they already do; at least 1)."""
    T = q.shape[2]
    need = split_bytes(q, nsel, use_rla, plan)
    return T if need <= SPLIT_BYTES else max(1, T * SPLIT_BYTES // need)


def split_pass(q, k, v, pairs: BlockPairs, qpos, koff, nsel: int, use_rla: bool, block_size: int,
               plan: BlocksPlan, f32: bool, launch=None, o_dtype: torch.dtype = torch.float32,
               epilogue: RLAEpilogue | None = None):
    """The split forward (module docstring): (o_sp, otilde or None, lse) [B, T, HQ, D] / [B, T, HQ]
    from one pass storing per-slot partials (`plan.partials`' dtype) and their combine; o_sp in
    `o_dtype` (the combine rounds it once), otilde and lse fp32. With `epilogue` (and use_rla, the
    correction as partials): (o_sp + RMSNorm(o_rla) from the combine, None, lse)."""
    B, HQ, T, D = q.shape
    H = k.shape[1]
    G = HQ // H
    grid, seg, common, _, meta = launch or _launch(q, k, pairs, nsel, block_size, plan, f32)
    dev = q.device
    pdtype = partial_dtype(q, plan)
    lse_slot = torch.full((B, T, H, nsel, G), float("-inf"), device=dev, dtype=torch.float32)
    part = new_output((B, T, H, nsel, G, D), dev, pdtype)
    atomic = use_rla and plan.rla_sum == "atomic"  # otilde added to its rows, no partials
    part_t = new_output((B, T, H, nsel, G, D), dev, pdtype) if use_rla and not atomic else part
    epi = epilogue is not None and use_rla and not atomic  # the combine writes o + RMSNorm(o_rla), no otilde
    o = new_output((B, T, HQ, D), dev, o_dtype)
    ot = (torch.zeros((B, T, HQ, D), device=dev, dtype=torch.float32) if atomic
          else new_output((B, T, HQ, D), dev) if use_rla and not epi else o)
    blocks_split_kernel[grid](
        q, k, v, *seg, qpos, koff, row_max(qpos), lse_slot, part, part_t, ot,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *common, USE_RLA=use_rla, RLA_ATOMIC=atomic,
        ATOMICS=ATOMIC_MODES[plan.atomics], **meta,
    )
    lse = new_output((B, T, HQ), dev)
    if B * T * H:
        o_lin, drop, w, eps = (epilogue.o_lin.contiguous(), epilogue.drop.contiguous().view(torch.uint8),
                               epilogue.weight.contiguous(), float(epilogue.eps)) if epi else (o, o, o, 0.0)
        blocks_combine_kernel[(B * T * H,)](lse_slot, part, part_t, o, ot, lse, nsel, o_lin, drop, w, eps, H, G=G,
                                            GP=next_power_of_2(G), D=D, USE_RLA=use_rla and not atomic,
                                            EPILOGUE=epi, num_warps=4 if G * D >= 1024 else 2)
    if epilogue is not None and not epi:
        return epilogue.apply(o, ot), None, lse
    return o, (None if epi or not use_rla else ot), lse


def blocks_sparse_forward(q, k, v, idx, qpos, koff, use_rla: bool, block_size: int, plan: BlocksPlan | None = None,
                          pairs: BlockPairs | None = None, chunk_queries: bool = False,
                          o_dtype: torch.dtype = torch.float32, epilogue: RLAEpilogue | None = None):
    """The sparse branch and the correction over the selected pairs (module docstring), same operands
    as `triton_parallel.sparse_forward`. Returns (o_sp [B, T, HQ, D] normalised, otilde or None
    [B, T, HQ, D], lse [B, T, HQ]; fp32, o_sp in `o_dtype`) and the inverted selection (`BlockPairs`, for the backward).
    Rows without a causal selected key (padded queries) get o_sp = otilde = 0 and lse = 0.
    `chunk_queries` (a call without a backward, which needs no inverted selection: then None): where
    the split form's partials would pass SPLIT_BYTES, the split form runs over consecutive query
    chunks that each stay within it (`query_chunk`), instead of the atomic form over all of them.
    `epilogue` (`RLAEpilogue`, with use_rla): the first output is o_sp + RMSNorm(o_rla) and the
    second None (the split form's combine computes it; the atomic form in PyTorch after)."""
    _check(q, k, v, idx, qpos, koff, block_size)
    q, k, v, f32 = kernel_operands(q, k, v)
    B, HQ, T, D = q.shape
    S = k.shape[2]
    if plan is None:
        plan = blocks_plan(HQ // k.shape[1], D, q.device, use_rla, dtype=q.dtype)
    nsel = idx.shape[-1]
    step = query_chunk(q, nsel, use_rla, plan) if chunk_queries and plan.forward == "split" else T
    if step < T:
        outs = [blocks_sparse_forward(q[:, :, t:t + step], k, v, idx[:, t:t + step],
                                      qpos[:, t:t + step].contiguous(), koff, use_rla, block_size, plan,
                                      o_dtype=o_dtype, epilogue=epilogue and epilogue.rows(t, t + step))[:3]
                for t in range(0, T, step)]
        o, ot, lse = (None if parts[0] is None else torch.cat(parts, 1) for parts in zip(*outs, strict=True))
        return o, ot, lse, None
    if pairs is None:
        pairs = block_pairs(idx, qpos, cdiv(S, block_size), block_size, plan.window, plan.sort)
    launch = _launch(q, k, pairs, nsel, block_size, plan, f32)
    if plan.forward == "split" and split_bytes(q, nsel, use_rla, plan) <= SPLIT_BYTES:
        o, ot, lse = split_pass(q, k, v, pairs, qpos, koff, nsel, use_rla, block_size, plan, f32, launch, o_dtype,
                                epilogue)
        return o, ot, lse, pairs
    lse = lse_pass(q, k, pairs, qpos, koff, nsel, block_size, plan, f32, launch)
    o, ot = out_pass(q, k, v, pairs, qpos, koff, lse, nsel, use_rla, block_size, plan, f32, launch)
    if epilogue is not None:
        return epilogue.apply(o, ot).to(o_dtype), None, lse, pairs
    return o.to(o_dtype), ot, lse, pairs


class BlocksSparseAttention(torch.autograd.Function):
    """The sparse branch and the correction otilde over the selected pairs, forward and backward
    (`triton_blocks_bwd`). The selection (idx) carries no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, idx, qpos, koff, use_rla, block_size, plan, o_dtype):
        o, ot, lse, pairs = blocks_sparse_forward(q, k, v, idx, qpos, koff, use_rla, block_size, plan, o_dtype=o_dtype)
        ctx.save_for_backward(q, k, v, qpos, koff, o, lse, pairs.pairs, pairs.starts)
        ctx.use_rla, ctx.block_size, ctx.plan = use_rla, block_size, plan
        ctx.pair_meta = (pairs.window, pairs.num_windows, pairs.num_blocks, idx.shape[-1])
        return o, ot

    @staticmethod
    def backward(ctx, do, dot_):
        from .triton_blocks_bwd import blocks_sparse_backward

        q, k, v, qpos, koff, o, lse, pair_list, starts = ctx.saved_tensors
        window, nw, nb, nsel = ctx.pair_meta
        pairs = BlockPairs(pair_list, starts, window, nw, nb)
        dq, dk, dv = blocks_sparse_backward(q, k, v, qpos, koff, o, lse, pairs, nsel, do, dot_, ctx.use_rla,
                                            ctx.block_size, ctx.plan)
        return dq, dk, dv, None, None, None, None, None, None, None


def blocks_sparse_attention(q, k, v, idx, qpos, koff, use_rla: bool, block_size: int, *,
                            precision: str | None = None, plan: BlocksPlan | None = None,
                            o_dtype: torch.dtype = torch.float32, epilogue: RLAEpilogue | None = None):
    """The block-major form of `triton_tile.tile_sparse_attention` (same operands: q [B, HQ, T, D],
    k, v [B, H, S, D] views with unit stride in D, idx [B, T, H, NSEL] int32, qpos [B, T] int32, koff
    [B] int32): (o_sp, otilde or None) [B, T, HQ, D] (otilde fp32, o_sp in `o_dtype`: the caller's dtype
    saves a cast each way), differentiable w.r.t. q, k, v through
    `BlocksSparseAttention` when gradients are needed, else the forward alone. `precision` of fp32
    inputs' dots: "tf32" (default on CUDA) or "ieee" (default elsewhere); fp64 inputs run in fp32
    with "ieee" dots. `plan`: launch settings (default `blocks_plan` of the shapes). `epilogue`
    (`RLAEpilogue`; use_rla, no gradients): returns (o_sp + RMSNorm(o_rla), None) in `o_dtype`, the
    residual term's subtraction and norm-add done by the combine."""
    B, HQ, T, D = q.shape
    G = HQ // k.shape[1]
    if q.dtype == torch.float64:
        precision = "ieee"
    if plan is None:
        plan = blocks_plan(G, D, q.device, use_rla, precision=precision, dtype=q.dtype)
    elif precision is not None:
        plan = replace(plan, precision=precision)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if epilogue is not None and (grad or not use_rla or epilogue.weight.requires_grad and torch.is_grad_enabled()):
        raise ValueError("the block-major kernels' epilogue (o_sp + RMSNorm(o_rla)) serves calls with the residual "
                         "term and without gradients only; add the norm after the call instead")
    if grad:
        return BlocksSparseAttention.apply(q, k, v, idx, qpos, koff, use_rla, block_size, plan, o_dtype)
    o, ot, _, _ = blocks_sparse_forward(q, k, v, idx, qpos, koff, use_rla, block_size, plan, chunk_queries=True,
                                        o_dtype=o_dtype, epilogue=epilogue)
    return o, ot
