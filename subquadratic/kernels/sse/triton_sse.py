"""SSE on the Triton kernels: the sorted variable-length form (training / prefill) and the decode step.

`sse_triton` has `sse_varlen`'s contract and values (see `varlen.py`) and no host synchronisation:

1. Grouping by (sample, partition) in time order with fixed shapes. Each token takes `topk` rows
   (default N: always enough; pass the router's K to cut the work to (1 + K) T). Segment b * N + i
   holds row b's tokens routed to partition i; its length is sum_t sel[b, t, i], so
   cu_seqlens = [0, cumsum] is computed on the device, and the row of (b, t, i) is
   cu[b * N + i] + (number of earlier selected tokens of that segment), an exclusive cumulative sum
   of `sel` along time. Rows left over (tokens with fewer than `topk` selections, i.e. padding) form
   one trailing "trash" segment with zero key, query and decay: it reads and writes nothing.
2. Two calls of the chunked GLA op (`gla.triton_chunk`): the shared branch, a plain GLA over each row
   on (q1, k1, v, g1) read where they are (`chunk_linear_attention`, dense), and, through
   `gla_varlen_triton`, the B * N partition segments on
   the gathered (p q2, p k2, v, g2) plus the trash segment; initial states are the SSE states,
   final states come back as the new ones (a partition with no token keeps its state exactly).
3. The partition outputs are scattered back onto the shared output with index_add (fp32).

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

from ..gla.triton_chunk import chunk_linear_attention, gla_varlen_triton
from ..triton_utils import block_size
from ..utils import import_triton, new_output
from .recurrent import SSEState, setup

triton, tl = import_triton()


def group_rows_reference(sel: Tensor, topk: int):
    """sel [B, T, N] bool -> (src [R] token and partition of each row as (b * T + t) * N + i, valid [R]
    bool, cu [B * N + 2]: the partition segments' bounds, then R) with R = B * T * topk, rows sorted
    by (b, partition, t).

    In (b, partition, t) order, the row of a selected token is the number of selected entries before
    it: one exclusive cumulative sum over the flattened selection (a scan along the last dim of a
    contiguous tensor; along T of [B, T, N] PyTorch's CUDA scan ran 5 ms at T = 32k). About fifteen
    launches: `group_rows`'s oracle."""
    B, T, N = sel.shape
    R = B * T * topk
    dev = sel.device
    picked = sel.transpose(1, 2).reshape(-1)                                      # [B * N * T] bool
    s = picked.to(torch.int64)
    dest = s.cumsum(0) - s                                                        # rows before
    cu = torch.cat([s.new_zeros(1), s.view(B * N, T).sum(-1).cumsum(0), s.new_full((1,), R)])  # [B * N + 2]
    dest = torch.where(picked, dest.clamp(max=R), R)                              # R: dropped
    code = torch.arange(B * T * N, device=dev).view(B, T, N).transpose(1, 2)      # (b * T + t) * N + i
    src = torch.zeros(R + 1, dtype=torch.int64, device=dev).scatter_(0, dest, code.reshape(-1))[:R]
    valid = torch.arange(R, device=dev) < cu[-2]
    return src, valid, cu


#: Selection entries `group_rows_kernel` scans at a time.
GROUP_BLOCK = 8192


@triton.jit
def group_rows_kernel(SEL, SRC, CU, VALID, T, N, NE, R, BLOCK: tl.constexpr):
    """`group_rows_reference` in one program: the selection's NE = B N T entries in (b, partition, t)
    order, BLOCK at a time, an inclusive scan of each block plus the count so far gives each selected
    entry its row (src = its code (b T + t) N + i) and, at t = T - 1, the end of its segment (cu);
    then the rows past the selected ones get src 0 and valid False."""
    carry = tl.zeros([], dtype=tl.int64)
    for e0 in range(0, NE, BLOCK):
        e = e0 + tl.arange(0, BLOCK).to(tl.int64)
        m = e < NE
        seg = e // T
        t = e - seg * T
        code = ((seg // N) * T + t) * N + seg % N
        s = tl.load(SEL + code, mask=m, other=0).to(tl.int64)
        incl = tl.cumsum(s, 0) + carry
        tl.store(SRC + incl - 1, code, mask=m & (s != 0) & (incl <= R))  # past R: more than topk (dropped)
        tl.store(CU + 1 + seg, incl, mask=m & (t == T - 1))
        carry += tl.sum(s, 0)
    first = tl.arange(0, 2)
    tl.store(CU + tl.where(first == 0, 0, NE // T + 1), tl.where(first == 0, 0, R))
    for r0 in range(0, R, BLOCK):
        r = r0 + tl.arange(0, BLOCK).to(tl.int64)
        tl.store(SRC + r, tl.zeros([BLOCK], dtype=tl.int64), mask=(r >= carry) & (r < R))
        tl.store(VALID + r, (r < carry).to(tl.int8), mask=r < R)


def group_rows(sel: Tensor, topk: int):
    """`group_rows_reference`'s (src, valid, cu) in one launch (`group_rows_kernel`); the PyTorch ops
    for an empty selection (T = 0)."""
    B, T, N = sel.shape
    if T == 0 or B == 0:
        return group_rows_reference(sel, topk)
    R = B * T * topk
    dev = sel.device
    src = new_output((R,), dev, torch.int64)
    cu = new_output((B * N + 2,), dev, torch.int64)
    valid = new_output((R,), dev, torch.int8)
    group_rows_kernel[(1,)](sel.contiguous().view(torch.uint8), src, cu, valid, T, N, B * N * T, R, GROUP_BLOCK,
                            num_warps=16)
    return src, valid.view(torch.bool), cu


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
    B, T, H, Dk = q1.shape
    N, Dv = probs.shape[-1], v.shape[-1]
    tensors = (q1, k1, q2, k2, v, g1, g2, probs) + (() if state is None else (state.shared, state.parts))
    if T == 1 and not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors)):
        if state is None:
            state = SSEState.zeros(B, N, H, Dk, Dv, device=q1.device)
        inplace = inplace and all(x.dtype == torch.float32 and x.is_contiguous() for x in (state.shared, state.parts))
        return sse_decode_triton(q1, k1, q2, k2, v, g1, g2, probs, sel, state, inplace=inplace)
    K = N if topk is None else topk
    if not 1 <= K <= N:
        raise ValueError(f"topk must be in [1, N={N}]; got {topk}")
    dt = q1.dtype
    BT = B * T
    src, valid, cu = group_rows(sel, K)
    src_tok = src // N  # [R] the token (b * T + t) of each row
    # the partition rows (p q2, p k2, v, g2) in one gather kernel (backward: index_add, no host synchronisation)
    qp, kp, vp, gp = PartitionRows.apply(q2, k2, v, g2, probs, src, valid, cu)
    # the shared branch: a plain GLA over each row, on the inputs as they are (no copy, no chunk table),
    # then the partition rows
    o, h_shared = chunk_linear_attention(q1, k1, v, g1, initial_state=None if state is None else state.shared,
                                         chunk_size=chunk_size, out_dtype=torch.float32, precision=precision)
    o = o.reshape(BT, H, Dv)
    h0 = None if state is None else torch.cat([state.parts.float().reshape(B * N, H, Dk, Dv),
                                               state.shared.new_zeros(1, H, Dk, Dv, dtype=torch.float32)])
    o_parts, h_parts = gla_varlen_triton(qp, kp, vp, gp, cu_seqlens=cu, initial_state=h0,
                                         chunk_size=chunk_size, out_dtype=torch.float32, precision=precision)
    o = o.index_add_(0, src_tok, o_parts)  # o is the shared branch's fresh fp32 output
    new = SSEState(h_shared, h_parts[:B * N].reshape(B, N, H, Dk, Dv))
    return o.view(B, T, H, Dv).to(dt), new


@triton.jit
def _partition_rows(Q2, K2, V, G2, PROBS, SRC, CU, QP, KP, VP, GP, n, NSEG, H: tl.constexpr, N: tl.constexpr,
                    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr):
    """(row, head) pairs m = r * H + h of the grouped rows: qp = p q2, kp = p k2 (rounded once), vp = v,
    gp = g2 (fp32) of the row's token, with p its router probability; qp = kp = gp = 0 past the valid
    rows (the trash segment)."""
    m_idx = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = m_idx < n
    r = m_idx // H
    code = tl.load(SRC + r, mask=m_r, other=0)  # (b * T + t) * N + i
    valid = m_r & (r < tl.load(CU + NSEG))
    p = tl.where(valid, tl.load(PROBS + code, mask=m_r, other=0.0).to(tl.float32), 0.0)
    src = (code // N) * H + m_idx % H  # the token's row of the [tokens, H, D] inputs
    dst = m_idx.to(tl.int64)
    ok = tl.arange(0, BK)
    mk = m_r[:, None] & (ok < DK)[None, :]
    off_s, off_d = src[:, None] * DK + ok[None, :], dst[:, None] * DK + ok[None, :]
    b = tl.load(Q2 + off_s, mask=mk, other=0.0).to(tl.float32)
    tl.store(QP + off_d, (b * p[:, None]).to(QP.dtype.element_ty), mask=mk)
    b = tl.load(K2 + off_s, mask=mk, other=0.0).to(tl.float32)
    tl.store(KP + off_d, (b * p[:, None]).to(KP.dtype.element_ty), mask=mk)
    b = tl.load(G2 + off_s, mask=mk, other=0.0)
    tl.store(GP + off_d, tl.where(valid[:, None], b.to(tl.float32), 0.0), mask=mk)
    ov = tl.arange(0, BV)
    mv = m_r[:, None] & (ov < DV)[None, :]
    b = tl.load(V + src[:, None] * DV + ov[None, :], mask=mv, other=0.0)
    tl.store(VP + dst[:, None] * DV + ov[None, :], b, mask=mv)


class PartitionRows(torch.autograd.Function):
    """The grouped rows of the partition branch: (p q2, p k2, v, g2) [R, H, D] of the tokens `src`
    names (`group_rows`), p = the router probability of the (token, partition), in q2's dtype (p q2, p k2
    computed in fp32 and rounded once) and fp32 (g2); zero (but v) past the valid rows. One kernel
    forward; the backward scatters with index_add. q2, k2, v [B, T, H, D], g2 [B, T, H, Dk],
    probs [B, T, N], src / valid [R], cu [B * N + 2]."""

    @staticmethod
    def forward(ctx, q2, k2, v, g2, probs, src, valid, cu):
        B, T, H, Dk = q2.shape
        N, Dv, R = probs.shape[-1], v.shape[-1], src.shape[0]
        xs = [x.reshape(B * T, H, x.shape[-1]).contiguous() for x in (q2, k2, v, g2)]
        pf = probs.reshape(-1).contiguous()
        qp, kp = (new_output((R, H, Dk), q2.device, q2.dtype) for _ in range(2))
        vp = new_output((R, H, Dv), v.device, v.dtype)
        gp = new_output((R, H, Dk), g2.device)  # fp32
        BK, BV = block_size(Dk), block_size(Dv)
        BR = max(1, 2048 // max(BK, BV))
        if R:
            _partition_rows[(triton.cdiv(R * H, BR),)](*xs, pf, src, cu, qp, kp, vp, gp, R * H, B * N, H, N, Dk, Dv,
                                                        BK, BV, BR, num_warps=4)
        ctx.save_for_backward(xs[0], xs[1], pf, src, valid)
        ctx.shapes = (B, T, H, N, q2.dtype, v.dtype, g2.dtype, probs.shape, probs.dtype)
        return qp, kp, vp, gp

    @staticmethod
    def backward(ctx, dqp, dkp, dvp, dgp):
        q2, k2, pf, src, valid = ctx.saved_tensors
        B, T, H, N, dt, dtv, dtg, probs_shape, probs_dtype = ctx.shapes
        tok = src // N
        p = pf.index_select(0, src).float() * valid  # [R], 0 at trash rows
        pc = p[:, None, None]

        def scatter(d, dtype):
            return torch.zeros((B * T, H, d.shape[-1]), device=d.device, dtype=dtype).index_add_(0, tok, d.to(dtype))

        grads = [None] * 8
        dp = torch.zeros_like(p)
        for i, (x, dx) in enumerate(((q2, dqp), (k2, dkp))):
            dxf = dx.float()
            if ctx.needs_input_grad[i]:
                grads[i] = scatter(dxf * pc, dt).view(B, T, H, -1)
            if ctx.needs_input_grad[4]:
                dp += (dxf * x.index_select(0, tok).float()).sum((1, 2))
        if ctx.needs_input_grad[2]:
            grads[2] = scatter(dvp, dtv).view(B, T, H, -1)
        if ctx.needs_input_grad[3]:
            grads[3] = scatter(dgp * valid[:, None, None], dtg).view(B, T, H, -1)
        if ctx.needs_input_grad[4]:
            grads[4] = torch.zeros_like(pf, dtype=torch.float32).index_add_(0, src, dp * valid).view(
                probs_shape).to(probs_dtype)
        return tuple(grads)


# ---------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------


@triton.jit
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
    BK = max(16, triton.next_power_of_2(Dk))
    BV = min(64, max(16, triton.next_power_of_2(Dv)))
    with torch.no_grad():
        _decode[(triton.cdiv(Dv, BV), B * H)](
            c(q1), c(k1), c(q2), c(k2), c(v), c(g1).float(), c(g2).float(),
            probs.reshape(B, N).float().contiguous(), sel.reshape(B, N).to(torch.int8).contiguous(),
            s_in, s_out, parts, o, H, N, Dk, Dv, BK, BV, num_warps=4)
    if inplace:
        return o.view(B, 1, H, Dv), state
    return o.view(B, 1, H, Dv), SSEState(s_out, parts)
