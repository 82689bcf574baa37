"""The Triton kernels of `sse_gla_features` (module `features.py`): one program per ROWS rows of
[rows, D] (row r = (b * T + t) * H + h; the decay biases' row r % H), forward and backward. The
backward recomputes the sigmoids and the keys' softmax from the saved inputs; the biases' gradients
are the decay gradients summed over the tokens by the caller."""

from __future__ import annotations

import torch

from ..triton_launch import jit
from ..triton_math import logsigmoid
from ..triton_utils import block_size, cdiv, read_in_place, rows_per_program
from ..utils import import_triton, new_output

triton, tl = import_triton()


#: Elements of each tensor a program takes (fourteen tensors live in the backward).
ELEMENTS = 1024


@jit
def _ld(X, off, m):
    return tl.load(X + off, mask=m, other=0.0).to(tl.float32)


@jit
def _softmax(k, m_d):
    """Softmax over the valid columns of each row (fp32)."""
    k = tl.where(m_d[None, :], k, float("-inf"))
    e = tl.exp(k - tl.max(k, 1)[:, None])
    return e / tl.sum(e, 1)[:, None]


@jit
def _tile(n_rows, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """This program's element offsets [BR, BD], mask, bias offsets and column mask."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m_d = cols < D
    m = (rows < n_rows)[:, None] & m_d[None, :]
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    off_b = (rows % H)[:, None] * D + cols[None, :]
    return off, m, off_b, m_d


@jit
def _strided(off, S, H: tl.constexpr, D: tl.constexpr):
    """Offsets `off` of contiguous [tokens, H, D] rows moved to rows S elements apart per token."""
    return (off // (H * D)) * S + off % (H * D)


@jit
def _strided_kv(off, S, H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr):
    """Offsets `off` of contiguous [tokens, H, D] rows moved to the KV head serving each query head
    (head h reads KV head h // (H / HK)) of [tokens, HK, D] rows S elements apart per token."""
    r = off % (H * D)
    return (off // (H * D)) * S + (r // D) // (H // HK) * D + r % D


@jit
def _second_at(x1, X2, off, m, MODE: tl.constexpr):
    """The second branch's pre-activation: x1 itself (MODE 0), x1 plus X2 at offsets `off` (1: X2 is its
    low-rank offset), X2 there (2: X2 is the pre-activation)."""
    if MODE == 0:
        return x1
    elif MODE == 1:
        return x1 + _ld(X2, off, m)
    else:
        return _ld(X2, off, m)


@jit
def _second(x1, X2, off, S, m, H: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    """`_second_at` for contiguous [tokens, H, D] offsets `off` of X2's rows S elements apart."""
    return _second_at(x1, X2, _strided(off, S, H, D), m, MODE)


@jit
def sse_features_fwd(Q1, K1, Q2, K2, V, Z1, Z2, B1, B2, OQ1, OK1, OQ2, OK2, OV, G1, G2, n_rows, inv_norm,
                     S_Q1, S_K1, S_Q2, S_K2, S_V, S_Z1, S_Z2,
                     H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                     MODE: tl.constexpr):
    """The inputs' tokens S_* elements apart (a token's entries contiguous: column slices of a packed
    projection), K1 and V at HK heads, the outputs contiguous at H heads. MODE: `_second`."""
    off, m, off_b, m_d = _tile(n_rows, H, D, BD, BR)
    dt = OQ1.dtype.element_ty
    q1 = _ld(Q1, _strided(off, S_Q1, H, D), m)
    tl.store(OQ1 + off, (q1 * tl.sigmoid(q1)).to(dt), mask=m)
    x = _second(q1, Q2, off, S_Q2, m, H, D, MODE)
    tl.store(OQ2 + off, (x * tl.sigmoid(x)).to(dt), mask=m)
    x = _ld(V, _strided_kv(off, S_V, H, HK, D), m)
    tl.store(OV + off, (x * tl.sigmoid(x)).to(dt), mask=m)
    k1 = _ld(K1, _strided_kv(off, S_K1, H, HK, D), m)
    tl.store(OK1 + off, _softmax(k1, m_d).to(dt), mask=m)
    tl.store(OK2 + off, _softmax(_second(k1, K2, off, S_K2, m, H, D, MODE), m_d).to(dt), mask=m)
    z = _ld(Z1, _strided(off, S_Z1, H, D), m) + _ld(B1, off_b, m)
    tl.store(G1 + off, logsigmoid(z) * inv_norm, mask=m)
    z = _ld(Z2, _strided(off, S_Z2, H, D), m) + _ld(B2, off_b, m)
    tl.store(G2 + off, logsigmoid(z) * inv_norm, mask=m)


@jit
def _silu_grad(x, dy):
    s = tl.sigmoid(x)
    return dy * s * (1.0 + x * (1.0 - s))


@jit
def _softmax_grad(k, dy, m_d):
    y = _softmax(k, m_d)
    return y * (dy - tl.sum(dy * y, 1)[:, None])


@jit
def _decay_bwd(Z, S, B, DG, DZ, off, m, off_b, inv_norm, H: tl.constexpr, D: tl.constexpr):
    z = _ld(Z, _strided(off, S, H, D), m) + _ld(B, off_b, m)
    tl.store(DZ + off, _ld(DG, off, m) * inv_norm * tl.sigmoid(-z), mask=m)


@jit
def sse_features_bwd(Q1, K1, Q2, K2, V, Z1, Z2, B1, B2, DOQ1, DOK1, DOQ2, DOK2, DOV, DG1, DG2,
                     DQ1, DK1, DQ2, DK2, DV, DZ1, DZ2, n_rows, inv_norm,
                     S_Q1, S_K1, S_Q2, S_K2, S_V, S_Z1, S_Z2,
                     H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                     MODE: tl.constexpr, G: tl.constexpr):
    """The inputs read as the forward reads them, the output gradients contiguous; DK1 and DV per query
    head (the caller sums a KV head's), or with G > 1 per KV head, the sums of its G query heads' (fp32,
    then rounded; `group_sums`); DQ2 / DK2 written for MODE 1 and 2 only (MODE 0 and 1 add the second
    branch's gradient to the first's)."""
    off, m, off_b, m_d = _tile(n_rows, H, D, BD, BR)
    dt = DQ1.dtype.element_ty
    q1 = _ld(Q1, _strided(off, S_Q1, H, D), m)
    dq1 = _silu_grad(q1, _ld(DOQ1, off, m))
    dq2 = _silu_grad(_second(q1, Q2, off, S_Q2, m, H, D, MODE), _ld(DOQ2, off, m))
    if MODE != 0:
        tl.store(DQ2 + off, dq2.to(dt), mask=m)
    if MODE != 2:
        dq1 += dq2
    tl.store(DQ1 + off, dq1.to(dt), mask=m)
    k1 = _ld(K1, _strided_kv(off, S_K1, H, HK, D), m)
    dk1 = _softmax_grad(k1, _ld(DOK1, off, m), m_d)
    dk2 = _softmax_grad(_second(k1, K2, off, S_K2, m, H, D, MODE), _ld(DOK2, off, m), m_d)
    if MODE != 0:
        tl.store(DK2 + off, dk2.to(dt), mask=m)
    if MODE != 2:
        dk1 += dk2
    v = _ld(V, _strided_kv(off, S_V, H, HK, D), m)
    dv = _silu_grad(v, _ld(DOV, off, m))
    if G > 1:  # rows r * G .. r * G + G - 1 are KV head row r's query heads (r a [tokens, HK] row)
        kv = tl.program_id(0) * (BR // G) + tl.arange(0, BR // G)
        cols = tl.arange(0, BD)
        off_kv = kv.to(tl.int64)[:, None] * D + cols[None, :]
        m_kv = (kv < n_rows // G)[:, None] & m_d[None, :]
        tl.store(DK1 + off_kv, tl.sum(tl.reshape(dk1, [BR // G, G, BD]), 1).to(DK1.dtype.element_ty), mask=m_kv)
        tl.store(DV + off_kv, tl.sum(tl.reshape(dv, [BR // G, G, BD]), 1).to(DV.dtype.element_ty), mask=m_kv)
    else:
        tl.store(DK1 + off, dk1.to(DK1.dtype.element_ty), mask=m)
        tl.store(DV + off, dv.to(DV.dtype.element_ty), mask=m)
    _decay_bwd(Z1, S_Z1, B1, DG1, DZ1, off, m, off_b, inv_norm, H, D)
    _decay_bwd(Z2, S_Z2, B2, DG2, DZ2, off, m, off_b, inv_norm, H, D)


#: `sse_gla_features`' q2_mode -> the kernels' MODE
MODES = {"same": 0, "offset": 1, "full": 2}


class SSEFeatures(torch.autograd.Function):
    """`sse_gla_features` on the kernels: q1 [B, T, H, D], k1, v [B, T, HK, D] (H a multiple of HK),
    q2, k2 [B, T, H, D] (any tensors of q1's, ignored, for q2_mode "same"), of one dtype; z1, z2
    [B, T, H * D], bias1, bias2 [H * D], the normalizer, q2_mode; differentiable in every tensor. The
    inputs are read in place where their tokens are rows of one stride (`token_stride`; else copied
    first) and saved so (views: what autograd keeps of a packed projection anyway); nothing is saved
    when `grad` is False (no gradient will be asked for)."""

    @staticmethod
    def forward(ctx, q1, k1, q2, k2, v, z1, z2, bias1, bias2, normalizer, q2_mode="full", grad=True):
        B, T, H, D = q1.shape
        HK = k1.shape[2]
        mode = MODES[q2_mode]
        xs, strides = zip(*(read_in_place(t) for t in (q1, k1, q2, k2, v, z1, z2)), strict=True)
        xs = [*xs, bias1.contiguous(), bias2.contiguous()]
        n_rows = B * T * H
        outs = [new_output(q1.shape, q1.device, q1.dtype) for _ in range(5)]
        gs = [new_output(q1.shape, q1.device) for _ in range(2)]  # fp32
        BD = block_size(D, 1)
        BR = rows_per_program(BD, ELEMENTS)
        if n_rows:
            sse_features_fwd[(cdiv(n_rows, BR),)](*xs, *outs, *gs, n_rows, 1.0 / normalizer, *strides,
                                                         H, HK, D, BD, BR, mode, num_warps=4)
        if grad:
            ctx.save_for_backward(*xs)
        ctx.normalizer, ctx.mode, ctx.strides = normalizer, mode, strides
        return (*outs, *gs)

    @staticmethod
    def backward(ctx, *grads):
        xs = ctx.saved_tensors
        q1, k1, z1, bias1 = xs[0], xs[1], xs[5], xs[7]
        B, T, H, D = q1.shape
        HK, mode = k1.shape[2], ctx.mode
        n_rows = B * T * H
        BD = block_size(D, 1)
        BR = rows_per_program(BD, ELEMENTS)
        G = group_sums(H, HK, BR)
        outs = feature_grad_outputs(q1, HK, mode, G > 1)
        if n_rows:
            sse_features_bwd[(cdiv(n_rows, BR),)](*xs, *(g.contiguous() for g in grads), *outs, n_rows,
                                                  1.0 / ctx.normalizer, *ctx.strides, H, HK, D, BD, BR, mode, G,
                                                  num_warps=4)
        return (*feature_grads(outs, HK, mode, (z1, xs[6]), (bias1, xs[8]), ctx.needs_input_grad[7:9]),
                None, None, None)


def group_sums(H: int, HK: int, block: int) -> int:
    """G, the query heads per KV head, where a feature backward kernel sums a KV head's gradients itself
    (blocks of `block` query heads or rows hold whole groups: G a power of two dividing it), else 1."""
    G = H // HK
    return G if G > 1 and G & (G - 1) == 0 and block % G == 0 else 1


def feature_grad_outputs(q1: torch.Tensor, HK: int, mode: int, summed: bool = False) -> tuple[torch.Tensor, ...]:
    """The feature backward kernels' outputs for q1 [B, T, H, D]: dq1, dk1, dq2, dk2, dv, dz1, dz2, each of
    q1's shape; dk1 and dv per query head (fp32 where HK < H: a KV head's gradient sums its query heads' in
    fp32 first), or at the HK heads in q1's dtype where the kernel sums them (`summed`); dq2 / dk2 dq1 itself
    (unwritten) for mode 0; dz1 / dz2 fp32 (the biases' gradients sum them)."""
    dt, dev = q1.dtype, q1.device
    B, T, H, D = q1.shape
    kv_shape, kv_dtype = ((B, T, HK, D), dt) if summed else (q1.shape, dt if HK == H else torch.float32)
    dq1 = new_output(q1.shape, dev, dt)
    dq2, dk2 = (new_output(q1.shape, dev, dt) if mode else dq1 for _ in range(2))
    dk1, dv = (new_output(kv_shape, dev, kv_dtype) for _ in range(2))
    return (dq1, dk1, dq2, dk2, dv, *(new_output(q1.shape, dev) for _ in range(2)))


def feature_grads(outs: tuple[torch.Tensor, ...], HK: int, mode: int, zs: tuple[torch.Tensor, torch.Tensor],
                  biases: tuple[torch.Tensor, torch.Tensor], need_bias: tuple[bool, bool]) -> tuple:
    """`sse_gla_features`' input gradients (dq1, dk1, dq2, dk2, dv, dz1, dz2, dbias1, dbias2) from the written
    `feature_grad_outputs`: a KV head's dk1 / dv summed over its query heads, dq2 / dk2 None for mode 0, the
    decays' in z's dtype and the biases' their sum over the tokens (None where not needed)."""
    dq1, dk1, dq2, dk2, dv, dz1, dz2 = outs
    B, T, H, D = dq1.shape
    if dk1.shape[2] != HK:  # per query head: a KV head's sum
        dk1, dv = (t.view(B, T, HK, H // HK, D).sum(3).to(dq1.dtype) for t in (dk1, dv))
    if mode == 0:
        dq2 = dk2 = None
    dbs = [dz.view(-1, H * D).sum(0).to(b.dtype) if need else None
           for dz, b, need in zip((dz1, dz2), biases, need_bias, strict=True)]
    dzs = [dz.view(B, T, H * D).to(z.dtype) for dz, z in zip((dz1, dz2), zs, strict=True)]
    return (dq1, dk1, dq2, dk2, dv, *dzs, *dbs)
