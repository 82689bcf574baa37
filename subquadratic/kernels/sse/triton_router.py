"""The Triton kernels of SSE's router (`router.router_topk`): one program per ROWS tokens, the softmax over
the N partitions in fp32 and the top-K mask (K rounds of the largest remaining probability, the lowest
index among equals), the valid mask applied, in one launch where PyTorch takes four; in training the same
launch also sums what the load-balancing loss needs per program, and a second one-program launch makes
the loss (about a dozen launches forward and as many backward in PyTorch); asked to (`counts`), the same
launch counts each (sample, partition, block of ROWS tokens)'s selections for SSE's grouping
(`triton_sse.group_rows`), which then skips its counting launch. The backward is the softmax's with the
loss's gradient added, in PyTorch."""

from __future__ import annotations

import torch

from ..triton_launch import jit
from ..triton_utils import block_size, cdiv, read_in_place
from ..utils import import_triton, new_output

triton, tl = import_triton()

#: Tokens per program.
ROWS = 64


@jit
def router_fwd(LOGITS, VALID, P, SEL, PART, COUNT, T, S_L, N: tl.constexpr, BN: tl.constexpr, K: tl.constexpr,
               BR: tl.constexpr, HAS_VALID: tl.constexpr, AUX: tl.constexpr, COUNTS: tl.constexpr):
    """probs, the top-K mask of BR tokens of one sample (program (block, sample): rows of T tokens each);
    with AUX this program's sums for the load-balancing loss into its row of PART: sum_t w_t p_t [BN],
    sum_t sel_t [BN] (sel already 0 where w_t = 0), sum_t w_t, w = valid; with COUNTS the selections per
    partition i into COUNT [(sample * N + i) * blocks + block]. The logits' tokens are S_L elements apart
    (a column slice of a packed projection), the outputs contiguous."""
    blk, b = tl.program_id(0), tl.program_id(1)
    t = blk * BR + tl.arange(0, BR)
    rows = b * T + t
    cols = tl.arange(0, BN)
    mr = t < T
    m = mr[:, None] & (cols < N)[None, :]
    off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(LOGITS + rows.to(tl.int64)[:, None] * S_L + cols[None, :], mask=m, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(m, x, float("-inf"))
    e = tl.exp(x - tl.where(mr, tl.max(x, 1), 0.0)[:, None])
    e = tl.where(m, e, 0.0)
    p = e / tl.where(mr, tl.sum(e, 1), 1.0)[:, None]  # rows past the end: no 0 / 0
    tl.store(P + off, p, mask=m)
    cur = tl.where(m, p, -1.0)  # probabilities are >= 0: the padding columns never win
    sel = cols[None, :] < 0  # all False [1, BN], broadcast below
    for _ in tl.static_range(K):
        best = tl.max(cur, 1)
        first = tl.min(tl.where(cur == best[:, None], cols[None, :], BN), 1)
        hit = cols[None, :] == first[:, None]
        sel = sel | hit
        cur = tl.where(hit, -2.0, cur)
    w = mr
    if HAS_VALID:
        w = mr & (tl.load(VALID + rows, mask=mr, other=0) != 0)
        sel = sel & w[:, None]
    tl.store(SEL + off, sel.to(tl.int8), mask=m)
    if COUNTS:
        nblk = tl.num_programs(0)
        tl.store(COUNT + (b * N + cols) * nblk + blk, tl.sum((sel & m).to(tl.int32), 0), mask=cols < N)
    if AUX:
        wf = w.to(tl.float32)
        base = PART + (b * tl.num_programs(0) + blk).to(tl.int64) * (2 * BN + 1)
        tl.store(base + cols, tl.sum(tl.where(m, p, 0.0) * wf[:, None], 0))
        tl.store(base + BN + cols, tl.sum((sel & m).to(tl.float32), 0))
        tl.store(base + 2 * BN, tl.sum(wf, 0))


@jit
def router_aux_fin(PART, LOSS, COEF, n_parts, N: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr):
    """The load-balancing loss N sum_i P_i S_i / (c max(S, c)) from the programs' sums (c at least 1), and
    its gradient's coefficients N S_i / (c max(S, c)) (d loss / d p_ti = coef_i w_t)."""
    cols = tl.arange(0, BN)
    ps = tl.zeros([BN], dtype=tl.float32)
    ss = tl.zeros([BN], dtype=tl.float32)
    c = tl.zeros([BP], dtype=tl.float32)
    for p0 in range(0, n_parts, BP):
        r = p0 + tl.arange(0, BP)
        mr = r < n_parts
        base = PART + r.to(tl.int64)[:, None] * (2 * BN + 1) + cols[None, :]
        ps += tl.sum(tl.load(base, mask=mr[:, None], other=0.0), 0)
        ss += tl.sum(tl.load(base + BN, mask=mr[:, None], other=0.0), 0)
        c += tl.load(PART + r.to(tl.int64) * (2 * BN + 1) + 2 * BN, mask=mr, other=0.0)
    cc = tl.maximum(tl.sum(c, 0), 1.0)
    scale = N / (cc * tl.maximum(tl.sum(ss, 0), cc))
    tl.store(LOSS + cols, tl.sum(ps * ss, 0) * scale + 0.0 * cols, mask=cols == 0)
    tl.store(COEF + cols, ss * scale, mask=cols < N)


class Router(torch.autograd.Function):
    """(probs fp32, sel bool, loss, counts) of logits [..., N] (fp32 / bf16 / fp16) and top-k, `valid` [...]
    bool or None; with `aux` the loss is SSE's load-balancing loss (`router.sse_aux_loss` over the valid
    tokens, all without `valid`), else None; with `counts` (logits [B, T, N]) counts is the grouping's
    selection counts int32 [B, N, cdiv(T, ROWS)] (`router_fwd`), else None. Differentiable in the logits
    through probs and the loss."""

    @staticmethod
    def forward(ctx, logits, k, valid, aux=False, counts=False):
        N = logits.shape[-1]
        # [B, T, N] columns of a packed projection are read where they are
        lc, S = read_in_place(logits) if logits.dim() == 3 else (logits.contiguous(), N)
        B, T = (logits.shape[0], logits.shape[1]) if logits.dim() == 3 else (1, lc.numel() // N)
        if counts and logits.dim() != 3:
            raise ValueError(f"the grouping counts need logits [B, T, N]; got {list(logits.shape)}")
        dev = logits.device
        probs = new_output(logits.shape, dev)  # fp32
        sel = torch.empty(logits.shape, device=dev, dtype=torch.bool)
        BN = block_size(N, 2)
        blocks = cdiv(T, ROWS)
        part = new_output((max(B * blocks, 1), 2 * BN + 1), dev) if aux else probs
        count = new_output((B, N, blocks), dev, torch.int32) if counts else None
        if B * T:
            v = valid.contiguous().view(torch.int8) if valid is not None else lc
            router_fwd[(blocks, B)](lc, v, probs, sel.view(torch.int8), part, count, T, S, N, BN, k, ROWS,
                                    valid is not None, aux, counts, num_warps=4)
        elif aux:
            part.zero_()
        ctx.mark_non_differentiable(*((sel,) if count is None else (sel, count)))
        ctx.set_materialize_grads(False)  # no zeros made for sel's (or an unused output's) gradient
        ctx.dtype, ctx.aux = logits.dtype, aux
        if not aux:
            ctx.save_for_backward(probs)
            return probs, sel, None, count
        loss = new_output((1,), dev)
        coef = new_output((N,), dev)
        router_aux_fin[(1,)](part, loss, coef, part.shape[0], N, BN, 32, num_warps=4)
        ctx.save_for_backward(probs, coef, valid)
        return probs, sel, loss.view(()), count

    @staticmethod
    def backward(ctx, dp, _dsel, dloss, _dcount):
        # saved_tensors read once: each read unpacks again (under non-reentrant checkpointing, a second
        # unpack of a recomputed tensor is an error)
        p, *rest = ctx.saved_tensors
        if ctx.aux and dloss is not None:  # d loss / d p_ti = coef_i w_t (w = valid, 1 without)
            coef, valid = rest
            extra = dloss * coef
            extra = extra * valid[..., None] if valid is not None else extra.expand_as(p)
            dp = extra if dp is None else dp + extra
        if dp is None:
            return None, None, None, None, None
        # p (dp - sum(dp p)), the softmax's backward, as one kernel (dp is probs' fp32 already)
        return torch._softmax_backward_data(dp.to(p.dtype), p, -1, p.dtype).to(ctx.dtype), None, None, None, None
