"""What the block-major SPLA kernels' forward (`triton_blocks`) and backward (`triton_blocks_bwd`) share:
the launch plan (`BlocksPlan`, `blocks_plan`), the inverted selection (`BlockPairs`) and its segment
table (`segments`), the device functions both walk the segments with (`segment_kv`, `chunk_rows`,
`query_rows`, `dot`, `add_rows`) and the host helpers `kernel_operands` and `row_max`. The contract
and the algorithm are `triton_blocks`' module docstring."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from ..triton_launch import jit
from ..triton_utils import cdiv, next_power_of_2
from ..utils import import_triton, new_output

triton, tl = import_triton()

@dataclass(frozen=True)
class BlocksPlan:
    """Launch settings of the block-major kernels, decided once per call from shapes (`blocks_plan`).

    rows / bwd_rows: (token, head) rows of one chunk in pass 2 / the backward (a chunk holds
    rows // G tokens); lse_rows / lse_warps: rows and warps of pass 1 (same segments as pass 2);
    seg_chunks / bwd_seg_chunks: chunks of pass 2 / the backward per segment (one program);
    window: query slots per window of the pair order (the output rows the atomics of the programs
    in flight touch); sort: "sort" (stable torch.sort) or "count" (counting sort with atomics, the
    slower at 32k); warps / bwd_warps, stages / bwd_stages: num_warps and
    num_stages of pass 2 / the backward; precision: dot precision of fp32 operands, "tf32" or "ieee"
    (16-bit operands always run on the tensor cores, fp32 accumulation); bwd: "split" (dq over parts
    of dq_keys keys of the block, then dk/dv of both branches over parts of dkdv_keys keys) or
    "split3" (the same with dk/dv of each branch in a launch of its own: fewer registers) or "fused" (dq, dk
    and dv in one pass over whole blocks: each chunk's rows loaded and P, dS computed once);
    atomics: how rows are added to O, otilde, dq, dk, dv (`add_rows`): "scalar", "v4" (sm_90 vector
    reductions) or "v4-split" (v4's column split with scalar atomics, for the interpreter); forward:
    "split" (one pass storing per-slot partials, then a combine) or "atomic" (two passes, O added with
    atomics; module docstring); partials: the split form's partial dtype, "input" (the inputs' dtype
    where it has 16 bits, else fp32), "fp32" or "bf16"; dq: "atomic" (the backward adds each pair's dq
    to its (token, head) row with atomics) or "pairs" (each pair's dq stored in a row of its own, fp32,
    then summed over the slots: no atomics, T x HQ x NSEL x D floats; past `DQ_PAIR_BYTES` the atomic
    form); rla_sum: how the split form sums the correction otilde over a token's slots, "partials" (stored
    per slot like O's, summed by the combine) or "atomic" (added to the token's row with fp32 atomics: a
    plain sum, no partials written and read back). The defaults are `blocks_plan`'s at d128."""

    rows: int = 64
    bwd_rows: int = 32
    seg_chunks: int = 32
    bwd_seg_chunks: int = 32
    window: int = 8192
    sort: str = "sort"
    warps: int = 4
    bwd_warps: int = 4
    stages: int = 1
    bwd_stages: int = 1
    precision: str = "tf32"
    lse_rows: int = 128
    lse_warps: int = 8
    bwd: str = "split3"
    dkdv_keys: int = 64
    dq_keys: int = 64
    atomics: str = "scalar"
    forward: str = "split"
    partials: str = "input"
    dq: str = "atomic"
    rla_sum: str = "partials"

    def tokens(self, G: int, backward: bool = False) -> int:
        """Tokens of one chunk: rows // G, at least 1."""
        return max(1, (self.bwd_rows if backward else self.rows) // G)

    def seg_pairs(self, G: int, backward: bool = False) -> int:
        """Pairs (token, slot) of one segment: whole chunks."""
        return self.tokens(G, backward) * (self.bwd_seg_chunks if backward else self.seg_chunks)


#: `BlocksPlan.atomics` -> the ATOMICS constexpr of `add_rows`.
ATOMIC_MODES = {"scalar": 0, "v4": 1, "v4-split": 2}

#: Output bytes per KV head that the pair order keeps in flight (window x G x D fp32 rows, O and
#: otilde): the default window holds that much, under the H200's 50 MB of L2 (8192 tokens at G4 d128;
#: 4096 and 16384 measured slower at 32k).
WINDOW_BYTES = 32 << 20

def blocks_plan(G: int, D: int, device: torch.device | str, use_rla: bool = True, *,
                precision: str | None = None, dtype: torch.dtype = torch.bfloat16, **overrides) -> BlocksPlan:
    """The launch settings for a GQA group of G heads of dimension D, chosen where the kernels compile for sm_90
    without register spills (or with the fewest) and measured fastest on the H200
    (scripts/benchmarks/kernels/bench_spla_blocks.py --sweep; docs/benchmarks.md): see the defaults below.
    Vector atomics ("v4") on sm_90 and later (the same adds per second as scalar ones, fewer instructions and
    registers: a slightly faster forward), scalar ones for tiles smaller than the threads (`_v4_covers`); a
    window of WINDOW_BYTES of output rows per KV head (a power of two in [256, 16384]); `precision` of fp32
    dots: "tf32" on CUDA, "ieee" elsewhere (the CPU interpreter, where the fp64-oracle tests run); fp32 operands
    (`dtype` fp32 or fp64) at d256 take the backward kernels over half blocks (the shared memory of whole ones
    is over the H200's 227 KB). `overrides`: any field of `BlocksPlan`."""
    device = torch.device(device)
    if precision is None:
        precision = "tf32" if device.type == "cuda" else "ieee"
    vec = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    gp = next_power_of_2(G)
    # pass 2 on 64 rows of 4 warps (d <= 128: faster than 128 rows of 8 warps) or 32 (d256); the backward on
    # 64 rows fused (d <= 64: faster than split3; even at d128) or split3 on 32 rows of 4 warps over whole
    # blocks; 32 chunks per segment; 32 MB windows (the sweeps of scripts/benchmarks/kernels/bench_spla_blocks.py
    # --sweep, docs/benchmarks.md)
    rows, warps = (64, 4) if D <= 128 else (32, 4)
    per_token = G * D * 4 * (2 if use_rla else 1)
    window = 1 << max(8, min(14, (WINDOW_BYTES // per_token).bit_length() - 1))
    bwd_rows = max(64 if D <= 64 else 32, gp)
    plan = BlocksPlan(rows=max(rows, gp, 16), warps=warps, bwd_rows=bwd_rows, bwd_warps=4, window=window,
                      precision=precision, lse_rows=max(128, gp), lse_warps=8 if D >= 64 else 4, seg_chunks=32,
                      bwd_seg_chunks=32, bwd="fused" if D <= 64 else "split3", atomics="v4" if vec else "scalar")
    if dtype in (torch.float32, torch.float64) and D >= 256:  # whole fp32 blocks overflow shared memory
        plan = replace(plan, dq_keys=32, dkdv_keys=32)
    plan = replace(plan, **overrides)
    if plan.atomics == "v4" and not _v4_covers(plan, D):
        plan = replace(plan, atomics="scalar")
    if plan.sort not in ("sort", "count"):
        raise ValueError(f"sort must be 'sort' or 'count', got {plan.sort!r}")
    if plan.precision not in ("tf32", "ieee"):
        raise ValueError(f"precision must be 'tf32' or 'ieee', got {plan.precision!r}")
    if plan.atomics not in ATOMIC_MODES:
        raise ValueError(f"atomics must be one of {sorted(ATOMIC_MODES)}, got {plan.atomics!r}")
    if plan.bwd not in ("split", "split3", "fused"):
        raise ValueError(f"bwd must be 'split', 'split3' or 'fused', got {plan.bwd!r}")
    if plan.forward not in ("split", "atomic"):
        raise ValueError(f"forward must be 'split' or 'atomic', got {plan.forward!r}")
    if plan.dq not in ("atomic", "pairs"):
        raise ValueError(f"dq must be 'atomic' or 'pairs', got {plan.dq!r}")
    if plan.rla_sum not in ("partials", "atomic"):
        raise ValueError(f"rla_sum must be 'partials' or 'atomic', got {plan.rla_sum!r}")
    if plan.partials not in ("input", "fp32", "bf16"):
        raise ValueError(f"partials must be 'input', 'fp32' or 'bf16', got {plan.partials!r}")
    for name in ("rows", "bwd_rows", "lse_rows", "dkdv_keys", "dq_keys"):
        n = getattr(plan, name)
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {n}")
    return plan


def _v4_covers(plan: BlocksPlan, D: int) -> bool:
    """Whether every tile the kernels add with vector atomics ([rows, D / 4] groups of four floats:
    the forward's chunks, the backward's dq chunks, its dk / dv parts of at least 16 keys) has at
    least one group per thread: inline assembly has no masks for the copies a smaller tile gets on
    several threads, so each copy would be added (tiny plans, e.g. rows 16 at d16)."""
    rows = ((plan.rows, plan.warps), (plan.bwd_rows, plan.bwd_warps), (min(16, plan.dkdv_keys), plan.bwd_warps))
    return all(r * (D // 4) >= 32 * w for r, w in rows)


class RLAEpilogue(NamedTuple):
    """What the split forward's combine needs to return o_sp + RMSNorm_weight(o_rla) instead of otilde (the
    SPLA mixer's norm-add, fused for calls without gradients): o_rla = o_lin - otilde, 0 on the dropped
    rows. o_lin [B, T, HQ, D] fp32 (the causal linear term), drop [B, T, H] bool (`dropped_rows`),
    weight [HQ, D] (the per-head norm weight, gamma), eps."""

    o_lin: torch.Tensor
    drop: torch.Tensor
    weight: torch.Tensor
    eps: float

    def rows(self, start: int, stop: int) -> RLAEpilogue:
        """The epilogue of the query rows [start, stop)."""
        return self._replace(o_lin=self.o_lin[:, start:stop], drop=self.drop[:, start:stop])

    def apply(self, o_sp: torch.Tensor, otilde: torch.Tensor) -> torch.Tensor:
        """The PyTorch form: o_sp + RMSNorm_weight(o_rla) in fp32, rounded once to o_sp's dtype."""
        B, T, HQ, D = o_sp.shape
        drop = self.drop.repeat_interleave(HQ // self.drop.shape[2], dim=2)[..., None]  # [B, T, HQ, 1]
        x = (self.o_lin.float() - otilde.float()).masked_fill(drop, 0.0)
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return (o_sp.float() + x * self.weight.float()).to(o_sp.dtype)


class BlockPairs(NamedTuple):
    """The selection inverted: `pairs` int32 [P] holds flat indices e = ((b*T + t)*H + h)*NSEL + i of
    idx, sorted by key ((b*H + h)*NW + t // window)*NB + idx[e] (valid pairs first, ascending t within
    a key); `starts` int32 [NK + 1] the first sorted position of each key (starts[NK]: the number of
    valid pairs). NW windows of `window` query slots, NB key blocks."""

    pairs: torch.Tensor
    starts: torch.Tensor
    window: int
    num_windows: int
    num_blocks: int

@jit
def segments_kernel(STARTS, SEG_KEY, SEG_FIRST, SEG_COUNT, NK, NSEG, SEG: tl.constexpr, BLOCK: tl.constexpr):
    """One program: each key's run of pairs (STARTS [NK + 1]) cut into segments of at most SEG pairs,
    numbered in key order (an exclusive cumsum of the per-key segment counts, carried over tiles of
    BLOCK keys); the entries past the real segments get the last key, first 0 and count 0."""
    carry = tl.zeros([], tl.int32)
    for k0 in range(0, NK, BLOCK):
        key = k0 + tl.arange(0, BLOCK)
        ok = key < NK
        start = tl.load(STARTS + key, mask=ok, other=0)
        count = tl.load(STARTS + key + 1, mask=ok, other=0) - start
        nseg = (count + SEG - 1) // SEG
        base = carry + tl.cumsum(nseg, 0) - nseg
        for j in range(0, tl.max(nseg, 0)):
            w = ok & (j < nseg)
            tl.store(SEG_KEY + base + j, key, mask=w)
            tl.store(SEG_FIRST + base + j, start + j * SEG, mask=w)
            tl.store(SEG_COUNT + base + j, tl.minimum(count - j * SEG, SEG), mask=w)
        carry += tl.sum(nseg, 0)
    for s0 in range(carry, NSEG, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        w = s < NSEG
        tl.store(SEG_KEY + s, tl.full([BLOCK], 0, tl.int32) + NK - 1, mask=w)
        tl.store(SEG_FIRST + s, tl.zeros([BLOCK], tl.int32), mask=w)
        tl.store(SEG_COUNT + s, tl.zeros([BLOCK], tl.int32), mask=w)


def segments(bp: BlockPairs, seg_pairs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each key's run of pairs cut into segments of at most `seg_pairs`: (key, first sorted position,
    count) int32, each [NSEG] with NSEG = ceil(P / seg_pairs) + NK (a bound from shapes); entries past
    the real segments have count 0. One launch (`segments_kernel`); `segments_reference` is its
    PyTorch form."""
    NK = bp.starts.numel() - 1
    NSEG = cdiv(bp.pairs.numel(), seg_pairs) + NK
    out = [new_output((NSEG,), bp.starts.device, torch.int32) for _ in range(3)]
    segments_kernel[(1,)](bp.starts, *out, NK, NSEG, SEG=seg_pairs, BLOCK=1024)
    return tuple(out)


def segments_reference(bp: BlockPairs, seg_pairs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`segments` in PyTorch ops (the test's oracle)."""
    starts = bp.starts.long()
    NK = starts.numel() - 1
    P = bp.pairs.numel()
    counts = starts[1:] - starts[:-1]  # [NK]
    nseg = (counts + seg_pairs - 1) // seg_pairs
    cum = torch.cumsum(nseg, 0)  # inclusive
    NSEG = cdiv(P, seg_pairs) + NK
    s = torch.arange(NSEG, device=starts.device)
    key = torch.searchsorted(cum, s, right=True)  # [NSEG], NK past the last segment
    kc = key.clamp(max=NK - 1)
    j = s - (cum[kc] - nseg[kc])  # segment number within its key
    first = starts[kc] + j * seg_pairs
    count = torch.where(key < NK, (counts[kc] - j * seg_pairs).clamp(0, seg_pairs), 0)
    return kc.to(torch.int32), torch.where(key < NK, first, 0).to(torch.int32), count.to(torch.int32)

@jit
def dot(a, b, F32: tl.constexpr, PREC: tl.constexpr):
    """a @ b with fp32 accumulation: fp32 operands at PREC ("tf32" or "ieee"), else on the tensor
    cores with `a` cast to b's (16-bit) dtype."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    else:
        return tl.dot(a.to(b.dtype), b)


@jit
def program_segment(SEG_KEY, SEG_FIRST, SEG_COUNT, KOFF, ROWMAX, NW, NB, H, S, BS: tl.constexpr, BSK: tl.constexpr):
    """Segment of this program (program_id(0)) and its part program_id(1) of BSK keys of the block:
    (b, h, first sorted position, count, koff, key positions [BSK], which key slots to load [BSK]:
    those up to the row's last query position ROWMAX[b], inside the cache, where the segment has
    pairs; later slots may hold anything, a static cache's unwritten memory too)."""
    s = tl.program_id(0)
    key = tl.load(SEG_KEY + s)
    first = tl.load(SEG_FIRST + s)
    count = tl.load(SEG_COUNT + s)
    blk = key % NB
    bh = key // (NB * NW)
    b = bh // H
    h = bh % H
    koff = tl.load(KOFF + b)
    pos = blk * BS + tl.program_id(1) * BSK + tl.arange(0, BSK)
    last = tl.where(count > 0, tl.load(ROWMAX + b), -1)  # an empty segment loads nothing
    kload = (pos <= last) & (koff + pos < S)
    return b, h, first, count, koff, pos, kload


@jit
def key_tile(X, b64, h, slot, kload, stride_b, stride_h, stride_s, D: tl.constexpr):
    """The rows `slot` [BSK] (those with kload) of X[b, h] (K or V, [B, H, S, D] strides): [BSK, D]."""
    d = tl.arange(0, D)
    return tl.load(X + b64 * stride_b + h * stride_h + slot[:, None] * stride_s + d[None, :], mask=kload[:, None],
                   other=0.0)


@jit
def segment_kv(SEG_KEY, SEG_FIRST, SEG_COUNT, KOFF, ROWMAX, K, V, stride_kb, stride_kh, stride_ks, stride_vb,
                stride_vh, stride_vs, NW, NB, H, S, BS: tl.constexpr, BSK: tl.constexpr, D: tl.constexpr):
    """`program_segment` and the K, V tiles [BSK, D] of its keys: (b, h, first, count, key positions, kload,
    b as int64, key slots, k, v)."""
    b, h, first, count, koff, pos, kload = program_segment(SEG_KEY, SEG_FIRST, SEG_COUNT, KOFF, ROWMAX, NW, NB, H, S,
                                                           BS, BSK)
    b64 = b.to(tl.int64)
    slot = koff + pos
    k = key_tile(K, b64, h, slot, kload, stride_kb, stride_kh, stride_ks, D)
    v = key_tile(V, b64, h, slot, kload, stride_vb, stride_vh, stride_vs, D)
    return b, h, first, count, pos, kload, b64, slot, k, v


@jit
def query_rows(Q, b64, h, t, g, ok, stride_b, stride_h, stride_t, T, H, G: tl.constexpr, D: tl.constexpr):
    """The chunk's query rows q [R, D] (token t, head h * G + g; 0 where not ok) and their row index
    (b * T + t) * HQ + head into the [B, T, HQ, ...] outputs and statistics."""
    head = h * G + g
    q = tl.load(Q + b64 * stride_b + head[:, None] * stride_h + t[:, None] * stride_t + tl.arange(0, D)[None, :],
                mask=ok[:, None], other=0.0)
    return q, (b64 * T + t) * (H * G) + head


@jit
def chunk_rows(PAIRS, QPOS, first, c0, count, T, H, NSEL, b,
                G: tl.constexpr, R: tl.constexpr, BMQ: tl.constexpr):
    """Rows (token, head) of the chunk at sorted positions [first + c0, first + c0 + BMQ): per row the
    pair e, its token t, the token's position, the head within the group g, and whether the row is
    real."""
    r = tl.arange(0, R)
    m = r // G
    g = r % G
    ok = (m < BMQ) & (c0 + m < count)
    e = tl.load(PAIRS + first + c0 + m, mask=ok, other=0)
    t = (e // (H * NSEL)) % T
    tpos = tl.load(QPOS + b * T + t, mask=ok, other=-1)
    return e, t, tpos, g, ok


@jit
def add_rows(OUT, row, x, ok, D: tl.constexpr, ATOMICS: tl.constexpr):
    """OUT[row[r] * D + d] += x[r, d] for the rows r with ok[r] (x [R, D] fp32), with fp32 atomics:
    ATOMICS 0: tl.atomic_add (one float per instruction); 1: red.global.add.v4.f32 (sm_90: four
    consecutive floats per instruction); 2: the same split of x into four columns as 1 with one
    tl.atomic_add per column (what the interpreter can run: it checks the split)."""
    if ATOMICS == 0:
        tl.atomic_add(OUT + row[:, None] * D + tl.arange(0, D)[None, :], x, mask=ok[:, None], sem="relaxed")
    else:
        R: tl.constexpr = x.shape[0]
        a, b = tl.split(tl.reshape(x, [R, D // 4, 2, 2]))  # x[r, 4c + 2i + j] -> a: j = 0, b: j = 1
        x0, x2 = tl.split(a)
        x1, x3 = tl.split(b)
        p = OUT + row[:, None] * D + (tl.arange(0, D // 4) * 4)[None, :]  # [R, D // 4]: column 4c
        m = tl.broadcast_to(ok[:, None], [R, D // 4])
        if ATOMICS == 1:
            tl.inline_asm_elementwise(
                asm="{ .reg .pred p; setp.ne.b32 p, $6, 0; "
                    "@p red.global.gpu.relaxed.add.v4.f32 [$1], {$2, $3, $4, $5}; mov.u32 $0, 0; }",
                constraints="=r,l,f,f,f,f,r", args=[p.to(tl.int64), x0, x1, x2, x3, m.to(tl.int32)], dtype=tl.int32,
                is_pure=False, pack=1)
        else:  # "+ 0.0": fresh tensors (Triton 3.6's interpreter adds a split's strided views from the wrong places)
            tl.atomic_add(p, x0 + 0.0, mask=m, sem="relaxed")
            tl.atomic_add(p + 1, x1 + 0.0, mask=m, sem="relaxed")
            tl.atomic_add(p + 2, x2 + 0.0, mask=m, sem="relaxed")
            tl.atomic_add(p + 3, x3 + 0.0, mask=m, sem="relaxed")

def kernel_operands(q, k, v):
    """Kernel operands: unit stride in D; fp64 (tests) runs in fp32. Returns (q, k, v, F32)."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if q.dtype == torch.float64:
        q, k, v = q.float(), k.float(), v.float()
    return q, k, v, q.dtype == torch.float32

def row_max(qpos: torch.Tensor) -> torch.Tensor:
    """The last query position of each row [B] int32 (-1 for a row of padding): the kernels load key
    slots up to it only."""
    return qpos.amax(1).to(torch.int32) if qpos.shape[1] else qpos.new_full((qpos.shape[0],), -1)
