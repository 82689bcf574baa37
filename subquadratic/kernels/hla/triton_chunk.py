"""Triton chunked HLA (training / prefill): forward and backward, same contract as `hla_chunked`.

Both variants are compositions of one op, the chunked decayed linear attention

    LA_a(q, k, v; X0):  X_t = exp(a_t) X_{t-1} + k_t v_t^T,   o_t = q_t^T X_t     (X_0 = X0)

with a per-token, per-head log decay a_t <= 0. Since S_t = alpha_t S_{t-1} + k_t k_t^T, the
data-dependent key of hla2, ktilde_t = S_t q_t, is itself LA_{log alpha}(q, k, k; S_0) (the
value is k), and F is LA with decay alpha^2 on (q, ktilde, v):

    hla2:  ktilde, S_T = LA_{la}(q, k, k; S_0);   o, F_T = LA_{2 la}(q, ktilde, v; F_0)
    ahla:  u, S_T = LA_{la}(q, k, v; S_0);        o, F_T = LA_{la}(q, k, u; F_0)

The normalised forms run the second stage (ahla: both stages) on [v, 1], whose last column carries
eta (and z) and gives the denominator, exactly as `chunk.py` does. Gradients of the composition
come from autograd through the `LinearAttention` Function, whose backward is four kernels too.

LinearAttention, chunk C, N = ceil(T / C) chunks, g = in-chunk cumulative sum of a:
  forward   `_fwd_h`   one program per (K block, V block, batch x head) walks the chunks in order
                       and stores the state before each chunk, h [B, N, H, K, V], and the final state;
            `_fwd_o`   one program per (V block, chunk, batch x head):
                       o = exp(g) (Q h_n) + (M_g o Q K^T) V, M_g[t, s] = exp(g_t - g_s) for s <= t.
  backward  `_fwd_h`   again (h is recomputed, not kept);
            `_bwd_dh`  walks the chunks backwards: dh_n (gradient of the state at the end of chunk n)
                       starting from the final state's gradient; also the initial state's gradient;
            `_bwd_dqkv` one program per (chunk, batch x head): dq, dk, dv and
                       dG_t = q_t . dq_t - k_t . dk_t, the gradient of the global cumulative sum of a;
                       da is its reverse cumulative sum (plus <dX_T, X_T> at the last token).
Everything is linear in T; no host synchronisation. Dots run on the tensor cores in the input
dtype (bf16 / fp16) with fp32 accumulation, or in exact fp32 ("ieee") for fp32 inputs.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ..triton_utils import TRITON_DTYPES as DTYPES
from ..triton_utils import block_size as _p2
from ..triton_utils import dot_precision as _prec
from ..utils import import_triton, new_output
from .recurrent import HLAState, check_inputs, clamp_signed, init_state

triton, tl = import_triton()

#: Launch settings (block sizes along K / V, warps, stages) of the four kernels when not autotuned
#: (the CPU interpreter); on the GPU each kernel is autotuned over the few settings of `_CONFIGS`
#: once per (K, V, chunk, dtype).
AUTOTUNE = os.environ.get("TRITON_INTERPRET", "0") != "1"
BK_H = 64
BV_H = 64
WARPS_H = 4
STAGES_H = 2
BV_O = 64
WARPS_O = 4
BV_DQKV = 64
WARPS_DQKV = 8

_CONFIGS = {  # (BK, BV, warps, stages)
    "h": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (32, 64, 4, 3), (32, 32, 4, 2), (64, 64, 8, 2)],
    "o": [(None, 64, 4, 2), (None, 64, 8, 2), (None, 128, 8, 2), (None, 32, 4, 2)],
    "dqkv": [(None, 64, 8, 2), (None, 64, 4, 2), (None, 32, 4, 2), (None, 32, 8, 2)],
}


def _autotune(kind):
    """triton.autotune over _CONFIGS[kind], block sizes clamped to the (padded) head dims."""

    def prune(configs, nargs, **kw):
        K, V = _p2(nargs["K"]), _p2(nargs["V"])
        out, seen = [], set()
        for c in configs:
            kwargs = {n: min(b, K if n == "BK" else V) for n, b in c.kwargs.items()}
            sig = (tuple(sorted(kwargs.items())), c.num_warps, c.num_stages)
            if sig not in seen:
                seen.add(sig)
                out.append(triton.Config(kwargs, num_warps=c.num_warps, num_stages=c.num_stages))
        return out

    configs = [triton.Config({"BV": bv} if bk is None else {"BK": bk, "BV": bv}, num_warps=w, num_stages=st)
               for bk, bv, w, st in _CONFIGS[kind]]
    return triton.autotune(configs, key=["K", "V", "BT", "PREC"], prune_configs_by={"early_config_prune": prune})


def _launch(kernel, grid, args, fixed: dict, warps: int, stages: int = 2):
    """kernel[grid](*args): autotuned, or with the module's fixed settings when AUTOTUNE is off."""
    if AUTOTUNE:
        kernel[grid](*args)
    else:
        kernel.fn[grid](*args, **fixed, num_warps=warps, num_stages=stages)


