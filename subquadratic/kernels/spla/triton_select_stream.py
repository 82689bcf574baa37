"""SPLA block selection for prefill, streamed per query tile (`select_indices_stream`): the block
scores on the tensor cores in 16-bit operands with fp32 accumulation, the per-head softmax
normaliser and the group top-k kept in registers while the blocks stream by, so no [tokens, blocks]
tensor ever reaches memory. Same contract and output layout as `triton_tile.select_indices_fast`.

One program per (query tile, batch x KV head), the tiles with the most blocks launched first. Its
rows are (token, query head of the group): BM tokens x GP heads (the group padded to a power of two;
128 rows by default, as a flash tile). The blocks stream in chunks of BN (64):

  pass 1 (groups of 2 or more heads): per row the online softmax statistics (running max and sum)
    of the scores over the row's candidate blocks;
  pass 2, from the most recent blocks back: the scores again, each head's softmax probability, the
    group sum per (token, block), and a running top-KP per token (KP: the free budget padded to a
    power of two). A chunk joins it only where some token of the tile has a key above its current
    KP-th: by default one arg-max per new entry, as many rounds as the most new entries of a token
    ("insert"; the count falls as the list fills, ~K ln(NB / K) per token over a sweep of random
    scores); or the chunk's best KP by `tl.topk` and one bitonic merge ("bitonic", a fixed cost).

A group of one head needs no normaliser (its softmax ranks as its scores): one pass. The Taylor
score enters as a product, exp(qs.mu) (1 + qs^2.s2 / 2), so the two-pass form takes no logarithm.
Keys: the order-preserving int32 image of the fp32 group score with its low IB bits (IB = bits of
NB) replaced by the block id, so keys are distinct per token and sort by score, then by lower block
id; scores closer than 2^(IB - 23) relative (2.4e-4 at 2048 blocks) may rank by block id instead.

Work at B1 HQ32 H8 d128, 64-token blocks, T = 32k (NB = 512; x16 at 128k), counted from shapes:
  candidate (token, head, block) triples: HQ T^2 / (2 bs) = 2.7e8 (4.3e9 at 128k)
  score flops: two d-long dots per triple and pass, two passes: 8d = 1024 per triple = 2.7e11
    (4.4e12), 1/32 of flash's causal forward (HQ T^2 / 2 x 4d = 8.8e12); tile padding and the
    partly masked last chunk of each tile add about BN / 2 blocks per row (12% at 32k)
  exp2: one per triple and pass, 5.4e8 (8.6e9), 1/32 of flash's; log: none (one log2 per triple
    instead of the two exp2 for a group of one head)
  top-k, per (token, KV head, block) of the sweep (6.7e7; 1.1e9): "insert" takes one round per new
    entry of the tile's busiest token, each ~6 int32 ops per key of the chunk plus two row
    reductions; a token takes about K (1 + ln(NB / K)) new entries over its sweep of random scores
    (71 at 512 blocks, 94 at 2048), so ~12 rounds per chunk of 64 at 32k and ~6 at 128k: ~70 (~36)
    ops per key, 4.8e9 (3.9e10); "bitonic": ~16 compare-exchanges (~80 ops) per key at any
    length, 5.4e9 (8.6e10); the iterative top-k of `select_indices_fast`: 16 arg-max sweeps over
    all NB blocks of every token, ~2 x 16 x 5 = 160 ops per causal key
  bytes: HBM reads q once (T HQ d 2 = 268 MB; 1.07 GB), writes the indices (20 MB) and reads the
    block statistics (2 MB in bf16); from L2 each tile reads its causal statistics twice
    (2 x 2 NB/2 d 2 bytes per tile: 2.1 GB at 32k with 32-token tiles), one 2d-vector per 128 rows
    x 4d flops, flash's intensity
  floors: each count over the device's rate (dense bf16 tensor-core flops, exp2/s, int32 op/s,
    bytes/s); the target is 10% of flash's causal forward on the same heads, and the measured times
    are in docs/benchmarks.md (scripts/benchmarks/kernels/bench_spla_select.py).
"""

from __future__ import annotations

import math
import os

import torch

from ..triton_launch import jit
from ..triton_utils import cdiv, next_power_of_2
from ..utils import import_triton, new_output
from .plan import SPLAParams
from .stats import BlockStats
from .triton_common import NEG

