"""Gated delta rule: the chunked (WY) form against the serial oracle (float64 <= 1e-10, float32
<= 1e-4, relative to the largest entry of the reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from subquadratic.kernels.gated_delta import gdn_chunked, gdn_recurrent

F64, F32 = torch.float64, torch.float32
TOL = {F64: 1e-10, F32: 1e-4}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def gdn_inputs(B, T, H, Dk, Dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    k = F.normalize(r(B, T, H, Dk), dim=-1)
    la = F.logsigmoid(r(B, T, H) + 2)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return r(B, T, H, Dk), k, r(B, T, H, Dv), la, beta, r(B, H, Dk, Dv)


# --------------------------------------------------------------------------- GLA / GDN


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("T,chunk", [(1, 16), (7, 16), (37, 16), (100, 64), (37, 7)])
def test_gdn_chunked_matches_recurrent(dtype, T, chunk):
    q, k, v, la, beta, S = gdn_inputs(2, T, 2, 8, 6, dtype, seed=T + chunk)
    o_ref, S_ref = gdn_recurrent(q, k, v, la, beta, S)
    o, S_out = gdn_chunked(q, k, v, la, beta, S, chunk_size=chunk)
    assert rel_err(o, o_ref) <= TOL[dtype]
    assert rel_err(S_out, S_ref) <= TOL[dtype]
    o_a, S_a = gdn_chunked(q[:, :5], k[:, :5], v[:, :5], la[:, :5], beta[:, :5], S, chunk)
    o_b, S_b = gdn_chunked(q[:, 5:], k[:, 5:], v[:, 5:], la[:, 5:], beta[:, 5:], S_a, chunk)
    assert rel_err(torch.cat([o_a, o_b], 1), o_ref) <= TOL[dtype]
    assert rel_err(S_b, S_ref) <= TOL[dtype]


# --------------------------------------------------------------------------- SSE
