"""The Triton kernel of SSE's router (`router.router_topk`): one program per ROWS tokens, the softmax over
the N partitions in fp32 and the top-K mask (K rounds of the largest remaining probability, the lowest
index among equals), the valid mask applied, in one launch where PyTorch takes four. The backward is the
softmax's, in PyTorch."""

from __future__ import annotations

import torch

from ..triton_launch import jit
from ..triton_utils import block_size
from ..utils import import_triton, new_output

triton, tl = import_triton()

#: Tokens per program.
ROWS = 64


@jit
def router_fwd(LOGITS, VALID, P, SEL, n_rows, N: tl.constexpr, BN: tl.constexpr, K: tl.constexpr,
               BR: tl.constexpr, HAS_VALID: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BN)
    mr = rows < n_rows
    m = mr[:, None] & (cols < N)[None, :]
    off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(LOGITS + off, mask=m, other=float("-inf")).to(tl.float32)
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
    if HAS_VALID:
        sel = sel & (tl.load(VALID + rows, mask=mr, other=0) != 0)[:, None]
    tl.store(SEL + off, sel.to(tl.int8), mask=m)


class Router(torch.autograd.Function):
    """(probs fp32, sel bool) of logits [..., N] (fp32 / bf16 / fp16) and top-k, `valid` [...] bool or None;
    differentiable in the logits through probs."""

    @staticmethod
    def forward(ctx, logits, k, valid):
        N = logits.shape[-1]
        lc = logits.contiguous()
        n_rows = lc.numel() // N
        probs = new_output(logits.shape, logits.device)  # fp32
        sel = torch.empty(logits.shape, device=logits.device, dtype=torch.int8)
        if n_rows:
            v = valid.contiguous().view(torch.int8) if valid is not None else lc
            router_fwd[(triton.cdiv(n_rows, ROWS),)](lc, v, probs, sel, n_rows, N, block_size(N, 2), k, ROWS,
                                                     valid is not None, num_warps=4)
        sel = sel.view(torch.bool)
        ctx.mark_non_differentiable(sel)
        ctx.save_for_backward(probs)
        ctx.dtype = logits.dtype
        return probs, sel

    @staticmethod
    def backward(ctx, dp, _dsel):
        (p,) = ctx.saved_tensors
        if dp is None:
            return None, None, None
        return (p * (dp - (dp * p).sum(-1, keepdim=True))).to(ctx.dtype), None, None
