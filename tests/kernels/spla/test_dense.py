"""SPLA inside its budget (`spla_dense`, taken by `spla_attention` under "auto" and "torch") against
the PyTorch sparse form (`spla_parallel`), values, gradients and the Sbar it carries, up to and at
the switch to the sparse path; fp64, fresh random inputs, left padding and a cached prefix."""

from __future__ import annotations

import pytest
import torch

from subquadratic.kernels.spla import BlockStats, SPLAParams, spla_attention, spla_dense, spla_parallel, within_budget

PARAMS = SPLAParams(block_size=8, top_k_blocks=5, num_sink_blocks=1, num_local_blocks=2)


def inputs(seed, B=2, HQ=4, H=2, D=16, S=40, Tq=40, left_pad=3):
    """q [B, Tq, HQ, D], k, v [B, S, H, D] (fp64, requiring grad), positions with row 1 left-padded,
    block sums over every slot, a random Sbar of the S - Tq cached slots."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, h, D, generator=g, dtype=torch.float64, requires_grad=True)
               for n, h in ((Tq, HQ), (S, H), (S, H)))
    k_pos = torch.arange(S).repeat(B, 1)
    k_pos[1, :left_pad] = -1
    k_pos[1, left_pad:] -= left_pad
    stats = BlockStats.empty(B, H, D, "cpu", torch.float64, num_blocks=-(-S // PARAMS.block_size))
    stats.add_(k.detach(), k_pos, PARAMS.block_size)
    sbar = 0.1 * torch.randn(B, H, D, D, generator=g, dtype=torch.float64)
    return q, k, v, k_pos[:, S - Tq:], k_pos, stats, sbar


@pytest.mark.parametrize("S,Tq", [(40, 40), (40, 1), (33, 7), (12, 12)])
def test_dense_equals_sparse_form_inside_the_budget(S, Tq):
    q, k, v, q_pos, k_pos, stats, sbar = inputs(S * 100 + Tq, S=S, Tq=Tq)
    assert within_budget(S, PARAMS)
    o_sp, o_rla, sbar_ref = spla_parallel(q, k, v, q_pos, k_pos, stats, sbar, PARAMS)
    o_d, o_rla_d, sbar_d = spla_dense(q, k, v, q_pos, k_pos, sbar)
    assert o_rla_d is None and torch.count_nonzero(o_rla) == 0  # the sparse form's residual term is exactly 0
    torch.testing.assert_close(o_d, o_sp, rtol=0, atol=1e-12)
    torch.testing.assert_close(sbar_d, sbar_ref, rtol=0, atol=1e-12)
    w = torch.randn(o_sp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((o_sp * w).sum(), (q, k, v))
    grads_d = torch.autograd.grad((o_d * w).sum(), (q, k, v))
    for a, b in zip(grads_d, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_dispatch_switches_at_the_budget():
    """`spla_attention` takes the dense path exactly while S <= top_k_blocks x block_size and the
    sparse form beyond; both sides of the switch agree with the sparse form computed directly."""
    budget = PARAMS.top_k_blocks * PARAMS.block_size
    for S in (budget, budget + 1):
        q, k, v, q_pos, k_pos, stats, sbar = inputs(S, S=S, Tq=1)
        got = spla_attention(q, k, v, q_pos, k_pos, stats, sbar, PARAMS, backend="torch")
        ref = spla_parallel(q, k, v, q_pos, k_pos, stats, sbar, PARAMS)
        assert (got[1] is None) == (S <= budget)
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[2], ref[2], rtol=0, atol=1e-12)
        if S > budget:  # beyond the budget the residual term is live
            assert got[1].abs().max() > 0


def test_padded_queries_are_zero():
    q, k, v, q_pos, k_pos, stats, sbar = inputs(7)
    o, _, _ = spla_dense(q, k, v, q_pos, k_pos, sbar)
    assert torch.count_nonzero(o[1, :3]) == 0 and torch.isfinite(o).all()


@pytest.mark.parametrize("S,Tq", [(37, 37), (1, 1), (20, 1)])
def test_causal_flag_gives_the_masked_result(S, Tq):
    """causal=True (the caller knows every slot is real, in position order, the new tokens last) runs
    SDPA without a mask: same values and gradients as the masked call on the same unpadded inputs."""
    q, k, v, q_pos, k_pos, _, sbar = inputs(S * 100 + Tq, B=2, S=S, Tq=Tq, left_pad=0)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    results = []
    for causal in (False, True):
        o, _, s = spla_dense(q, k, v, q_pos, k_pos, sbar, causal=causal)
        results.append((o, s, torch.autograd.grad((o * w).sum(), (q, k, v))))
    (o0, s0, g0), (o1, s1, g1) = results
    torch.testing.assert_close(o1, o0, rtol=0, atol=1e-12)
    torch.testing.assert_close(s1, s0, rtol=0, atol=0)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