@_autotune("h")
@triton.jit
def _fwd_h(
    k, v, g, h, h0, ht,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NT, BT: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_bh * K * V + off_kv, mask=m_kv, other=0.0)
    for i_t in range(0, NT):
        tl.store(h + ((i_b * NT + i_t) * H + i_h) * K * V + off_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        tok = i_t * BT + o_t
        m_t = tok < T
        b_k = tl.load(k + ((i_b * T + tok) * H + i_h)[:, None] * K + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_v = tl.load(v + ((i_b * T + tok) * H + i_h)[:, None] * V + o_v[None, :],
                      mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_g = tl.load(g + i_bh * NT * BT + tok)
        b_gl = tl.load(g + i_bh * NT * BT + i_t * BT + BT - 1)
        b_kd = (b_k.to(tl.float32) * tl.exp(b_gl - b_g)[:, None]).to(b_k.dtype)
        b_h = b_h * tl.exp(b_gl) + tl.dot(tl.trans(b_kd), b_v, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + i_bh * K * V + off_kv, b_h, mask=m_kv)


@_autotune("o")
@triton.jit
def _fwd_o(
    q, k, v, g, h, o,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NT,
    BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, BV: tl.constexpr,
):
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    tok = i_t * BT + o_t
    m_t = tok < T
    row = (i_b * T + tok) * H + i_h
    b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    b_h = tl.load(h + ((i_b * NT + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_g = tl.load(g + i_bh * NT * BT + tok)
    b_o = tl.dot(b_q, b_h.to(b_q.dtype), input_precision=PREC) * tl.exp(b_g)[:, None]
    b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    causal = o_t[:, None] >= o_t[None, :]
    b_A = tl.where(causal, b_A * tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
    b_o += tl.dot(b_A.to(b_v.dtype), b_v, input_precision=PREC)
    tl.store(o + row[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@_autotune("h")
@triton.jit
def _bwd_dh(
    q, do, g, dh, dht, dh0,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NT, BT: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_bh * K * V + off_kv, mask=m_kv, other=0.0)
    for j in range(0, NT):
        i_t = NT - 1 - j
        tl.store(dh + ((i_b * NT + i_t) * H + i_h) * K * V + off_kv, b_dh.to(dh.dtype.element_ty), mask=m_kv)
        tok = i_t * BT + o_t
        m_t = tok < T
        b_q = tl.load(q + ((i_b * T + tok) * H + i_h)[:, None] * K + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_do = tl.load(do + ((i_b * T + tok) * H + i_h)[:, None] * V + o_v[None, :],
                       mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_g = tl.load(g + i_bh * NT * BT + tok)
        b_gl = tl.load(g + i_bh * NT * BT + i_t * BT + BT - 1)
        b_qd = (b_q.to(tl.float32) * tl.exp(b_g)[:, None]).to(b_q.dtype)
        b_dh = b_dh * tl.exp(b_gl) + tl.dot(tl.trans(b_qd), b_do.to(b_q.dtype), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + i_bh * K * V + off_kv, b_dh, mask=m_kv)


@_autotune("dqkv")
@triton.jit
def _bwd_dqkv(
    q, k, v, g, h, do, dh, dq, dk, dv, dg,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NT,
    BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, BV: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    tok = i_t * BT + o_t
    m_t = tok < T
    row = (i_b * T + tok) * H + i_h
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_g = tl.load(g + i_bh * NT * BT + tok)
    b_gl = tl.load(g + i_bh * NT * BT + i_t * BT + BT - 1)
    # M[s, t] = exp(g_t - g_s) for s <= t (rows: keys s, columns: queries t)
    upper = o_t[:, None] <= o_t[None, :]
    b_m = tl.where(upper, tl.exp(tl.where(upper, b_g[None, :] - b_g[:, None], 0.0)), 0.0)
    b_Akq = (tl.dot(b_k, tl.trans(b_q), input_precision=PREC) * b_m).to(b_q.dtype)
    b_kd = (b_k.to(tl.float32) * tl.exp(b_gl - b_g)[:, None]).to(b_k.dtype)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    hbase = ((i_b * NT + i_t) * H + i_h) * K * V
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(b_q.dtype)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(b_q.dtype)
        b_h = tl.load(h + hbase + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0).to(b_q.dtype)
        b_dh = tl.load(dh + hbase + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0).to(b_q.dtype)
        b_ds += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_dq += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        b_dk += tl.dot(b_v, tl.trans(b_dh), input_precision=PREC)
        b_dv = tl.dot(b_Akq, b_do, input_precision=PREC) + tl.dot(b_kd, b_dh, input_precision=PREC)
        tl.store(dv + row[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)
    # ds[t, s] = (do_t . v_s) exp(g_t - g_s) for s <= t
    b_ds = (b_ds * tl.trans(b_m)).to(b_q.dtype)
    b_dq = b_dq * tl.exp(b_g)[:, None] + tl.dot(b_ds, b_k, input_precision=PREC)
    b_dk = b_dk * tl.exp(b_gl - b_g)[:, None] + tl.dot(tl.trans(b_ds), b_q, input_precision=PREC)
    b_dg = tl.sum(b_q.to(tl.float32) * b_dq, 1) - tl.sum(b_k.to(tl.float32) * b_dk, 1)
    tl.store(dq + row[:, None] * K + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + row[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + i_bh * NT * BT + tok, b_dg)


def _local_cumsum(a: Tensor, C: int) -> tuple[Tensor, int]:
    """a [B, T, H] (fp32) -> in-chunk cumulative sums g [B, H, N * C] (the tail padded with 0, so
    the padded entries repeat the last sum), and N."""
    B, T, H = a.shape
    N = triton.cdiv(T, C)
    g = torch.nn.functional.pad(a.transpose(1, 2), (0, N * C - T))
    return g.reshape(B, H, N, C).cumsum(-1).reshape(B, H, N * C).contiguous(), N


def _states(k, v, g, X0, N, C, want_final, state_dtype):
    B, T, H, K = k.shape
    V = v.shape[-1]
    h = new_output((B, N, H, K, V), k.device, state_dtype)
    ht = new_output((B, H, K, V), k.device) if want_final else None
    grid = lambda m: (triton.cdiv(K, m["BK"]), triton.cdiv(V, m["BV"]), B * H)
    _launch(_fwd_h, grid, (k, v, g, h, X0, ht, T, H, K, V, N, C, X0 is not None, want_final, _prec(k.dtype)),
            {"BK": min(BK_H, _p2(K)), "BV": min(BV_H, _p2(V))}, WARPS_H, STAGES_H)
    return h, ht


class LinearAttention(torch.autograd.Function):
    """o, X_T = LA_a(q, k, v; X0) (module docstring); q, k: [B, T, H, K], v: [B, T, H, V] of one
    dtype, a: [B, T, H] fp32 log decays, X0: [B, H, K, V] fp32 or None. o in `out_dtype`."""

    @staticmethod
    def forward(ctx, q, k, v, a, X0, chunk_size, out_dtype):
        B, T, H, K = q.shape
        V = v.shape[-1]
        C = chunk_size
        g, N = _local_cumsum(a, C)
        state_dtype = torch.float32 if q.dtype == torch.float32 else q.dtype
        h, XT = _states(k, v, g, X0, N, C, True, state_dtype)
        o = new_output((B, T, H, V), q.device, out_dtype)
        _launch(_fwd_o, lambda m: (triton.cdiv(V, m["BV"]), N, B * H),
                (q, k, v, g, h, o, T, H, K, V, N, C, _p2(K), _prec(q.dtype)), {"BV": min(BV_O, _p2(V))}, WARPS_O)
        ctx.save_for_backward(q, k, v, g, X0, XT)
        ctx.C, ctx.N = C, N
        ctx.set_materialize_grads(False)
        return o, XT

    @staticmethod
    def backward(ctx, do, dXT):
        q, k, v, g, X0, XT = ctx.saved_tensors
        C, N = ctx.C, ctx.N
        B, T, H, K = q.shape
        V = v.shape[-1]
        state_dtype = torch.float32 if q.dtype == torch.float32 else q.dtype
        do = torch.zeros_like(v) if do is None else do.to(v.dtype).contiguous()
        if dXT is not None:
            dXT = dXT.float().contiguous()
        h, _ = _states(k, v, g, X0, N, C, False, state_dtype)
        dh = new_output((B, N, H, K, V), q.device, state_dtype)
        dX0 = new_output((B, H, K, V), q.device) if X0 is not None and ctx.needs_input_grad[4] else None
        _launch(_bwd_dh, lambda m: (triton.cdiv(K, m["BK"]), triton.cdiv(V, m["BV"]), B * H),
                (q, do, g, dh, dXT, dX0, T, H, K, V, N, C, dXT is not None, dX0 is not None, _prec(q.dtype)),
                {"BK": min(BK_H, _p2(K)), "BV": min(BV_H, _p2(V))}, WARPS_H, STAGES_H)
        dq, dk, dv = (new_output(x.shape, x.device, x.dtype) for x in (q, k, v))
        dg = new_output((B, H, N * C), q.device)
        _launch(_bwd_dqkv, (N, B * H), (q, k, v, g, h, do, dh, dq, dk, dv, dg, T, H, K, V, N, C, _p2(K),
                                        _prec(q.dtype)), {"BV": min(BV_DQKV, _p2(V))}, WARPS_DQKV)
        dg = dg[:, :, :T]
        if dXT is not None:  # X_T = exp(G_T) X_0 + ...: d/dG_T = <dX_T, X_T>
            dg = torch.cat([dg[:, :, :-1], dg[:, :, -1:] + (dXT * XT).sum((-2, -1))[..., None]], -1)
        da = dg.flip(-1).cumsum(-1).flip(-1).transpose(1, 2)  # [B, T, H]
        return dq, dk, dv, da, dX0, None, None


def linear_attention(q, k, v, a, X0=None, *, chunk_size=64, out_dtype=None):
    """Chunked decayed linear attention on the Triton kernels, differentiable (see `LinearAttention`)."""
    dt = q.dtype
    q, k, v = q.contiguous(), k.to(dt).contiguous(), v.to(dt).contiguous()
    a = a.float().contiguous()
    if X0 is not None:
        X0 = X0.float().contiguous()
    return LinearAttention.apply(q, k, v, a, X0, chunk_size, out_dtype or dt)


def hla_chunked_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor,
    state: HLAState | None = None,
    *,
    chunk_size: int = 64,
    normalize: bool = False,
    eps: float = 1e-6,
    variant: str = "hla2",
) -> tuple[Tensor, HLAState]:
    """Chunked HLA on the Triton kernels, same contract as `hla_chunked` (and differentiable in
    q, k, v, log_alpha and the initial state). Inputs in DTYPES; chunk_size: a power of two >= 16
    (`hla.triton_unsupported`; `hla_attention` sends other inputs to the PyTorch forms)."""
    check_inputs(q, k, v, log_alpha, variant)
    if q.dtype not in DTYPES:
        raise ValueError(f"the HLA Triton kernels take {DTYPES} inputs, got {q.dtype}; use hla_attention")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    dt = q.dtype
    st = init_state(state, B, H, D, Dv, variant, normalize, torch.float32, q.device)
    if T == 0:
        return v.new_zeros(B, 0, H, Dv, dtype=dt), st
    la = log_alpha.float()
    k, v = k.to(dt), v.to(dt)
    kw = {"chunk_size": chunk_size}
    out_dt = torch.float32 if normalize else dt
    fresh = state is None  # zero initial states: the kernels start from 0 without reading them

    def init(X, col):  # initial state of one linear attention, [X, col] in the normalised form
        if fresh:
            return None
        return torch.cat([X, col[..., None]], -1) if normalize and col is not None else X

    vv = torch.cat([v, v.new_ones(B, T, H, 1)], -1) if normalize else v
    if variant == "hla2":
        # ktilde_t = S_t q_t = q_t^T S_t^T: the linear attention carries S^T (S is symmetric unless
        # the initial state is not; the transposes keep the contract for any S_0)
        kt, S = linear_attention(q, k, k, la, init(st.S.transpose(-1, -2), None), **kw)
        S = S.transpose(-1, -2)
        o, F = linear_attention(q, kt, vv, 2 * la, init(st.F, st.eta), out_dtype=out_dt, **kw)
        z = None
    else:
        u, S = linear_attention(q, k, vv, la, init(st.S, st.z), **kw)
        o, F = linear_attention(q, k, u, la, init(st.F, st.eta), out_dtype=out_dt, **kw)
        z = S[..., Dv] if normalize else None
        S = S[..., :Dv] if normalize else S
    eta = None
    if normalize:
        o = (o[..., :Dv] / clamp_signed(o[..., Dv:], eps)).to(dt)
        F, eta = F[..., :Dv], F[..., Dv]
    return o, HLAState(S=S, F=F, eta=eta, z=z)
