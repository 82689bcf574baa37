"""SSE on the Triton kernels: the sorted variable-length form (training / prefill) and the decode step.

`sse_triton` has `sse_varlen`'s contract and values (see `varlen.py`) and no host synchronisation:

1. Grouping by (sample, partition) in time order with fixed shapes (`group_rows`, two launches).
   Each token takes `topk` rows (default N: always enough; pass the router's K to cut the work to
   (1 + K) T). Segment b * N + i holds row b's tokens routed to partition i; its length is
   sum_t sel[b, t, i], and the row of (b, t, i) is the number of selected entries before it in
   (b, partition, t) order, so the bounds are computed on the device. Rows left over (tokens with
   fewer than `topk` selections, i.e. padding) form one trailing "trash" segment with zero key,
   query and decay: it reads and writes nothing.
2. One call of the chunked GLA op (`gla.triton_chunk`) over merged rows (`PackRows`, one kernel
   each way): the B shared rows (q1, k1, v, g1) as one segment per sample, then the B * N partition
   segments on the gathered (p q2, p k2, v, g2), then the trash segment. Initial states are the
   SSE states, final states come back as the new ones (a partition with no token keeps its state
   exactly); the shared walk and the partitions' run side by side in the same launches.
3. Each token's output is its shared row's plus its partition rows' (`CombineRows`: a gather in
   fp32 forward, a gather of the token's gradient backward; no scatter).

Autograd runs through all of it (router probs, q2 / k2 (hence LoRA offsets), gates g1 / g2, the
initial states). The GLA base only, fp32/bf16/fp16: `sse_attention` sends other inputs (fp64,
base="gdn") to the PyTorch forms.

`sse_decode_triton` is one token: one program per (V block, sample x head) updates the shared
state and, for each partition, reads and writes its state only where `sel` is set; with
inplace=True into `state`'s tensors (other rows of `state.parts` are not touched).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..gla.triton_chunk import ChunkLinearAttention, chunk_linear_attention, varlen_chunks
from ..triton_launch import jit
from ..triton_math import logsigmoid
from ..triton_norm_gate import norm_gate_rows
from ..triton_rms_norm import rms_inverse
from ..triton_utils import block_size, cdiv, dot_precision, next_power_of_2, read_in_place, rows_per_program
from ..utils import KeepingCtx, _RecordlessCtx, import_triton, new_output, new_outputs, run_function
from .recurrent import SSEState, setup
from .triton_features import (
    _ld,
    _second_at,
    _silu_grad,
    _softmax,
    _softmax_grad,
    feature_grad_outputs,
    feature_grads,
    group_sums,
)
from .triton_router import ROWS

triton, tl = import_triton()


def group_rows_reference(sel: Tensor, topk: int):
    """sel [B, T, N] bool -> (src [R], cu [B + B * N + 2], inv [B * T * N]) with R = B * T * topk: the
    partition rows sorted by (b, partition, t), R of them, after the B * T rows of the shared branch.

    src: each partition row's token and partition as (b * T + t) * N + i (0 past the selected rows);
    cu (int32, as the chunked GLA kernels read it: no cast before their call): the bounds of the merged
    segments: the B shared rows [b T, (b + 1) T), then the B * N partition segments from B T on, then
    one trailing segment of the rows left over (up to B T + R);
    inv: for each (token, partition) (b * T + t) * N + i its partition row (0-based, not offset by
    B T), -1 where not selected (or dropped: past topk selections).

    In (b, partition, t) order, the row of a selected token is the number of selected entries before
    it: one exclusive cumulative sum over the flattened selection (a scan along the last dim of a
    contiguous tensor; along T of [B, T, N] PyTorch's CUDA scan is slow at long T). About fifteen
    launches: `group_rows`'s oracle."""
    B, T, N = sel.shape
    R, BT = B * T * topk, B * T
    dev = sel.device
    picked = sel.transpose(1, 2).reshape(-1)                                      # [B * N * T] bool
    s = picked.to(torch.int64)
    dest = s.cumsum(0) - s                                                        # rows before
    shared = torch.arange(B + 1, device=dev, dtype=torch.int64) * T
    cu = torch.cat([shared, BT + s.view(B * N, T).sum(-1).cumsum(0), s.new_full((1,), BT + R)]).to(torch.int32)
    kept = picked & (dest < R)
    dest = torch.where(kept, dest, R)                                             # R: dropped
    code = torch.arange(B * T * N, device=dev).view(B, T, N).transpose(1, 2).reshape(-1)  # (b * T + t) * N + i
    src = torch.zeros(R + 1, dtype=torch.int64, device=dev).scatter_(0, dest, code)[:R]
    inv = torch.full((B * T * N,), -1, dtype=torch.int64, device=dev).scatter_(0, code, torch.where(kept, dest, -1))
    return src, cu, inv


#: Selection entries a program of the grouping kernels takes (each block within one partition's segment).
GROUP_BLOCK = 1024


@jit
def group_count_kernel(SEL, COUNT, T, N, NCH, BLOCK: tl.constexpr):
    """COUNT[blk] = selected entries of block blk: the selection in (b, partition, t) order cut into
    blocks of BLOCK entries that stay inside one (b, partition) segment (NCH blocks a segment)."""
    blk = tl.program_id(0)
    seg, c = blk // NCH, blk % NCH
    t = c * BLOCK + tl.arange(0, BLOCK)
    code = ((seg // N) * T + t).to(tl.int64) * N + seg % N
    s = tl.load(SEL + code, mask=t < T, other=0).to(tl.int32)
    tl.store(COUNT + blk, tl.sum(s, 0))


@jit
def group_rows_kernel(SEL, COUNT, SRC, CU, INV, B, T, N, NCH, NB, R, NSUB, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """`group_rows_reference` over the blocks of `group_count_kernel`, one program a block: the rows
    before it (the counts of the blocks before), then an inclusive scan of its entries gives each
    selected entry its row (src = its code (b T + t) N + i, inv[code] = the row), the last block of a
    segment its end in cu; every program fills its share of the rows past the selected ones (src 0),
    the first one the shared rows' bounds and the end. COUNT holds NSUB counts a segment, SUB a block
    (`group_count_kernel`'s: NSUB = NCH, SUB = 1; the router kernel's: blocks of BLOCK / SUB tokens)."""
    blk = tl.program_id(0)
    seg, c = blk // NCH, blk % NCH
    first = seg * NSUB + c * SUB  # this block's first count
    n_count = NB // NCH * NSUB
    before = tl.zeros([], dtype=tl.int64)
    total = tl.zeros([], dtype=tl.int64)
    for j0 in range(0, n_count, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        cnt = tl.load(COUNT + j, mask=j < n_count, other=0).to(tl.int64)
        before += tl.sum(tl.where(j < first, cnt, 0), 0)
        total += tl.sum(cnt, 0)
    t = c * BLOCK + tl.arange(0, BLOCK)
    m = t < T
    code = ((seg // N) * T + t).to(tl.int64) * N + seg % N
    s = tl.load(SEL + code, mask=m, other=0).to(tl.int64)
    incl = tl.cumsum(s, 0) + before
    kept = (s != 0) & (incl <= R)  # past R: more than topk (dropped)
    tl.store(SRC + incl - 1, code, mask=m & kept)
    tl.store(INV + code, tl.where(kept, incl - 1, -1), mask=m)
    BT = B * T
    tl.store(CU + B + 1 + seg, (BT + before + tl.sum(s, 0)).to(tl.int32), mask=c == NCH - 1)
    stride = NB * BLOCK
    for r0 in range(total + blk * BLOCK, R, stride):
        r = r0 + tl.arange(0, BLOCK).to(tl.int64)
        tl.store(SRC + r, tl.zeros([BLOCK], dtype=tl.int64), mask=r < R)
    if blk == 0:
        for b0 in range(0, B + 1, BLOCK):
            b = b0 + tl.arange(0, BLOCK)
            tl.store(CU + b, (b * T).to(tl.int32), mask=b <= B)
        tl.store(CU + B + 1 + (NB // NCH), (BT + R).to(tl.int32))


def group_rows(sel: Tensor, topk: int, counts: Tensor | None = None):
    """`group_rows_reference`'s (src, cu, inv) in two launches over blocks of the selection
    (`group_count_kernel`, `group_rows_kernel`), or one given the router kernel's `counts` [B, N, blocks]
    (`router_topk(..., counts=True)`: the selections of each block of `triton_router.ROWS` tokens); the
    PyTorch ops for an empty selection (T = 0)."""
    B, T, N = sel.shape
    if T == 0 or B == 0:
        return group_rows_reference(sel, topk)
    R = B * T * topk
    dev = sel.device
    nch = cdiv(T, GROUP_BLOCK)
    nb = B * N * nch
    sel8 = sel.contiguous().view(torch.uint8)
    if counts is not None and (counts.shape != (B, N, cdiv(T, ROWS)) or counts.dtype != torch.int32):
        raise ValueError(f"counts must be the router kernel's int32 [B, N, blocks of {ROWS} tokens] = "
                         f"{[B, N, cdiv(T, ROWS)]}; got {list(counts.shape)} {counts.dtype}")
    if counts is None:
        count, cu = new_outputs([(nb,), (B + B * N + 2,)], dev, torch.int32)
        group_count_kernel[(nb,)](sel8, count, T, N, nch, GROUP_BLOCK, num_warps=4)
        nsub, sub = nch, 1
    else:
        count, cu = counts, new_output((B + B * N + 2,), dev, torch.int32)
        nsub, sub = counts.shape[2], GROUP_BLOCK // ROWS
    src, inv = new_outputs([(R,), (B * T * N,)], dev, torch.int64)
    group_rows_kernel[(nb,)](sel8, count, src, cu, inv, B, T, N, nch, nb, R, nsub, GROUP_BLOCK, sub, num_warps=4)
    return src, cu, inv


def sse_triton(q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, g1: Tensor, g2: Tensor,
               probs: Tensor, sel: Tensor, state: SSEState | None = None, *, base: str = "gla",
               beta: Tensor | None = None, chunk_size: int = 64, topk: int | None = None,
               inplace: bool = False, precision: str = "ieee") -> tuple[Tensor, SSEState]:
    """SSE with the Triton kernels, same contract and values as `sse_varlen` (module docstring).

    topk: at most this many partitions are selected per token (the router's K; default N). A token
    with more selections than `topk` is wrong input. A single token without gradients runs the
    decode kernel (`sse_decode_triton`, honouring `inplace`); `inplace` is ignored otherwise. The
    chunked kernels' dots of fp32 operands run at `precision` ("ieee" exact or "tf32").
    Returns (o [B, T, H, Dv] in q1's dtype, new SSEState (fp32))."""
    if base != "gla" or q1.dtype == torch.float64:
        raise ValueError("the SSE Triton kernels take the GLA base in fp32/bf16/fp16; sse_attention sends "
                         "other inputs to the PyTorch forms")
    # from zero states (a first call, no cache's state yet) the kernels start from zero themselves
    _, _, state = setup(q1, k1, q2, k2, v, g1, g2, probs, sel, state, base, beta, make_state=False)
    B, T = q1.shape[:2]
    N = probs.shape[-1]
    tensors = (q1, k1, q2, k2, v, g1, g2, probs) + (() if state is None else (state.shared, state.parts))
    if T == 1 and not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors)):
        inplace = inplace and state is not None and all(
            x.dtype == torch.float32 and x.is_contiguous() for x in (state.shared, state.parts))
        return sse_decode_triton(q1, k1, q2, k2, v, g1, g2, probs, sel, state, inplace=inplace)
    K = N if topk is None else topk
    if not 1 <= K <= N:
        raise ValueError(f"topk must be in [1, N={N}]; got {topk}")
    src, cu, inv = group_rows(sel, K)
    # one GLA call over the shared rows (one segment per sample) and the partition segments
    qa, ka, va, ga = run_function(PackRows, q1, k1, v, g1, q2, k2, g2, probs, src, cu, inv)
    return _merged_gla(qa, ka, va, ga, src, cu, inv, state, B, T, N, q1.dtype, chunk_size, precision)


def _merged_gla(qa: Tensor, ka: Tensor, va: Tensor, ga: Tensor, src: Tensor, cu: Tensor, inv: Tensor,
                state: SSEState | None, B: int, T: int, N: int, dtype: torch.dtype, chunk_size: int,
                precision: str, norm_gate: tuple | None = None) -> tuple[Tensor, SSEState]:
    """Steps 2 and 3 of the module docstring on the merged rows [B T + R, H, D] (`PackRows`' layout): the
    chunked GLA call from the SSE states (None: zeros) and each token's output summed from its rows (with
    `norm_gate` = (weight, gate, eps), no gradients: then its norm and gate, `combine_rows_gated`)."""
    o_all, h = chunk_linear_attention(qa, ka, va, ga, cu_seqlens=cu, initial_state=_initial_states(state, B, N),
                                      chunk_size=chunk_size, out_dtype=torch.float32, precision=precision)
    return _combined(o_all, h, src, cu, inv, B, T, N, dtype, norm_gate)


def _initial_states(state: SSEState | None, B: int, N: int) -> Tensor | None:
    """The chunked call's initial states [B + B N + 1, H, Dk, Dv] fp32 of the merged rows' segments (the
    shared rows', each partition's, the trailing segment's zeros), or None for zero states."""
    if state is None:
        return None
    H, Dk, Dv = state.shared.shape[1:]
    return torch.cat([state.shared.float(), state.parts.float().reshape(B * N, H, Dk, Dv),
                      state.shared.new_zeros(1, H, Dk, Dv, dtype=torch.float32)])


def _combined(o_all: Tensor, h: Tensor, src: Tensor, cu: Tensor, inv: Tensor, B: int, T: int, N: int,
              dtype: torch.dtype, norm_gate: tuple | None) -> tuple[Tensor, SSEState]:
    """Step 3: each token's output summed from its rows of o_all [B T + R, H, Dv] (with `norm_gate`: then
    its norm and gate), and the new SSEState from the segments' final states h."""
    H, Dk, Dv = h.shape[1], h.shape[2], o_all.shape[2]
    if norm_gate is not None:
        weight, gate, eps = norm_gate
        o = combine_rows_gated(o_all, inv, B * T, dtype, weight, gate, eps)
    else:
        o = run_function(CombineRows, o_all, src, cu, inv, B * T, dtype)
    return o.view(B, T, H, Dv), SSEState(h[:B], h[B:B + B * N].reshape(B, N, H, Dk, Dv))


def sse_triton_from_projections(q1: Tensor, k1: Tensor, q2: Tensor | None, k2: Tensor | None, v: Tensor, z1: Tensor,
                                z2: Tensor, bias1: Tensor, bias2: Tensor, normalizer: float, probs: Tensor,
                                sel: Tensor, state: SSEState | None = None, *, q2_mode: str = "full",
                                chunk_size: int = 64, topk: int | None = None, precision: str = "ieee",
                                valid: Tensor | None = None, norm_gate: tuple | None = None,
                                counts: Tensor | None = None, recompute: bool = True) -> tuple[Tensor, SSEState]:
    """`sse_triton` on the GLA base's feature maps and decays of the projections, `sse_gla_features(q1, k1,
    q2, k2, v, z1, z2, bias1, bias2, normalizer, q2_mode=q2_mode)`, with the same values and gradients: the
    features are computed where the merged rows are written (`PackFeatures`: one kernel in place of the
    feature kernel and `PackRows` each way), so that the seven feature tensors are never written out and read
    back. Inputs as `sse_gla_features` takes them (k1 and v at HK heads, column slices of a packed projection
    read in place); probs, sel, state, chunk_size, topk, precision as `sse_triton`'s; `valid` [B, T] bool
    (None: every token real): a padding token's features are 0, as the model zeroes them for the two steps
    (it neither reads, writes nor decays a state; sel must be False there). Differentiable in every tensor but
    sel. `norm_gate` = (weight [D] or [H, D], gate [B, T, H, D] contiguous in q1's dtype, eps), without
    gradients only: o is `norm_gate(o, weight, gate, eps)`'s, computed in the kernel that sums each token's
    rows. `counts`: the router kernel's selection counts of `sel` (`group_rows`). `recompute` (with
    gradients): the backward writes the merged rows again instead of keeping them (`RecomputedRows`: the
    same values and gradients, about (1 + K) x 10 bytes less kept per token and query-head dim for one more
    elementwise launch). Returns (o [B, T, H, D] in q1's dtype, new SSEState (fp32))."""
    from .features import MAX_DIM, Q2_MODES

    if q2_mode not in Q2_MODES:
        raise ValueError(f"q2_mode must be one of {Q2_MODES}; got {q2_mode!r}")
    B, T, H, D = q1.shape
    N = probs.shape[-1]
    if D > MAX_DIM or probs.shape != (B, T, N) or sel.shape != probs.shape or sel.dtype != torch.bool:
        raise ValueError(f"head dim {D} (at most {MAX_DIM}), probs {list(probs.shape)} and sel {list(sel.shape)} "
                         f"{sel.dtype} (both [B={B}, T={T}, N], sel bool)")
    if valid is not None and (valid.shape != (B, T) or valid.dtype != torch.bool):
        raise ValueError(f"valid must be a [B={B}, T={T}] bool mask; got {list(valid.shape)} {valid.dtype}")
    if state is not None and (state.shared.shape != (B, H, D, D) or state.parts.shape != (B, N, H, D, D)):
        raise ValueError(f"state must have shared [B, H, Dk, Dv] = {[B, H, D, D]} and parts [B, N, H, Dk, Dv] = "
                         f"{[B, N, H, D, D]}; got {list(state.shared.shape)} and {list(state.parts.shape)}")
    K = N if topk is None else topk
    if not 1 <= K <= N:
        raise ValueError(f"topk must be in [1, N={N}]; got {topk}")
    src, cu, inv = group_rows(sel, K, counts)
    if q2_mode == "same":
        q2 = k2 = q1  # placeholders the kernels do not read
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q1, k1, q2, k2, v, z1, z2, bias1, bias2, probs))
    if norm_gate is not None and grad:
        raise ValueError("norm_gate (the output norm and gate in the combining kernel) takes no gradients")
    if grad and recompute and B * T:
        o_all, h = RecomputedRows.apply(q1, k1, q2, k2, v, z1, z2, bias1, bias2, probs, src, cu, inv, valid,
                                        float(normalizer), q2_mode, _initial_states(state, B, N), chunk_size,
                                        dot_precision(q1.dtype, precision))
        return _combined(o_all, h, src, cu, inv, B, T, N, q1.dtype, None)
    qa, ka, va, ga = run_function(PackFeatures, q1, k1, q2, k2, v, z1, z2, bias1, bias2, probs, src, cu, inv,
                                  valid, float(normalizer), q2_mode, grad)
    return _merged_gla(qa, ka, va, ga, src, cu, inv, state, B, T, N, q1.dtype, chunk_size, precision, norm_gate)


class PackFeatures(torch.autograd.Function):
    """`sse_gla_features` then `PackRows`, one kernel each way (`_pack_features`, `_pack_features_bwd`):
    the merged rows [B T + R, H, D] (q, k in q1's dtype, v in v's, g fp32) of the projections q1, k1 (and
    v at HK heads), q2, k2 (as q2_mode reads them), z1, z2, the decay biases, the router probabilities and
    `group_rows`' src, cu, inv; a padding token's (valid False; None: none) features are 0. The inputs are
    read in place where their tokens are rows of one stride and saved so (views); nothing is saved when
    `grad` is False."""

    @staticmethod
    def forward(ctx, q1, k1, q2, k2, v, z1, z2, bias1, bias2, probs, src, cu, inv, valid, normalizer, q2_mode,
                grad):
        from .triton_features import ELEMENTS, MODES

        B, T, H, D = q1.shape
        HK, N = k1.shape[2], probs.shape[-1]
        xs, strides = zip(*(read_in_place(t) for t in (q1, k1, q2, k2, v, z1, z2)), strict=True)
        biases, pf = (bias1.contiguous(), bias2.contiguous()), probs.reshape(-1).contiguous()
        vi = valid.contiguous().view(torch.int8) if valid is not None else pf  # (not read without valid)
        BT, R, dev, mode = B * T, src.shape[0], q1.device, MODES[q2_mode]
        qa, ka, va = new_outputs([(BT + R, H, D)] * 3, dev, q1.dtype)
        ga = new_output((BT + R, H, D), dev)  # fp32
        BD = block_size(D, 1)
        BR = rows_per_program(BD, ELEMENTS)
        n = (BT + R) * H
        if n:
            _pack_features[(cdiv(n, BR),)](*xs, *biases, pf, src, cu, vi, qa, ka, va, ga, n, BT, B,
                                           1.0 / normalizer, *strides, H, HK, N, D, BD, BR, mode, valid is not None,
                                           num_warps=4)
        if grad:
            ctx.save_for_backward(*xs, *biases, pf, inv, vi)
        ctx.has_valid = valid is not None
        ctx.meta = (B, T, H, HK, N, D, mode, 1.0 / normalizer, strides, probs.shape, probs.dtype)
        return qa, ka, va, ga

    @staticmethod
    def backward(ctx, dqa, dka, dva, dga):
        q1, k1, q2, k2, v, z1, z2, bias1, bias2, pf, inv, vi = ctx.saved_tensors
        B, T, H, HK, N, D, mode, inv_norm, strides, probs_shape, probs_dtype = ctx.meta
        BT = B * T
        dqa, dka, dva, dga = (x.contiguous() for x in (dqa, dka, dva, dga))
        dp = new_output((BT * N,), q1.device)
        BD = block_size(D)
        BH = rows_per_program(BD, 2048, block_size(H, 1))
        G = group_sums(H, HK, BH)
        outs = feature_grad_outputs(q1, HK, mode, G > 1)
        if BT:
            _pack_features_bwd[(BT,)](q1, k1, q2, k2, v, z1, z2, bias1, bias2, pf, inv, vi, dqa, dka, dva, dga,
                                      *outs, dp, BT, inv_norm, *strides, H, HK, N, block_size(N, 2), D, BH, BD,
                                      mode, ctx.has_valid, G, num_warps=4)
        return (*feature_grads(outs, HK, mode, (z1, z2), (bias1, bias2), ctx.needs_input_grad[7:9]),
                dp.view(probs_shape).to(probs_dtype),
                None, None, None, None, None, None, None)


class RecomputedRows(torch.autograd.Function):
    """`PackFeatures` then the chunked GLA on the merged rows (`ChunkLinearAttention`, per-key decays, o_all
    fp32 and the segments' final states), with gradients, keeping only what `PackFeatures` keeps (the
    projections it reads, in place) and the initial states: the merged rows (q, k, v in the inputs' dtype
    and the fp32 log decays, (1 + K) rows a token) are written again by the backward, one `_pack_features`
    launch, and the state walk it runs anyway writes their in-chunk cumulative decays again. The same
    values and gradients as the two Functions applied one after the other."""

    @staticmethod
    def forward(ctx, q1, k1, q2, k2, v, z1, z2, bias1, bias2, probs, src, cu, inv, valid, normalizer, q2_mode,
                h0, chunk_size, prec):
        qa, ka, va, ga = PackFeatures.forward(_RecordlessCtx(), q1, k1, q2, k2, v, z1, z2, bias1, bias2, probs, src,
                                              cu, inv, valid, normalizer, q2_mode, False)
        ch = varlen_chunks(cu, qa.shape[0], chunk_size)
        o_all, ht = ChunkLinearAttention.forward(_RecordlessCtx(), qa, ka, va, ga, h0, ch, prec, torch.float32,
                                                 True, 1.0)
        ctx.save_for_backward(q1, k1, q2, k2, v, z1, z2, bias1, bias2, probs, src, cu, inv, valid, h0)
        ctx.rest = (normalizer, q2_mode, ch, prec)
        ctx.set_materialize_grads(False)
        return o_all, ht

    @staticmethod
    def backward(ctx, do_all, dht):
        *inputs, h0 = ctx.saved_tensors
        normalizer, q2_mode, ch, prec = ctx.rest
        pack = KeepingCtx(needs_input_grad=(*ctx.needs_input_grad[:16], False))
        qa, ka, va, ga = PackFeatures.forward(pack, *inputs, normalizer, q2_mode, True)
        gla = KeepingCtx(saved_tensors=(qa, ka, va, None, h0), g=ga, ch=ch, prec=prec, decay=2, gs=1.0,
                         needs_input_grad=(True, True, True, True, ctx.needs_input_grad[16]))
        dqa, dka, dva, dga, dh0 = ChunkLinearAttention.backward(gla, do_all, dht)[:5]
        del qa, ka, va, ga, gla
        grads = PackFeatures.backward(pack, dqa, dka, dva, dga)
        return (*grads[:16], dh0, None, None)


@jit
def _merged_rows(SRC, CU, PROBS, n, BT, B, H: tl.constexpr, N: tl.constexpr, BR: tl.constexpr):
    """This program's BR (row, head) pairs m = r * H + h of the merged rows: (m, m < n, the head, whether
    the row is a shared one (r < BT), whether it is a selected partition row, its router probability p (0
    but there; fp32), the token it reads (int64))."""
    m_idx = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = m_idx < n
    r = m_idx // H
    hd = m_idx % H
    shared = r < BT
    part = m_r & ~shared
    j = tl.maximum(r - BT, 0)
    code = tl.load(SRC + j, mask=part, other=0)  # (b * T + t) * N + i
    valid = part & (j + BT < tl.load(CU + B + B * N))
    p = tl.where(valid, tl.load(PROBS + code, mask=part, other=0.0).to(tl.float32), 0.0)
    return m_idx, m_r, hd, shared, valid, p, tl.where(shared, r, code // N).to(tl.int64)


@jit
def _pack_rows(Q1, K1, V, G1, Q2, K2, G2, PROBS, SRC, CU, QA, KA, VA, GA, n, BT, B, H: tl.constexpr,
               N: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               BR: tl.constexpr):
    """(row, head) pairs m = r * H + h of the merged rows: r < BT the shared branch's (q1, k1, v, g1) of
    token r; past it partition row j = r - BT: (p q2, p k2 (rounded once), v, g2) of its token, p its
    router probability, and q = k = g = 0 past the selected rows (the trailing segment)."""
    m_idx, m_r, hd, shared, valid, p, tok = _merged_rows(SRC, CU, PROBS, n, BT, B, H, N, BR)
    src = tok * H + hd  # the token's row of the [tokens, H, D] inputs
    dst = m_idx.to(tl.int64)
    ok = tl.arange(0, BK)
    mk = m_r[:, None] & (ok < DK)[None, :]
    ms, mp = mk & shared[:, None], mk & ~shared[:, None]
    off_s, off_d = src[:, None] * DK + ok[None, :], dst[:, None] * DK + ok[None, :]
    b = tl.load(Q1 + off_s, mask=ms, other=0.0).to(tl.float32) + \
        tl.load(Q2 + off_s, mask=mp, other=0.0).to(tl.float32) * p[:, None]
    tl.store(QA + off_d, b.to(QA.dtype.element_ty), mask=mk)
    b = tl.load(K1 + off_s, mask=ms, other=0.0).to(tl.float32) + \
        tl.load(K2 + off_s, mask=mp, other=0.0).to(tl.float32) * p[:, None]
    tl.store(KA + off_d, b.to(KA.dtype.element_ty), mask=mk)
    b = tl.load(G1 + off_s, mask=ms, other=0.0).to(tl.float32) + \
        tl.where(valid[:, None], tl.load(G2 + off_s, mask=mp, other=0.0).to(tl.float32), 0.0)
    tl.store(GA + off_d, b, mask=mk)
    ov = tl.arange(0, BV)
    mv = m_r[:, None] & (ov < DV)[None, :]
    b = tl.load(V + src[:, None] * DV + ov[None, :], mask=mv, other=0.0)
    tl.store(VA + dst[:, None] * DV + ov[None, :], b, mask=mv)


@jit
def _pack_features(Q1, K1, Q2, K2, V, Z1, Z2, B1, B2, PROBS, SRC, CU, VALID, QA, KA, VA, GA, n, BT, B, inv_norm,
                   S_Q1, S_K1, S_Q2, S_K2, S_V, S_Z1, S_Z2, H: tl.constexpr, HK: tl.constexpr, N: tl.constexpr,
                   D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, MODE: tl.constexpr, HAS_VALID: tl.constexpr):
    """`sse_features_fwd` and `_pack_rows` in one: the merged rows' (row, head) pairs m = r * H + h as
    `_pack_rows` takes them, each computing its token's feature maps from the projections (read as
    `sse_features_fwd` reads them: tokens S_* elements apart, K1 and V at HK heads, MODE its `_second`)
    and rounding them where the two kernels round: a feature to q1's dtype, then p q2 / p k2 in fp32 rounded
    once, the decays in fp32. With HAS_VALID the features of a token VALID marks 0 (padding) are 0, as the
    model zeroes them before the two kernels."""
    m_idx, m_r, hd, shared, valid, p, tok = _merged_rows(SRC, CU, PROBS, n, BT, B, H, N, BR)
    p, tok = p[:, None], tok[:, None]
    cols = tl.arange(0, BD)
    m_d = cols < D
    mk = m_r[:, None] & m_d[None, :]
    real = mk
    if HAS_VALID:
        real = mk & (tl.load(VALID + tok, mask=mk, other=0) != 0)
    ms, mp = real & shared[:, None], mk & ~shared[:, None]
    col = hd[:, None] * D + cols[None, :]  # the head's columns of a token's [H, D] row (and of the biases)
    col_kv = (hd // (H // HK))[:, None] * D + cols[None, :]
    dst = m_idx.to(tl.int64)[:, None] * D + cols[None, :]
    dt = QA.dtype.element_ty
    x1 = _ld(Q1, tok * S_Q1 + col, mk)
    x2 = _second_at(x1, Q2, tok * S_Q2 + col, mp, MODE)
    f1 = (x1 * tl.sigmoid(x1)).to(dt).to(tl.float32)
    f2 = (x2 * tl.sigmoid(x2)).to(dt).to(tl.float32)
    tl.store(QA + dst, (tl.where(ms, f1, 0.0) + tl.where(mp, f2, 0.0) * p).to(dt), mask=mk)
    x1 = _ld(K1, tok * S_K1 + col_kv, mk)
    x2 = _second_at(x1, K2, tok * S_K2 + col, mp, MODE)
    f1 = _softmax(x1, m_d).to(dt).to(tl.float32)
    f2 = _softmax(x2, m_d).to(dt).to(tl.float32)
    tl.store(KA + dst, (tl.where(ms, f1, 0.0) + tl.where(mp, f2, 0.0) * p).to(dt), mask=mk)
    x1 = _ld(V, tok * S_V + col_kv, mk)
    tl.store(VA + dst, tl.where(real, (x1 * tl.sigmoid(x1)).to(dt), 0.0).to(VA.dtype.element_ty), mask=mk)
    g = tl.where(ms, logsigmoid(_ld(Z1, tok * S_Z1 + col, ms) + _ld(B1, col, ms)) * inv_norm, 0.0)
    z = _ld(Z2, tok * S_Z2 + col, mp) + _ld(B2, col, mp)
    tl.store(GA + dst, g + tl.where(mp & valid[:, None], logsigmoid(z) * inv_norm, 0.0), mask=mk)


@jit
def _pack_rows_bwd(Q2, K2, PROBS, INV, DQA, DKA, DVA, DGA, DV_, DQ2, DK2, DG2, DP, BT, H: tl.constexpr,
                   N: tl.constexpr, BN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BH: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr):
    """One program per token: the gradients of its inputs from the merged rows' gradients (dq1, dk1,
    dg1 are the shared rows' own, views taken outside): dv = its shared row's + its partition rows',
    dq2 / dk2 = sum_i p_i d(row_i), dg2 = sum_i dg(row_i), dp_i = <dq(row_i), q2> + <dk(row_i), k2>
    over heads and dims (0 where not selected); the rows are found through inv."""
    tok = tl.program_id(0).to(tl.int64)
    on = tl.arange(0, BN)
    dp = tl.zeros([BN], dtype=tl.float32)
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BV)
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        mh = hh < H
        mk = mh[:, None] & (ok < DK)[None, :]
        mv = mh[:, None] & (ov < DV)[None, :]
        off_k = (tok * H + hh)[:, None] * DK + ok[None, :]
        off_v = (tok * H + hh)[:, None] * DV + ov[None, :]
        b_q2 = tl.load(Q2 + off_k, mask=mk, other=0.0).to(tl.float32)
        b_k2 = tl.load(K2 + off_k, mask=mk, other=0.0).to(tl.float32)
        b_dv = tl.load(DVA + off_v, mask=mv, other=0.0).to(tl.float32)
        b_dq = tl.zeros([BH, BK], dtype=tl.float32)
        b_dk = tl.zeros([BH, BK], dtype=tl.float32)
        b_dg = tl.zeros([BH, BK], dtype=tl.float32)
        for i in tl.static_range(N):
            row = tl.load(INV + tok * N + i + tl.zeros([BH], dtype=tl.int64))  # the same row for every head
            on_i = (row >= 0)[:, None]
            p = tl.where(row >= 0, tl.load(PROBS + tok * N + i + tl.zeros([BH], dtype=tl.int64)), 0.0)
            p = p.to(tl.float32)[:, None]
            base = (BT + tl.maximum(row, 0)) * H + hh
            off_rk = base[:, None] * DK + ok[None, :]
            a = tl.load(DQA + off_rk, mask=mk & on_i, other=0.0).to(tl.float32)
            c = tl.load(DKA + off_rk, mask=mk & on_i, other=0.0).to(tl.float32)
            b_dq += p * a
            b_dk += p * c
            b_dg += tl.load(DGA + off_rk, mask=mk & on_i, other=0.0).to(tl.float32)
            b_dv += tl.load(DVA + base[:, None] * DV + ov[None, :], mask=mv & on_i, other=0.0).to(tl.float32)
            dp += tl.where(on == i, tl.sum(tl.sum(a * b_q2 + c * b_k2, 1), 0), 0.0)
        tl.store(DQ2 + off_k, b_dq.to(DQ2.dtype.element_ty), mask=mk)
        tl.store(DK2 + off_k, b_dk.to(DK2.dtype.element_ty), mask=mk)
        tl.store(DG2 + off_k, b_dg.to(DG2.dtype.element_ty), mask=mk)
        tl.store(DV_ + off_v, b_dv.to(DV_.dtype.element_ty), mask=mv)
    tl.store(DP + tok * N + on, dp, mask=on < N)


@jit
def _pack_features_bwd(Q1, K1, Q2, K2, V, Z1, Z2, B1, B2, PROBS, INV, VALID, DQA, DKA, DVA, DGA,
                       DQ1, DK1, DQ2, DK2, DV, DZ1, DZ2, DP, BT, inv_norm, S_Q1, S_K1, S_Q2, S_K2, S_V, S_Z1, S_Z2,
                       H: tl.constexpr, HK: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                       BH: tl.constexpr, BD: tl.constexpr, MODE: tl.constexpr, HAS_VALID: tl.constexpr,
                       G: tl.constexpr):
    """`_pack_rows_bwd` and `sse_features_bwd` in one, one program per token: the merged rows' gradients
    gathered as `_pack_rows_bwd` gathers them (through INV) and rounded where its outputs are, the feature
    maps recomputed from the projections, then the projections' gradients as `sse_features_bwd` gives them
    (DK1 and DV per query head, or with G > 1 per KV head as `sse_features_bwd` sums them; DQ2 / DK2 for
    MODE 1 and 2), the decays' pre-activation gradients (fp32) and the router probabilities' (fp32). With
    HAS_VALID a padding token's gradients are 0 (its features were)."""
    tok = tl.program_id(0).to(tl.int64)
    keep = 1.0
    if HAS_VALID:
        keep = (tl.load(VALID + tok) != 0).to(tl.float32)
    on = tl.arange(0, BN)
    dp = tl.zeros([BN], dtype=tl.float32)
    cols = tl.arange(0, BD)
    m_d = cols < D
    dt = DQ1.dtype.element_ty
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        mh = hh < H
        mk = mh[:, None] & m_d[None, :]
        col = hh[:, None] * D + cols[None, :]
        col_kv = (hh // (H // HK))[:, None] * D + cols[None, :]
        own = (tok * H + hh)[:, None] * D + cols[None, :]  # the token's shared row; its outputs' offsets
        x1 = _ld(Q1, tok * S_Q1 + col, mk)
        x2 = _second_at(x1, Q2, tok * S_Q2 + col, mk, MODE)
        y1 = _ld(K1, tok * S_K1 + col_kv, mk)
        y2 = _second_at(y1, K2, tok * S_K2 + col, mk, MODE)
        f_q2 = (x2 * tl.sigmoid(x2)).to(dt).to(tl.float32)
        f_k2 = _softmax(y2, m_d).to(dt).to(tl.float32)
        b_dv = _ld(DVA, own, mk)
        b_dq = tl.zeros([BH, BD], dtype=tl.float32)
        b_dk = tl.zeros([BH, BD], dtype=tl.float32)
        b_dg = tl.zeros([BH, BD], dtype=tl.float32)
        for i in tl.static_range(N):
            row = tl.load(INV + tok * N + i + tl.zeros([BH], dtype=tl.int64))  # the same row for every head
            on_i = mk & (row >= 0)[:, None]
            p = tl.where(row >= 0, tl.load(PROBS + tok * N + i + tl.zeros([BH], dtype=tl.int64)), 0.0)
            p = p.to(tl.float32)[:, None]
            off = ((BT + tl.maximum(row, 0)) * H + hh)[:, None] * D + cols[None, :]
            a = _ld(DQA, off, on_i)
            c = _ld(DKA, off, on_i)
            b_dq += p * a
            b_dk += p * c
            b_dg += _ld(DGA, off, on_i)
            b_dv += _ld(DVA, off, on_i)
            dp += tl.where(on == i, tl.sum(tl.sum(a * f_q2 + c * f_k2, 1), 0), 0.0)
        # the merged rows' gradients as PackRows hands them on (its outputs' dtypes), then the features'
        dq = _silu_grad(x2, b_dq.to(dt).to(tl.float32))
        if MODE != 0:
            tl.store(DQ2 + own, (dq * keep).to(dt), mask=mk)
        if MODE != 2:
            dq += _silu_grad(x1, _ld(DQA, own, mk).to(dt).to(tl.float32))
        else:
            dq = _silu_grad(x1, _ld(DQA, own, mk).to(dt).to(tl.float32))
        tl.store(DQ1 + own, (dq * keep).to(dt), mask=mk)
        dk = _softmax_grad(y2, b_dk.to(dt).to(tl.float32), m_d)
        if MODE != 0:
            tl.store(DK2 + own, (dk * keep).to(dt), mask=mk)
        if MODE != 2:
            dk += _softmax_grad(y1, _ld(DKA, own, mk).to(dt).to(tl.float32), m_d)
        else:
            dk = _softmax_grad(y1, _ld(DKA, own, mk).to(dt).to(tl.float32), m_d)
        dk = dk * keep
        dv = _silu_grad(_ld(V, tok * S_V + col_kv, mk), b_dv.to(dt).to(tl.float32)) * keep
        if G > 1:  # heads h0 + r * G .. h0 + r * G + G - 1 are KV head h0 / G + r's
            kv = h0 // G + tl.arange(0, BH // G)
            off_kv = (tok * HK + kv)[:, None] * D + cols[None, :]
            m_kv = (kv < HK)[:, None] & m_d[None, :]
            tl.store(DK1 + off_kv, tl.sum(tl.reshape(dk, [BH // G, G, BD]), 1).to(DK1.dtype.element_ty), mask=m_kv)
            tl.store(DV + off_kv, tl.sum(tl.reshape(dv, [BH // G, G, BD]), 1).to(DV.dtype.element_ty), mask=m_kv)
        else:
            tl.store(DK1 + own, dk.to(DK1.dtype.element_ty), mask=mk)
            tl.store(DV + own, dv.to(DV.dtype.element_ty), mask=mk)
        z = _ld(Z1, tok * S_Z1 + col, mk) + _ld(B1, col, mk)
        tl.store(DZ1 + own, _ld(DGA, own, mk) * inv_norm * tl.sigmoid(-z) * keep, mask=mk)
        z = _ld(Z2, tok * S_Z2 + col, mk) + _ld(B2, col, mk)
        tl.store(DZ2 + own, b_dg * inv_norm * tl.sigmoid(-z) * keep, mask=mk)
    tl.store(DP + tok * N + on, dp, mask=on < N)


def _rows(x: Tensor) -> Tensor:
    """[B, T, H, D] -> [B * T, H, D] contiguous."""
    return x.reshape(-1, *x.shape[2:]).contiguous()


class PackRows(torch.autograd.Function):
    """The merged rows of one chunked GLA call [B T + R, H, D]: the shared branch's (q1, k1, v, g1) of
    every token, then the partition rows (p q2, p k2, v, g2) of the tokens `src` names (`group_rows`),
    p = the router probability of the (token, partition); q and k in q1's dtype (p q2, p k2 computed in
    fp32 and rounded once), v in v's, g fp32; zero (but v) past the selected rows. One kernel forward
    and one backward (a program per token gathering its rows through `inv`). q1, k1, q2, k2, v
    [B, T, H, D], g1 / g2 [B, T, H, Dk], probs [B, T, N], src [R], cu and inv as `group_rows` gives."""

    @staticmethod
    def forward(ctx, q1, k1, v, g1, q2, k2, g2, probs, src, cu, inv):
        B, T, H, Dk = q1.shape
        N, Dv, R, BT = probs.shape[-1], v.shape[-1], src.shape[0], B * T
        xs = [_rows(x) for x in (q1, k1, v, g1, q2, k2, g2)]
        pf = probs.reshape(-1).contiguous()
        dev = q1.device
        qa, ka = (new_output((BT + R, H, Dk), dev, q1.dtype) for _ in range(2))
        va = new_output((BT + R, H, Dv), dev, v.dtype)
        ga = new_output((BT + R, H, Dk), dev)  # fp32
        BK, BV = block_size(Dk), block_size(Dv)
        BR = rows_per_program(max(BK, BV), 2048)
        n = (BT + R) * H
        if n:
            _pack_rows[(cdiv(n, BR),)](*xs, pf, src, cu, qa, ka, va, ga, n, BT, B, H, N, Dk, Dv, BK, BV, BR,
                                              num_warps=4)
        ctx.save_for_backward(xs[4], xs[5], pf, inv)
        ctx.meta = (B, T, N, [x.dtype for x in (q1, k1, v, g1, q2, k2, g2, probs)], probs.shape)
        return qa, ka, va, ga

    @staticmethod
    def backward(ctx, dqa, dka, dva, dga):
        q2, k2, pf, inv = ctx.saved_tensors
        B, T, N, dts, probs_shape = ctx.meta
        BT, H, Dk, Dv = B * T, q2.shape[1], q2.shape[2], dva.shape[-1]
        dev = q2.device
        dqa, dka, dva, dga = (x.contiguous() for x in (dqa, dka, dva, dga))
        dv = new_output((BT, H, Dv), dev, dts[2])
        dq2, dk2 = new_output((BT, H, Dk), dev, dts[4]), new_output((BT, H, Dk), dev, dts[5])
        dg2 = new_output((BT, H, Dk), dev, dts[6])
        dp = new_output((BT * N,), dev)
        BK, BV = block_size(Dk), block_size(Dv)
        BH = rows_per_program(max(BK, BV), 2048, block_size(H, 1))
        if BT:
            _pack_rows_bwd[(BT,)](q2, k2, pf, inv, dqa, dka, dva, dga, dv, dq2, dk2, dg2, dp, BT, H, N,
                                  block_size(N, 2), Dk, Dv, BH, BK, BV, num_warps=4)
        shape = (B, T, H)
        return (dqa[:BT].view(*shape, Dk).to(dts[0]), dka[:BT].view(*shape, Dk).to(dts[1]), dv.view(*shape, Dv),
                dga[:BT].view(*shape, Dk).to(dts[3]), dq2.view(*shape, Dk), dk2.view(*shape, Dk),
                dg2.view(*shape, Dk), dp.view(probs_shape).to(dts[7]), None, None, None)


@jit
def _combine_rows(OA, INV, OUT, W, GATE, eps, n, BT, H: tl.constexpr, N: tl.constexpr, DV: tl.constexpr,
                  BV: tl.constexpr, BR: tl.constexpr, GATED: tl.constexpr, WH: tl.constexpr):
    """(token, head) pairs m = tok * H + h: o = the shared row's output + its partition rows' (fp32),
    in OUT's dtype; with GATED, then RMSNorm_W(o) * SiLU(GATE) of it (`norm_gate`'s values; W [WH, DV],
    GATE [n, DV])."""
    m_idx = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = m_idx < n
    tok = (m_idx // H).to(tl.int64)
    hd = m_idx % H
    ov = tl.arange(0, BV)
    mv = m_r[:, None] & (ov < DV)[None, :]
    b = tl.load(OA + m_idx.to(tl.int64)[:, None] * DV + ov[None, :], mask=mv, other=0.0).to(tl.float32)
    for i in tl.static_range(N):
        row = tl.load(INV + tok * N + i, mask=m_r, other=-1)
        base = (BT + tl.maximum(row, 0)) * H + hd
        b += tl.load(OA + base[:, None] * DV + ov[None, :], mask=mv & (row >= 0)[:, None], other=0.0).to(tl.float32)
    out = m_idx.to(tl.int64)[:, None] * DV + ov[None, :]
    if GATED:  # the combined output rounded as CombineRows writes it, then the norm and gate
        x = b.to(OUT.dtype.element_ty).to(tl.float32)
        g = tl.load(GATE + out, mask=mv, other=0.0).to(tl.float32)
        w = tl.load(W + (hd % WH)[:, None] * DV + ov[None, :], mask=mv, other=0.0).to(tl.float32)
        tl.store(OUT + out, norm_gate_rows(x, g, w, rms_inverse(x, eps, DV), OUT.dtype.element_ty), mask=mv)
    else:
        tl.store(OUT + out, b.to(OUT.dtype.element_ty), mask=mv)


@jit
def _combine_rows_bwd(DO, SRC, CU, DOA, n, BT, B, H: tl.constexpr, N: tl.constexpr, DV: tl.constexpr,
                      BV: tl.constexpr, BR: tl.constexpr):
    """(row, head) pairs of the merged rows: the shared row's gradient is its token's, a partition
    row's its token's too, 0 past the selected rows."""
    m_idx = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = m_idx < n
    r = m_idx // H
    hd = m_idx % H
    shared = r < BT
    j = tl.maximum(r - BT, 0)
    part = m_r & ~shared
    code = tl.load(SRC + j, mask=part, other=0)
    valid = part & (j + BT < tl.load(CU + B + B * N))
    tok = tl.where(shared, r, code // N).to(tl.int64)
    ov = tl.arange(0, BV)
    mv = m_r[:, None] & (ov < DV)[None, :]
    b = tl.load(DO + (tok * H + hd)[:, None] * DV + ov[None, :], mask=mv & (shared | valid)[:, None], other=0.0)
    tl.store(DOA + m_idx.to(tl.int64)[:, None] * DV + ov[None, :], b.to(DOA.dtype.element_ty), mask=mv)


def combine_rows_gated(o_all: Tensor, inv: Tensor, BT: int, dtype: torch.dtype, weight: Tensor | None = None,
                       gate: Tensor | None = None, eps: float = 0.0) -> Tensor:
    """`CombineRows`' o (without gradients; the forward's kernel), followed, where `weight` is given, by
    `norm_gate(o, weight, gate, eps)` in the same kernel: o_all [B T + R, H, V] fp32, gate [B T, H, V]
    contiguous in `dtype`, weight [V] or [H, V]. The values of the two ops (o rounded to `dtype` before the
    norm), one launch and no o written in between."""
    _, H, Dv = o_all.shape
    N = inv.numel() // max(BT, 1)
    o = new_output((BT, H, Dv), o_all.device, dtype)
    BV = block_size(Dv)
    BR = rows_per_program(BV, 2048)
    gated = weight is not None
    if BT:  # not gated: the weight and gate pointers are stand-ins (never read)
        _combine_rows[(cdiv(BT * H, BR),)](o_all, inv, o, weight if gated else o, gate if gated else o, eps, BT * H,
                                           BT, H, N, Dv, BV, BR, gated,
                                           weight.shape[0] if gated and weight.dim() == 2 else 1, num_warps=4)
    return o


class CombineRows(torch.autograd.Function):
    """o [B T, H, V] in `dtype` = each token's shared row of the merged output o_all [B T + R, H, V]
    (fp32) plus its partition rows (found through `inv`), summed in fp32. One kernel each way."""

    @staticmethod
    def forward(ctx, o_all, src, cu, inv, BT, dtype):
        o = combine_rows_gated(o_all, inv, BT, dtype)
        M, N = o_all.shape[0], inv.numel() // max(BT, 1)
        ctx.save_for_backward(src, cu)
        ctx.meta = (M, N, BT, o_all.dtype)
        return o

    @staticmethod
    def backward(ctx, do):
        src, cu = ctx.saved_tensors
        M, N, BT, dt = ctx.meta
        _, H, Dv = do.shape
        doa = new_output((M, H, Dv), do.device, dt)
        BV = block_size(Dv)
        BR = rows_per_program(BV, 2048)
        B = (cu.numel() - 2) // (N + 1)  # cu has B + B N + 2 entries
        _combine_rows_bwd[(cdiv(M * H, BR),)](do.contiguous(), src, cu, doa, M * H, BT, B, H, N, Dv, BV, BR,
                                                      num_warps=4)
        return doa, None, None, None, None, None


# ---------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------


@jit
def _decode(
    q1, k1, q2, k2, v, g1, g2, probs, sel, s_in, s_out, parts, o,
    H: tl.constexpr, N: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    b_v = tl.load(v + i_bh * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_q1 = tl.load(q1 + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k1 = tl.load(k1 + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_g1 = tl.load(g1 + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_s = tl.load(s_in + i_bh * K * V + off_kv, mask=m_kv, other=0.0)
    b_s = tl.exp(b_g1)[:, None] * b_s + b_k1[:, None] * b_v[None, :]
    tl.store(s_out + i_bh * K * V + off_kv, b_s, mask=m_kv)
    b_o = tl.sum(b_q1[:, None] * b_s, 0)
    b_q2 = tl.load(q2 + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k2 = tl.load(k2 + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_e2 = tl.exp(tl.load(g2 + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32))
    for n in range(0, N):
        if tl.load(sel + i_b * N + n) != 0:
            p = tl.load(probs + i_b * N + n)
            base = parts + ((i_b * N + n) * H + i_h) * K * V
            b_p = tl.load(base + off_kv, mask=m_kv, other=0.0)
            b_p = b_e2[:, None] * b_p + (p * b_k2)[:, None] * b_v[None, :]
            tl.store(base + off_kv, b_p, mask=m_kv)
            b_o += p * tl.sum(b_q2[:, None] * b_p, 0)
    tl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


def sse_decode_triton(q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, g1: Tensor, g2: Tensor,
                      probs: Tensor, sel: Tensor, state: SSEState | None = None, *,
                      inplace: bool = False) -> tuple[Tensor, SSEState]:
    """One SSE step (T = 1, GLA base, no autograd) on one Triton kernel: same values as
    `sse_recurrent`. Only the selected partitions' states are read and written; with
    inplace=True (state fp32 and contiguous) into `state`'s tensors, else into new tensors (the
    unselected partitions are copied as they are)."""
    B, T, H, Dk = q1.shape
    if T != 1:
        raise ValueError(f"sse_decode_triton takes one token; got T = {T}")
    N, Dv = probs.shape[-1], v.shape[-1]
    if state is None:
        state = SSEState.zeros(B, N, H, Dk, Dv, device=q1.device)
    if inplace and not (state.shared.dtype == state.parts.dtype == torch.float32
                        and state.shared.is_contiguous() and state.parts.is_contiguous()):
        raise ValueError("inplace=True needs fp32 contiguous state tensors")
    c = lambda x: x.reshape(B, H, x.shape[-1]).contiguous()  # noqa: E731
    s_in = state.shared.float().contiguous()
    if inplace:
        s_out, parts = state.shared, state.parts
    else:
        s_out = new_output(s_in.shape, q1.device)
        parts = state.parts.float().clone(memory_format=torch.contiguous_format)
    o = new_output((B, H, Dv), q1.device, q1.dtype)
    BK = max(16, next_power_of_2(Dk))
    BV = min(64, max(16, next_power_of_2(Dv)))
    with torch.no_grad():
        _decode[(cdiv(Dv, BV), B * H)](
            c(q1), c(k1), c(q2), c(k2), c(v), c(g1).float(), c(g2).float(),
            probs.reshape(B, N).float().contiguous(), sel.reshape(B, N).to(torch.int8).contiguous(),
            s_in, s_out, parts, o, H, N, Dk, Dv, BK, BV, num_warps=4)
    if inplace:
        return o.view(B, 1, H, Dv), state
    return o.view(B, 1, H, Dv), SSEState(s_out, parts)