triton, tl = import_triton()

#: Operand precisions of the score dots: (statistics dtype, tl.dot input precision).
PRECISIONS = {"bf16": (torch.bfloat16, "tf32"), "fp16": (torch.float16, "tf32"),
              "tf32x3": (torch.float32, "tf32x3"), "ieee": (torch.float32, "ieee")}
FP16_MAX = 65504.0
EMPTY = tl.constexpr(-(2**31))  # the key of "no block": below every real key


@jit
def _order_key(x):
    """int32 keys whose signed order is the order of the fp32 values x (finite)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@jit
def _to_operand(x, dtype: tl.constexpr, EMU_BF16: tl.constexpr):
    """fp32 x as a score operand of `dtype`; with EMU_BF16 (the CPU interpreter, whose bf16 casts
    truncate and whose bf16 dots are wrong) rounded to bf16 to nearest even but kept in fp32."""
    if EMU_BF16:
        bits = x.to(tl.int32, bitcast=True)
        return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(dtype)


@jit
def _block_scores(q, q2, mu_base, s2_base, n, NB, scale, D: tl.constexpr, TAYLOR: tl.constexpr,
                  PREC: tl.constexpr, EMU_BF16: tl.constexpr):
    """Scores of the rows q [ROWS, D] against blocks n [BN]: (s, f) [ROWS, BN] fp32 with
    s = qs.mu_b in log2 units (scale = log2(e) / sqrt(D)) and f = 1 + 0.5 qs^2.s2_b (q2 = q^2 and
    the statistics S2 = s2 / (2 D) prepared so), or 1 for the mean selection; the softmax weight of
    a block is exp2(s) f."""
    d = tl.arange(0, D)
    nok = (n >= 0) & (n < NB)
    mu = tl.load(mu_base + n[:, None] * D + d[None, :], mask=nok[:, None], other=0.0)  # [BN, D]
    if EMU_BF16:
        mu = mu.to(tl.float32)
    s = tl.dot(q, tl.trans(mu), input_precision=PREC) * scale
    if TAYLOR:
        s2 = tl.load(s2_base + n[:, None] * D + d[None, :], mask=nok[:, None], other=0.0)
        if EMU_BF16:
            s2 = s2.to(tl.float32)
        f = 1.0 + tl.dot(q2, tl.trans(s2), input_precision=PREC)
    else:
        f = tl.full(s.shape, 1.0, tl.float32)
    return s, f


@jit
def stream_select_kernel(
    Q, MU, S2, QPOS, IDX,
    stride_qb, stride_qt, stride_qh,
    B, T, H, NB, block_size, n_sink, n_local, top_k, NSEL, scale,
    G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
    KP: tl.constexpr, NFP: tl.constexpr, IB: tl.constexpr, TAYLOR: tl.constexpr, FREE: tl.constexpr,
    PREC: tl.constexpr, CLAMP16: tl.constexpr, EMU_BF16: tl.constexpr, BITONIC: tl.constexpr,
):
    """Selection of one query tile (BM tokens x the GP padded heads of KV head h) into IDX
    [B, T, H, NSEL] (contiguous, -1 = none): the local blocks (current first), the sinks, then up
    to `top_k - forced` candidates by descending group score. Q [B, T, HQ, D] (unit stride in D),
    MU, S2 [B*H, NB, D] (the block means and s2 / (2 D), in the operand dtype), QPOS [B, T] int32."""
    pid = tl.program_id(0)
    BH = B * H
    tile = tl.num_programs(0) // BH - 1 - pid // BH  # the tiles with the most blocks start first
    bh = pid % BH
    b = bh // H
    h = bh % H
    ROWS: tl.constexpr = BM * GP
    IMASK: tl.constexpr = (1 << IB) - 1
    r = tl.arange(0, ROWS)
    t = tile * BM + r // GP
    g = r % GP
    row_ok = (t < T) & (g < G)
    d = tl.arange(0, D)
    mt = tl.arange(0, BM)
    tt = tile * BM + mt
    tok = tt < T
    tpm = tl.load(QPOS + b * T + tt, mask=tok, other=-1)
    curm = tl.where(tpm >= 0, tpm // block_size, -1)  # [BM] each token's current block
    if FREE:
        q_base = Q + b.to(tl.int64) * stride_qb
        qf = tl.load(q_base + t[:, None] * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
                     mask=row_ok[:, None], other=0.0).to(tl.float32)
        qq = qf * qf
        if CLAMP16:
            qq = tl.minimum(qq, 65504.0)
        q = _to_operand(qf, MU.dtype.element_ty, EMU_BF16)
        q2 = _to_operand(qq, MU.dtype.element_ty, EMU_BF16)
        tpos = tl.load(QPOS + b * T + t, mask=row_ok, other=-1)
        hi = tl.where(tpos >= 0, tpos // block_size, -1) - n_local  # [ROWS] each row's last candidate
        hi = tl.where(row_ok & (tpos >= 0), hi, -1)
        him = curm - n_local  # [BM]
        hmax = tl.max(him, 0)
        mu_base = MU + bh * NB * D
        s2_base = S2 + bh * NB * D
        if GP > 1:  # pass 1: each head's softmax normaliser over its candidates (log2 units)
            m_i = tl.full([ROWS], NEG, tl.float32)
            l_i = tl.zeros([ROWS], tl.float32)
            for n0 in range(n_sink, hmax + 1, BN):
                n = n0 + tl.arange(0, BN)
                s, f = _block_scores(q, q2, mu_base, s2_base, n, NB, scale, D, TAYLOR, PREC, EMU_BF16)
                cand = n[None, :] <= hi[:, None]
                s = tl.where(cand, s, NEG)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.where(cand, tl.exp2(s - m_new[:, None]) * f, 0.0), 1)
                m_i = m_new
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), 0.0)
        kk = tl.arange(0, KP)
        top = tl.full([BM, KP], EMPTY, tl.int32)  # the running best keys of each token
        kth = tl.full([BM], EMPTY, tl.int32)  # each token's current KP-th best
        for c in range(0, tl.cdiv(hmax + 1 - n_sink, BN)):  # pass 2, from the most recent blocks back
            n = hmax + 1 - (c + 1) * BN + tl.arange(0, BN)
            s, f = _block_scores(q, q2, mu_base, s2_base, n, NB, scale, D, TAYLOR, PREC, EMU_BF16)
            candm = (n[None, :] >= n_sink) & (n[None, :] <= him[:, None])  # [BM, BN]
            if GP > 1:
                cand = (n[None, :] >= n_sink) & (n[None, :] <= hi[:, None])
                p = tl.where(cand, tl.exp2(s - lse[:, None]) * f, 0.0)
                gs = tl.sum(tl.reshape(p, [BM, GP, BN]), 1)  # [BM, BN] group score
            else:  # one head: its score ranks as its softmax probability
                gs = s
                if TAYLOR:
                    gs += tl.log2(f)
            key = ((_order_key(gs) >> IB) << IB) | (IMASK - n)[None, :]
            key = tl.where(candm, key, EMPTY)
            above = tl.max(tl.sum((key > kth[:, None]).to(tl.int32), 1), 0)  # most new entries of a token
            if BITONIC:  # the chunk's best KP (sorted) merged into the sorted list
                if above > 0:
                    best = tl.topk(key, KP)
                    top = tl.bitonic_merge(tl.maximum(top, tl.flip(best, 1)), descending=True)
                    kth = tl.min(top, 1)
            else:  # the chunk's best remaining key of each token replaces its KP-th, while it beats it
                for _it in range(0, tl.minimum(above, KP)):
                    best = tl.max(key, 1)  # [BM]
                    put = (best > kth)[:, None] & (kk[None, :] == tl.argmin(top, 1)[:, None])
                    top = tl.where(put, best[:, None], top)
                    key = tl.where(key == best[:, None], EMPTY, key)
                    kth = tl.min(top, 1)
        if not BITONIC:  # descending order for the output
            rest = top
            for j in tl.static_range(KP):
                best = tl.max(rest, 1)
                top = tl.where(kk[None, :] == j, best[:, None], top)
                rest = tl.where(rest == best[:, None], EMPTY, rest)
    out = IDX + ((b * T + tt) * H + h) * NSEL  # [BM]
    jf = tl.arange(0, NFP)[None, :]  # forced slots: the local blocks (current first), then the sinks
    nf = n_local + n_sink
    is_local = jf < n_local
    fblk = tl.where(is_local, curm[:, None] - jf, jf - n_local)
    fok = tl.where(is_local, fblk >= 0, fblk <= curm[:, None] - n_local) & (jf < nf)  # sinks not already local
    tl.store(out[:, None] + jf, tl.where(fok, fblk, -1), mask=tok[:, None] & (jf < nf))
    free = top_k - tl.sum(fok.to(tl.int32), 1)  # [BM]
    kk = tl.arange(0, KP)
    base = out[:, None] + n_local + n_sink + kk[None, :]
    if FREE:
        ok = (top != EMPTY) & (kk[None, :] < free[:, None])
        tl.store(base, tl.where(ok, IMASK - (top & IMASK), -1), mask=tok[:, None] & (kk[None, :] < top_k))
        for rr in range(KP, top_k):  # beyond any token's free budget
            tl.store(out + n_local + n_sink + rr, tl.full([BM], -1, tl.int32), mask=tok)
    else:
        for rr in range(0, top_k):
            tl.store(out + n_local + n_sink + rr, tl.full([BM], -1, tl.int32), mask=tok)


def score_operands(stats: BlockStats, dim: int, dtype: torch.dtype, taylor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The score operands of the blocks: means mu and s2 / (2 dim) (the diagonal variance, clamped at 0),
    [B*H, NB, dim] contiguous in `dtype` (fp16: clamped to its range); without `taylor` the second is mu."""
    B, H, NB, D = stats.sum_k.shape
    cnt = stats.count.float().clamp(min=1.0)[:, None, :, None]
    mu = stats.sum_k.float() / cnt
    s2 = (stats.sum_k2.float() / cnt - mu * mu).clamp(min=0.0) * (0.5 / dim) if taylor else None
    if dtype == torch.float16:
        mu = mu.clamp(-FP16_MAX, FP16_MAX)
        s2 = s2.clamp(max=FP16_MAX) if taylor else None
    mu = mu.to(dtype).reshape(B * H, NB, D).contiguous()
    return mu, (s2.to(dtype).reshape(B * H, NB, D).contiguous() if taylor else mu)


