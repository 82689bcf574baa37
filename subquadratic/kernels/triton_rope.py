"""The Triton kernels of `rope` (module `rope.py`): q and k in one launch, one program per ROWS
(token, head) rows of one of them, each row as its two halves x1, x2 (rotate_half(x) = [-x2, x1]):

    y1 = r(r(x1 c1) - r(x2 s1)),   y2 = r(r(x2 c2) + r(x1 s2))

with r the rounding to the output dtype (q's promoted with cos's), as the PyTorch form rounds. The
backward is the transposed rotation, each term rounded as autograd rounds it (to the output dtype,
then to q's), then their sum. Launched without floating-point contraction, so that fp32 rounds
as PyTorch's separate ops do."""

from __future__ import annotations

import torch

from .triton_launch import jit
from .triton_utils import block_size, cdiv, read_in_place, token_stride
from .utils import import_triton, new_output, promoted

triton, tl = import_triton()

#: (token, head) rows per program.
ROWS = 16


@jit
def _rows(X, S, COS, SIN, n, heads, T, s_cb, s_ct, pid, D2: tl.constexpr, BD2: tl.constexpr, BR: tl.constexpr):
    """This program's rows of X [tokens, heads, 2 * D2] (tokens S elements apart, a token's heads
    contiguous): the output's offsets of the halves (contiguous [tokens * heads, 2 * D2]), mask, and x1,
    x2, c1, c2, s1, s2 in fp32."""
    rows = pid * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD2)
    m = (rows < n)[:, None] & (cols < D2)[None, :]
    tok = rows // heads
    off = rows.to(tl.int64)[:, None] * (2 * D2) + cols[None, :]
    off_x = (tok.to(tl.int64) * S + (rows % heads) * (2 * D2))[:, None] + cols[None, :]
    off_c = ((tok // T).to(tl.int64) * s_cb + (tok % T) * s_ct)[:, None] + cols[None, :]
    x1 = tl.load(X + off_x, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(X + off_x + D2, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(COS + off_c, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(COS + off_c + D2, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + off_c, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + off_c + D2, mask=m, other=0.0).to(tl.float32)
    return off, m, x1, x2, c1, c2, s1, s2


@jit
def _fwd(X, S, Y, COS, SIN, n, heads, T, s_cb, s_ct, pid, D2: tl.constexpr, BD2: tl.constexpr, BR: tl.constexpr):
    off, m, x1, x2, c1, c2, s1, s2 = _rows(X, S, COS, SIN, n, heads, T, s_cb, s_ct, pid, D2, BD2, BR)
    dt = Y.dtype.element_ty
    y1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
    y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(Y + off, y1.to(dt), mask=m)
    tl.store(Y + off + D2, y2.to(dt), mask=m)


@jit
def _bwd(DY, S, DX, COS, SIN, n, heads, T, s_cb, s_ct, pid, D2: tl.constexpr, BD2: tl.constexpr, BR: tl.constexpr):
    """dx = r(r(dy c)) + rotate_half^T(r(dy s)) rounded to x's dtype, rotate_half^T(u) = [u2, -u1]."""
    off, m, g1, g2, c1, c2, s1, s2 = _rows(DY, S, COS, SIN, n, heads, T, s_cb, s_ct, pid, D2, BD2, BR)
    dt = DY.dtype.element_ty  # (one assignment each: a tuple of dtypes does not compile)
    xt = DX.dtype.element_ty
    a1 = (g1 * c1).to(dt).to(xt).to(tl.float32)
    a2 = (g2 * c2).to(dt).to(xt).to(tl.float32)
    b1 = (g2 * s2).to(dt).to(xt).to(tl.float32)
    b2 = (g1 * s1).to(dt).to(xt).to(tl.float32)
    tl.store(DX + off, (a1 + b1).to(xt), mask=m)
    tl.store(DX + off + D2, (a2 - b2).to(xt), mask=m)


@jit
def _rotate(X, S, Y, COS, SIN, n, heads, T, s_cb, s_ct, pid, D2: tl.constexpr, BD2: tl.constexpr, BR: tl.constexpr,
            BWD: tl.constexpr):
    if BWD:
        _bwd(X, S, Y, COS, SIN, n, heads, T, s_cb, s_ct, pid, D2, BD2, BR)
    else:
        _fwd(X, S, Y, COS, SIN, n, heads, T, s_cb, s_ct, pid, D2, BD2, BR)


@jit
def rope_kernel(A, B, OUT_A, OUT_B, COS, SIN, nq, nk, HQ, H, T, s_cb, s_ct, PQ, S_A, S_B, D2: tl.constexpr,
                BD2: tl.constexpr, BR: tl.constexpr, BWD: tl.constexpr):
    """Programs [0, PQ) take q's rows (A: q, or its output's gradient with BWD), the rest k's (B); A's and
    B's tokens S_A / S_B elements apart (a column slice of a packed projection), the outputs contiguous.
    (Each branch passes its own arguments: Triton may specialise an integer argument of value 1 into
    a constant, so the two branches' values are not merged into one variable.)"""
    pid = tl.program_id(0)
    if pid < PQ:
        _rotate(A, S_A, OUT_A, COS, SIN, nq, HQ, T, s_cb, s_ct, pid, D2, BD2, BR, BWD)
    else:
        _rotate(B, S_B, OUT_B, COS, SIN, nk, H, T, s_cb, s_ct, pid - PQ, D2, BD2, BR, BWD)


def _launch(a, b, out_a, out_b, cos, sin, bwd: bool):
    """The kernel over the rows of a [B, T, HQ, D] and b [B, T, H, D] (cos, sin [B or 1, T, D]), each with
    its tokens one stride apart (`token_stride`)."""
    B, T, HQ, D = a.shape
    H = b.shape[2]
    nq, nk = B * T * HQ, B * T * H
    PQ = cdiv(nq, ROWS)
    grid = (PQ + cdiv(nk, ROWS),)
    s_cb = cos.stride(0) if cos.shape[0] > 1 else 0
    if nq + nk:
        rope_kernel[grid](a, b, out_a, out_b, cos, sin, nq, nk, HQ, H, T, s_cb, cos.stride(1), PQ, token_stride(a),
                          token_stride(b), D // 2, block_size(D // 2, 1), ROWS, bwd, num_warps=4,
                          enable_fp_fusion=False)


class Rope(torch.autograd.Function):
    """`rope` on the kernels: q [B, T, HQ, D], k [B, T, H, D] of one dtype (read in place where each
    one's tokens are one stride apart, else copied first), cos, sin [B or 1, T, D] (no gradient); outputs
    contiguous in the promoted dtype of q and cos."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        out_dtype = promoted(q.dtype, cos.dtype)
        q, k = (read_in_place(t)[0] for t in (q, k))  # column slices of a packed projection: no copy
        cos, sin = cos.contiguous(), sin.contiguous()
        yq = new_output(q.shape, q.device, out_dtype)
        yk = new_output(k.shape, k.device, out_dtype)
        _launch(q, k, yq, yk, cos, sin, False)
        ctx.save_for_backward(cos, sin)
        ctx.dtype = q.dtype
        return yq, yk

    @staticmethod
    def backward(ctx, dyq, dyk):
        cos, sin = ctx.saved_tensors
        dyq, dyk = dyq.contiguous(), dyk.contiguous()
        dq = new_output(dyq.shape, dyq.device, ctx.dtype)
        dk = new_output(dyk.shape, dyk.device, ctx.dtype)
        _launch(dyq, dyk, dq, dk, cos, sin, True)
        return dq, dk, None, None
