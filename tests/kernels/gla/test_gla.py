"""GLA: chunked and variable-length forms against the serial oracle (float64 <= 1e-10,
float32 <= 1e-4, relative to the largest entry of the reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from subquadratic.kernels.gla import gla_chunked, gla_recurrent, gla_varlen

F64, F32 = torch.float64, torch.float32
TOL = {F64: 1e-10, F32: 1e-4}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()




def gla_inputs(B, T, H, Dk, Dv, dtype, seed, decay_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    g = F.logsigmoid(r(B, T, H, Dk) * 2) * decay_scale
    return r(B, T, H, Dk), r(B, T, H, Dk), r(B, T, H, Dv), g, r(B, H, Dk, Dv)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("T", [1, 7, 37, 100])
@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_gla_chunked_matches_recurrent(dtype, T, chunk):
    q, k, v, g, S = gla_inputs(2, T, 2, 32 if chunk == 64 else 8, 6, dtype, seed=T * 100 + chunk)
    o_ref, S_ref = gla_recurrent(q, k, v, g, S)
    o, S_out = gla_chunked(q, k, v, g, S, chunk_size=chunk)
    assert o.dtype == dtype and S_out.dtype == dtype
    assert rel_err(o, o_ref) <= TOL[dtype]
    assert rel_err(S_out, S_ref) <= TOL[dtype]


def test_gla_chunked_strong_decay_is_finite():
    # cumulative log decay reaches ~ -4000 inside a chunk: exp(-b) would overflow
    q, k, v, g, S = gla_inputs(1, 100, 2, 8, 4, F32, seed=1, decay_scale=60.0)
    o_ref, S_ref = gla_recurrent(q, k, v, g, S)
    o, S_out = gla_chunked(q, k, v, g, S, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(S_out).all()
    assert rel_err(o, o_ref) <= TOL[F32] and rel_err(S_out, S_ref) <= TOL[F32]


@pytest.mark.parametrize("split", [1, 30, 64])
def test_gla_state_handover(split):
    q, k, v, g, S = gla_inputs(2, 100, 2, 8, 6, F64, seed=split)
    o_all, S_all = gla_chunked(q, k, v, g, S, chunk_size=16)
    a, b = slice(None, split), slice(split, None)
    o_a, S_a = gla_chunked(q[:, a], k[:, a], v[:, a], g[:, a], S, chunk_size=16)
    o_b, S_b = gla_chunked(q[:, b], k[:, b], v[:, b], g[:, b], S_a, chunk_size=16)
    assert rel_err(torch.cat([o_a, o_b], 1), o_all) <= TOL[F64]
    assert rel_err(S_b, S_all) <= TOL[F64]


def test_gla_varlen_matches_per_segment_recurrent():
    lens = [5, 0, 37, 16, 1]
    cu = torch.tensor([0] + lens).cumsum(0)
    q, k, v, g, _ = gla_inputs(1, sum(lens), 2, 8, 6, F64, seed=7)
    S0 = torch.randn(len(lens), 2, 8, 6, dtype=F64)
    o, S = gla_varlen(q[0], k[0], v[0], g[0], cu_seqlens=cu, initial_state=S0, chunk_size=16)
    for i in range(len(lens)):
        a, b = cu[i].item(), cu[i + 1].item()
        o_ref, S_ref = gla_recurrent(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], S0[i : i + 1])
        if b > a:
            assert rel_err(o[a:b], o_ref[0]) <= TOL[F64]
        assert rel_err(S[i], S_ref[0]) <= TOL[F64]
    assert torch.equal(S[1], S0[1])  # empty segment: state passes through


@pytest.mark.parametrize("chunk", [7, 16])
@pytest.mark.parametrize("form", ["dense", "varlen"])
def test_gla_gradients_match_recurrent(chunk, form):
    # fp64 gradients of q, k, v, g and the initial state against the serial oracle; a chunk of 7
    # exercises the padding of the bisection to a power of two
    lens = [23, 9] if form == "varlen" else [30, 30]
    q, k, v, g, S = gla_inputs(1, sum(lens), 2, 8, 6, F64, seed=chunk + len(form))
    S0 = torch.randn(len(lens), 2, 8, 6, dtype=F64)
    xs = [x.requires_grad_() for x in (q, k, v, g, S0)]
    w_o = torch.randn(1, sum(lens), 2, 6, dtype=F64)
    w_s = torch.randn(len(lens), 2, 8, 6, dtype=F64)
    cu = torch.tensor([0] + lens).cumsum(0)

    def oracle():
        outs, states = [], []
        for i in range(len(lens)):
            a, b = cu[i].item(), cu[i + 1].item()
            o_i, S_i = gla_recurrent(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], S0[i : i + 1])
            outs.append(o_i)
            states.append(S_i)
        return torch.cat(outs, 1), torch.cat(states, 0)

    def fast():
        if form == "varlen":
            o, S_out = gla_varlen(q[0], k[0], v[0], g[0], cu_seqlens=cu, initial_state=S0, chunk_size=chunk)
            return o[None], S_out
        T = lens[0]
        fold = lambda x: x.view(1, 2, T, *x.shape[2:]).flatten(0, 1)  # noqa: E731  [2, T, H, *]
        o, S_out = gla_chunked(fold(q), fold(k), fold(v), fold(g), S0, chunk_size=chunk)
        return o.reshape(1, 2 * T, *o.shape[2:]), S_out

    results = []
    for fn in (oracle, fast):
        o, S_out = fn()
        loss = (o * w_o).sum() + (S_out * w_s).sum()
        results.append((o.detach(), S_out.detach(), torch.autograd.grad(loss, xs)))
    (o_ref, S_ref, g_ref), (o, S_out, grads) = results
    assert rel_err(o, o_ref) <= TOL[F64] and rel_err(S_out, S_ref) <= TOL[F64]
    for name, a, b in zip("q k v g S0".split(), grads, g_ref, strict=True):
        assert rel_err(a, b) <= TOL[F64], name


@pytest.mark.parametrize("fixed_shapes", [True, False])
@pytest.mark.parametrize("shuffle", [False, True])
def test_gla_segments_both_layouts_match_recurrent(fixed_shapes, shuffle):
    # the packed form with rows in any order, fixed-shape (masked carry over max_len) and compact
    # (the real lengths, the CPU default) layouts: fp64 values and gradients against the oracle
    from subquadratic.kernels.gla import gla_chunk_terms
    from subquadratic.kernels.linear_common import segments

    lens = [19, 0, 40, 7]
    M = sum(lens)
    q, k, v, g, _ = gla_inputs(1, M, 2, 8, 6, F64, seed=11 + shuffle)
    q, k, v, g = (x[0] for x in (q, k, v, g))
    S0 = torch.randn(len(lens), 2, 8, 6, dtype=F64)
    xs = [x.requires_grad_() for x in (q, k, v, g, S0)]
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    perm = torch.randperm(M, generator=torch.Generator().manual_seed(3)) if shuffle else torch.arange(M)
    w_o, w_s = torch.randn(M, 2, 6, dtype=F64), torch.randn(len(lens), 2, 8, 6, dtype=F64)
    o, S = segments(gla_chunk_terms, q[perm], k[perm], v[perm], (g[perm],), seg[perm], pos[perm], S0,
                    max(lens), 16, fixed_shapes=fixed_shapes)
    o = torch.empty_like(o).index_put((perm,), o)                  # back to segment order
    grads = torch.autograd.grad((o * w_o).sum() + (S * w_s).sum(), xs)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    outs, states = [], []
    for i in range(len(lens)):
        a, b = cu[i], cu[i + 1]
        o_i, S_i = gla_recurrent(q[None, a:b], k[None, a:b], v[None, a:b], g[None, a:b], S0[i : i + 1])
        outs.append(o_i[0])
        states.append(S_i)
    o_ref, S_ref = torch.cat(outs), torch.cat(states)
    g_ref = torch.autograd.grad((o_ref * w_o).sum() + (S_ref * w_s).sum(), xs)
    assert rel_err(o, o_ref) <= TOL[F64] and rel_err(S, S_ref) <= TOL[F64]
    for name, a, b in zip("q k v g S0".split(), grads, g_ref, strict=True):
        assert rel_err(a, b) <= TOL[F64], name