def tile_rows(G: int, D: int, rows: int | None = None) -> tuple[int, int]:
    """(GP, BM): the group padded to a power of two and the tokens of one query tile (BM x GP rows,
    at least 16 for tl.dot; `rows` default 128, 64 for D > 128)."""
    GP = next_power_of_2(G)
    rows = rows if rows is not None else (128 if D <= 128 else 64)
    BM = max(1, rows // GP)
    while BM * GP < 16:
        BM *= 2
    return GP, BM


#: The streamed selection's default launch settings: "bitonic" merge in chunks of 32 blocks with 8 warps,
#: the fastest setting of the sweep at 16k and 32k (docs/benchmarks_history.md, 2026-12-03, fifth run). At 128k
#: on random q / k "insert" in chunks of 64 with 4 warps timed faster alone, but in the model (q / k of
#: the layers, whose scores come in longer runs of new top-k entries) bitonic's fixed cost won on time to
#: first token (sixth run), so bitonic at every length.
#: A caller's "insert" keeps its own defaults: chunks and warps by the tile.
DEFAULT_MERGE = "bitonic"
LAUNCH_DEFAULTS = {"bitonic": dict(block_chunk=32, num_warps=8), "insert": dict(block_chunk=None, num_warps=None)}


def select_indices_stream(
    q: torch.Tensor,
    stats: BlockStats,
    q_pos: torch.Tensor,
    params: SPLAParams,
    *,
    precision: str = "bf16",
    rows: int | None = None,
    block_chunk: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    merge: str | None = None,
) -> torch.Tensor:
    """The selected blocks of every query q [B, Tq, HQ, D] (any strides, unit stride in D; positions
    q_pos [B, Tq], -1 = padding) as int32 indices [B, Tq, H, local + sink + top_k] (-1 = none): the
    local blocks (current first), the sinks, then the free budget by descending group score, as
    `triton_tile.select_indices_fast`. One launch, no host synchronisation, no scratch tensor.

    `precision`: the score dots' operands, "bf16" (default), "fp16" (8x finer, statistics clamped to
    its range), "tf32x3" or "ieee" (fp32). Launch settings: `rows` per query tile (tokens x padded
    group), `block_chunk` blocks per step (at least the free budget padded to a power of two),
    `num_warps`, `num_stages`, `merge` (how a chunk joins the running top-k: "insert", one
    arg-max per new entry, or "bitonic", tl.topk and a bitonic merge). Unset settings follow
    `DEFAULT_MERGE` and that merge's `LAUNCH_DEFAULTS`. The selection of
    `select.select_blocks` up to ties within the operands' rounding (`recall.selection_recall`
    measures how close); `params` gives the budget and the selection."""
    block_size, top_k_blocks, selection = params.block_size, params.top_k_blocks, params.selection
    num_sink_blocks, num_local_blocks = params.num_sink_blocks, params.num_local_blocks
    if selection not in ("taylor", "mean"):
        raise ValueError(f"selection must be 'taylor' or 'mean'; got {selection!r}")
    merge = merge or DEFAULT_MERGE
    if merge not in LAUNCH_DEFAULTS:
        raise ValueError(f"merge must be 'insert' or 'bitonic'; got {merge!r}")
    block_chunk = block_chunk or LAUNCH_DEFAULTS[merge]["block_chunk"]
    num_warps = num_warps or LAUNCH_DEFAULTS[merge]["num_warps"]
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if num_local_blocks < 1 or num_sink_blocks < 0:
        raise ValueError(f"need num_local_blocks >= 1 and num_sink_blocks >= 0; got {num_local_blocks}, "
                         f"{num_sink_blocks}")
    B, Tq, HQ, D = q.shape
    H, NB = stats.sum_k.shape[1], stats.num_blocks
    if HQ % H:
        raise ValueError(f"{HQ} query heads are not a multiple of the {H} KV heads of the block statistics")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two >= 16 (tl.dot tiles)")
    if tuple(q_pos.shape) != (B, Tq):
        raise ValueError(f"q_pos must be [B, Tq] = [{B}, {Tq}]; got {list(q_pos.shape)}")
    G = HQ // H
    GP, BM = tile_rows(G, D, rows)
    dev = q.device
    nsel = num_local_blocks + num_sink_blocks + top_k_blocks
    nfree = top_k_blocks - num_local_blocks - num_sink_blocks  # most free picks of any token
    KP = max(2, next_power_of_2(max(1, nfree)))
    BN = max(16, KP, block_chunk or (64 if D <= 128 else 32))
    if BN & (BN - 1):
        raise ValueError(f"block_chunk must be a power of two; got {block_chunk}")
    out = new_output((B, Tq, H, nsel), dev, torch.int32)
    if B * Tq * H == 0:
        return out
    dtype, prec = PRECISIONS[precision]
    emulate = dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    prec = "ieee" if emulate else prec
    taylor = selection == "taylor"
    if NB == 0:
        stats = BlockStats.empty(B, H, D, dev, num_blocks=1)
    mu, s2 = score_operands(stats, D, dtype, taylor)
    if q.stride(-1) != 1:
        q = q.contiguous()
    qpos = q_pos.to(torch.int32).contiguous()
    IB = max(1, (max(1, stats.num_blocks) - 1).bit_length())
    if IB > 22:
        raise ValueError(f"{stats.num_blocks} blocks exceed the 2^22 the packed top-k keys index")
    stream_select_kernel[(B * H * cdiv(Tq, BM),)](
        q, mu, s2, qpos, out, q.stride(0), q.stride(1), q.stride(2),
        B, Tq, H, stats.num_blocks, block_size, num_sink_blocks, num_local_blocks, top_k_blocks, nsel,
        math.log2(math.e) / math.sqrt(D),
        G=G, GP=GP, BM=BM, D=D, BN=BN, KP=KP, NFP=max(2, next_power_of_2(nsel - top_k_blocks)), IB=IB,
        TAYLOR=taylor, FREE=nfree > 0, PREC=prec, CLAMP16=dtype == torch.float16, EMU_BF16=emulate,
        BITONIC=merge == "bitonic",
        num_warps=num_warps or (8 if BM * GP * D >= 128 * 128 else 4), num_stages=num_stages or 2,
    )
    return out
