"""The Triton kernels of `hla_features` (module `features.py`): one program per ROWS (token, KV head)
pairs, which writes (forward) or gathers (backward) the G query heads of each pair; the backward
sums k's and v's gradients over those G heads inside the program (no atomics). With the decay
(`hla_features_and_decay`) the same programs write each (token, query head)'s log alpha =
logsigmoid(bias + decay projection), and backward the gradient of its logit."""

from __future__ import annotations

import torch

from ..triton_launch import jit
from ..triton_math import logsigmoid
from ..triton_utils import block_size, cdiv, read_in_place, token_stride
from ..utils import import_triton, new_output, new_outputs

triton, tl = import_triton()

#: (token, KV head) pairs per program.
ROWS = 16
#: F.normalize's eps.
EPS = 1e-12


@jit
def _ld(X, rows, cols, n, D: tl.constexpr):
    m = (rows < n)[:, None] & (cols < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    return off, m, tl.load(X + off, mask=m, other=0.0).to(tl.float32)


@jit
def _inv_norm(x, eps):
    """1 / max(|x|, eps) per row, and whether the norm is above eps."""
    nrm = tl.sqrt(tl.sum(x * x, 1))
    return 1.0 / tl.maximum(nrm, eps), nrm > eps


@jit
def _norm_bwd(x, dy, scale, eps):
    """The gradient of s x / max(|x|, eps) for the output gradient dy (rows)."""
    inv, above = _inv_norm(x, eps)
    proj = tl.where(above, tl.sum(x * dy, 1) * inv * inv, 0.0)
    return scale * inv[:, None] * (dy - x * proj[:, None])


@jit
def _ld_strided(X, rows, cols, n, D: tl.constexpr, NH, S):
    """Rows (token, head) of X whose tokens are S elements apart (a token's NH x D entries contiguous)."""
    m = (rows < n)[:, None] & (cols < D)[None, :]
    r = rows.to(tl.int64)
    off = ((r // NH) * S + (r % NH) * D)[:, None] + cols[None, :]
    return m, tl.load(X + off, mask=m, other=0.0).to(tl.float32)


@jit
def _decay_logits(A, AB, rows, mr, S_A, HQ, DECAY: tl.constexpr):
    """The decay logits (fp32) of rows (token, query head) = token * HQ + head: the bias AB [HQ], plus
    with DECAY 2 the projection A [tokens, HQ] whose tokens are S_A elements apart."""
    r = rows.to(tl.int64)
    logit = tl.load(AB + r % HQ, mask=mr, other=0.0).to(tl.float32)
    if DECAY == 2:
        logit += tl.load(A + (r // HQ) * S_A + r % HQ, mask=mr, other=0.0).to(tl.float32)
    return logit


@jit
def hla_features_fwd(Q, K, V, QO, KO, VO, A, AB, LA, n, scale, eps, H, S_Q, S_K, S_V, S_A, G: tl.constexpr,
                     D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BR: tl.constexpr,
                     DECAY: tl.constexpr):
    """Q, K, V with their tokens S_* elements apart (column slices of a packed projection), the outputs
    contiguous. DECAY 0: no decay; 1: log alpha LA [tokens, HQ] fp32 of the bias AB alone; 2: of AB plus
    the projection A (tokens S_A elements apart)."""
    pairs = tl.program_id(0) * BR + tl.arange(0, BR)
    cols, cols_v = tl.arange(0, BD), tl.arange(0, BDV)
    dt = QO.dtype.element_ty
    # (each name keeps one type: Triton rejects a loop-carried variable whose type changes)
    mk, k = _ld_strided(K, pairs, cols, n, D, H, S_K)
    inv_k, above_k = _inv_norm(k, eps)
    k = (k * (inv_k * scale)[:, None]).to(dt)
    mv, v = _ld_strided(V, pairs, cols_v, n, DV, H, S_V)
    v = v.to(dt)
    for g in range(G):
        rows = pairs * G + g  # the query head kh * G + g of the token
        m, q = _ld_strided(Q, rows, cols, n * G, D, H * G, S_Q)
        off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        inv_q, above_q = _inv_norm(q, eps)
        tl.store(QO + off, (q * (inv_q * scale)[:, None]).to(dt), mask=m)
        tl.store(KO + off, k, mask=m)
        tl.store(VO + rows.to(tl.int64)[:, None] * DV + cols_v[None, :], v, mask=mv)
        if DECAY != 0:
            mr = rows < n * G
            tl.store(LA + rows.to(tl.int64), logsigmoid(_decay_logits(A, AB, rows, mr, S_A, H * G, DECAY)), mask=mr)


@jit
def hla_features_bwd(Q, K, DQO, DKO, DVO, DQ, DK, DV, A, AB, DLA, DZ, n, scale, eps, H, G: tl.constexpr,
                     D: tl.constexpr, DV_: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BR: tl.constexpr,
                     DECAY: tl.constexpr):
    """With DECAY, also the gradient of each row's decay logit DZ [tokens, HQ] fp32 from log alpha's DLA
    (d logsigmoid(z) / dz = sigmoid(-z)); A contiguous here."""
    pairs = tl.program_id(0) * BR + tl.arange(0, BR)
    cols, cols_v = tl.arange(0, BD), tl.arange(0, BDV)
    dk = tl.zeros([BR, BD], tl.float32)
    dv = tl.zeros([BR, BDV], tl.float32)
    for g in range(G):
        rows = pairs * G + g
        off, m, q = _ld(Q, rows, cols, n * G, D)
        off_dq, m_dq, dqo = _ld(DQO, rows, cols, n * G, D)
        tl.store(DQ + off, _norm_bwd(q, dqo, scale, eps).to(DQ.dtype.element_ty), mask=m)
        off_dk, m_dk, dko = _ld(DKO, rows, cols, n * G, D)
        off_dv, m_dv, dvo = _ld(DVO, rows, cols_v, n * G, DV_)
        dk += dko
        dv += dvo
        if DECAY != 0:
            mr = rows < n * G
            z = _decay_logits(A, AB, rows, mr, H * G, H * G, DECAY)
            dla = tl.load(DLA + rows.to(tl.int64), mask=mr, other=0.0)
            tl.store(DZ + rows.to(tl.int64), dla * tl.sigmoid(-z), mask=mr)
    off, m, k = _ld(K, pairs, cols, n, D)
    tl.store(DK + off, _norm_bwd(k, dk, scale, eps).to(DK.dtype.element_ty), mask=m)
    mv = (pairs < n)[:, None] & (cols_v < DV_)[None, :]
    tl.store(DV + pairs.to(tl.int64)[:, None] * DV_ + cols_v[None, :], dv.to(DV.dtype.element_ty), mask=mv)


class HLAFeatures(torch.autograd.Function):
    """`hla_features` (normalised) on the kernels: q [B, T, HQ, D], k [B, T, H, D], v [B, T, H, Dv] of
    one dtype, the scale; with the decay `bias` [HQ] (None: none) and `proj` [B, T, HQ] (None: the bias
    alone) also log alpha [B, T, HQ] fp32 (else None). Differentiable in q, k, v, bias and proj (`grad`
    False: no gradient will be asked for)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, proj, scale, grad=True):
        B, T, HQ, D = q.shape
        H, Dv = k.shape[2], v.shape[-1]
        G = HQ // H
        # without gradients (`grad` False) the inputs are read where they are when their tokens are one
        # stride apart (`token_stride`); the backward reads contiguous ones
        q, k, v = (x if not grad and token_stride(x) is not None else x.contiguous() for x in (q, k, v))
        decay = 0 if bias is None else (1 if proj is None else 2)
        S_A = HQ
        if proj is not None:
            proj, S_A = read_in_place(proj) if not grad else (proj.contiguous(), HQ)
        bias = None if bias is None else bias.contiguous()
        qo, ko = new_outputs([q.shape] * 2, q.device, q.dtype)
        vo = new_output((B, T, HQ, Dv), q.device, q.dtype)
        la = new_output((B, T, HQ), q.device) if decay else None
        n = B * T * H
        if n:
            hla_features_fwd[(cdiv(n, ROWS),)](q, k, v, qo, ko, vo, proj, bias, la, n, scale, EPS, H,
                                               *(token_stride(x) for x in (q, k, v)), S_A, G, D, Dv,
                                               block_size(D, 1), block_size(Dv, 1), ROWS, decay, num_warps=4)
        if grad:
            ctx.save_for_backward(q, k, bias, proj)
        ctx.scale, ctx.Dv, ctx.decay = scale, Dv, decay
        return qo, ko, vo, la

    @staticmethod
    def backward(ctx, dqo, dko, dvo, dla):
        q, k, bias, proj = ctx.saved_tensors
        B, T, HQ, D = q.shape
        H, Dv = k.shape[2], ctx.Dv
        G = HQ // H
        dq = new_output(q.shape, q.device, q.dtype)
        dk = new_output(k.shape, k.device, k.dtype)
        dv = new_output((B, T, H, Dv), k.device, k.dtype)
        decay = ctx.decay if dla is not None else 0
        dz = new_output((B, T, HQ), q.device) if decay else None  # the decay logits' gradient, fp32
        dla = None if dla is None else dla.float().contiguous()
        n = B * T * H
        if n:
            hla_features_bwd[(cdiv(n, ROWS),)](q, k, dqo.contiguous(), dko.contiguous(), dvo.contiguous(),
                                               dq, dk, dv, proj, bias, dla, dz, n, ctx.scale, EPS, H, G, D, Dv,
                                               block_size(D, 1), block_size(Dv, 1), ROWS, decay, num_warps=4)
        dbias = dproj = None
        if decay and ctx.needs_input_grad[3]:
            dbias = dz.sum((0, 1)).to(bias.dtype)
        if decay == 2 and ctx.needs_input_grad[4]:
            dproj = dz.to(proj.dtype)
        return dq, dk, dv, dbias, dproj, None, None
