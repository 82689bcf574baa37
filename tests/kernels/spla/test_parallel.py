"""SPLA's PyTorch form (`spla_parallel`, the "torch" backend) vs the brute-force definition
(`spla_naive`, fp64), gradients, padding, edge cases. The tensors here are made head-major
([B, H, T, D]) and handed to the ops in their [B, T, H, D] layout."""

from __future__ import annotations

import pytest
import torch

from subquadratic.kernels.spla import BlockStats, SPLAParams, spla_naive, spla_parallel


def naive(q, k, v, params):
    """spla_naive of head-major q [HQ, T, D], k, v [H, T, D]; outputs head-major."""
    return tuple(o.transpose(0, 1) for o in spla_naive(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), params))


def run_reference(q, k, v, params, pos_q=None, pos_k=None, query_chunk=None):
    """q: [B, HQ, T, D], k, v: [B, H, S, D]; fresh cache (all tokens new)."""
    B, H, S, D = k.shape
    T = q.shape[2]
    if pos_k is None:
        pos_k = torch.arange(S).expand(B, S)
    if pos_q is None:
        pos_q = pos_k[:, S - T:]
    stats = BlockStats.empty(B, H, D, q.device, q.dtype).add(k.transpose(1, 2), pos_k, params.block_size)
    sbar = torch.zeros(B, H, D, D, dtype=q.dtype)
    o_sp, o_rla, sbar = spla_parallel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pos_q, pos_k, stats,
                                      sbar, params, query_chunk=query_chunk)
    return o_sp.transpose(1, 2), None if o_rla is None else o_rla.transpose(1, 2), sbar


CASES = [
    # (HQ, H, T, block, top_k, sink, local, selection)
    (4, 2, 70, 8, 4, 1, 2, "taylor"),
    (4, 2, 70, 8, 4, 1, 2, "mean"),
    (3, 3, 53, 4, 5, 0, 1, "taylor"),  # MHA, no sink
    (8, 1, 40, 8, 3, 1, 2, "taylor"),  # G = 8
    (2, 1, 33, 16, 2, 1, 1, "taylor"),  # tiny budget
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_bruteforce_fp64(case):
    HQ, H, T, bs, top, sink, local, sel = case
    torch.manual_seed(hash(case) % 1000)
    D = 8
    q = torch.randn(HQ, T, D, dtype=torch.float64)
    k = torch.randn(H, T, D, dtype=torch.float64) * 1.5
    v = torch.randn(H, T, D, dtype=torch.float64)
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local, selection=sel)
    want_sp, want_rla = naive(q, k, v, params)
    o_sp, o_rla, _ = run_reference(q[None], k[None], v[None], params, query_chunk=16)
    assert (o_sp[0] - want_sp).abs().max() < 1e-10
    assert (o_rla[0] - want_rla).abs().max() < 1e-10
    assert want_rla.abs().max() > 0.1  # the budget is exceeded: the residual term is exercised


def test_gradients_match_bruteforce_fp64():
    torch.manual_seed(1)
    HQ, H, T, D = 4, 2, 40, 8
    params = SPLAParams(block_size=8, top_k_blocks=3, num_sink_blocks=1, num_local_blocks=1, selection="taylor")
    q = torch.randn(HQ, T, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(H, T, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(H, T, D, dtype=torch.float64, requires_grad=True)
    w1, w2 = torch.randn(HQ, T, D, dtype=torch.float64), torch.randn(HQ, T, D, dtype=torch.float64)
    a_sp, a_rla = naive(q, k, v, params)
    ga = torch.autograd.grad((a_sp * w1).sum() + (a_rla * w2).sum(), (q, k, v))
    b_sp, b_rla, _ = run_reference(q[None], k[None], v[None], params, query_chunk=8)
    gb = torch.autograd.grad((b_sp[0] * w1).sum() + (b_rla[0] * w2).sum(), (q, k, v))
    for x, y in zip(ga, gb, strict=True):
        assert x.abs().max() > 0
        assert (x - y).abs().max() / x.abs().max() < 1e-10


def test_rla_is_exactly_zero_when_budget_covers_context():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8)
    params = SPLAParams(block_size=8, top_k_blocks=4, num_sink_blocks=1, num_local_blocks=2)
    o_sp, o_rla, _ = run_reference(q, k, v, params)
    assert torch.equal(o_rla, torch.zeros_like(o_rla))
    dense = torch.softmax((q.view(1, 2, 2, 32, 8) @ k[:, :, None].transpose(-1, -2)) / 8**0.5
                          + torch.full((32, 32), float("-inf")).triu(1), -1) @ v[:, :, None]
    assert (o_sp - dense.reshape(1, 4, 32, 8)).abs().max() < 1e-5


def test_left_padding_is_invisible():
    """A row with p padding slots in front gives the same outputs as the row alone."""
    torch.manual_seed(3)
    HQ, H, T, D, p = 4, 2, 45, 8, 11
    params = SPLAParams(block_size=8, top_k_blocks=3, num_sink_blocks=1, num_local_blocks=1)
    q, k, v = torch.randn(1, HQ, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    alone = run_reference(q, k, v, params)
    pad = lambda x: torch.cat([torch.randn(1, x.shape[1], p, D) * 5, x], dim=2)  # noqa: E731
    pos = torch.cat([torch.full((1, p), -1), torch.arange(T)[None]], dim=1)
    padded = run_reference(pad(q), pad(k), pad(v), params, pos_q=pos, pos_k=pos)
    for a, b in zip(alone[:2], padded[:2], strict=True):
        assert (a - b[:, :, p:]).abs().max() < 1e-5
        assert torch.equal(b[:, :, :p], torch.zeros_like(b[:, :, :p]))
    assert (alone[2] - padded[2]).abs().max() < 1e-4  # Sbar ignores padding


def test_block_stats_running_sums_equal_recomputation():
    torch.manual_seed(4)
    k = torch.randn(2, 50, 3, 8)  # [B, T, H, D]
    pos = torch.arange(50).expand(2, 50)
    whole = BlockStats.empty(2, 3, 8, "cpu").add(k, pos, 8)
    inc = BlockStats.empty(2, 3, 8, "cpu")
    for t in range(50):
        inc = inc.add(k[:, t:t + 1], pos[:, t:t + 1], 8)
    for a, b in ((whole.sum_k, inc.sum_k), (whole.sum_k2, inc.sum_k2), (whole.count, inc.count)):
        assert torch.allclose(a, b, atol=1e-5)
    assert whole.count[0].tolist() == [8.0] * 6 + [2.0]


@pytest.mark.parametrize("read", ["blocks", "all", "auto"])
@pytest.mark.parametrize("use_rla", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_decode_gather_equals_the_masked_form(case, use_rla, read):
    """One decode step reading only the selected blocks (`spla_decode_gather`, the torch path's decode),
    or every cached key under the selected blocks' mask (read="all", without the residual term), equals
    the masked form that reads every key: left-padded rows, fp64, and through `spla_attention`'s
    dispatch, which takes it for one token per row without gradients."""
    from subquadratic.kernels.spla import spla_attention, spla_decode_gather
    from subquadratic.kernels.utils import slot_offsets

    HQ, H, T, bs, top, sink, local, selection = case
    g = torch.Generator().manual_seed(T + HQ)
    B, D = 3, 16
    q, k, v = (torch.randn(B, T, n, D, generator=g, dtype=torch.float64) for n in (HQ, H, H))
    pos = torch.arange(T).expand(B, T).clone()
    for row, pad in ((1, 7), (2, T - 5)):  # left padding; the last row is shorter than a block or two
        pos[row, :pad] = -1
        pos[row, pad:] = torch.arange(T - pad)
    stats = BlockStats.empty(B, H, D, "cpu", torch.float64).add(k, pos, bs)
    sbar = torch.randn(B, H, D, D, generator=g, dtype=torch.float64) * 0.1
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local,
                        selection=selection, use_rla=use_rla)
    args = (q[:, -1:], k, v, pos[:, -1:], pos, stats, sbar, params)
    gather = (q[:, -1:], k, v, pos[:, -1:], stats, sbar, slot_offsets(pos), params)
    if read == "all" and use_rla:
        with pytest.raises(ValueError, match="residual term"):
            spla_decode_gather(*gather, read=read)
        return
    want = spla_parallel(*args)
    got = spla_decode_gather(*gather, read=read)
    routed = spla_attention(*args, backend="torch")
    other = spla_decode_gather(*gather, read="blocks" if read == "all" else "all") if not use_rla else got
    assert want[0].abs().max() > 0.1
    for a, b, c in zip(got, want, routed, strict=True):
        if b is None:
            assert a is None and c is None
            continue
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-9), (a - b).abs().max()
        if read == "auto":
            assert torch.equal(a, c)
    assert torch.allclose(got[0], other[0], atol=1e-10, rtol=1e-9)


def test_decode_reads_every_key_where_that_is_cheaper(monkeypatch):
    """read="auto" reads every cached key in place (no gathers) when the slots are at most
    READ_ALL_RATIO times the selected ones and the residual term is off, else gathers the blocks."""
    from subquadratic.kernels.spla import gather
    from subquadratic.kernels.utils import slot_offsets

    calls = []
    real = gather.gather_slots
    monkeypatch.setattr(gather, "gather_slots", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(5)
    B, H, D, bs, top = 1, 2, 8, 4, 4
    for S, use_rla, gathers in ((30, False, 0), (33, False, 2), (30, True, 2)):
        calls.clear()
        q, k, v = (torch.randn(B, S, n, D, generator=g) for n in (2 * H, H, H))
        pos = torch.arange(S)[None]
        stats = BlockStats.empty(B, H, D, "cpu").add(k, pos, bs)
        params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=1, num_local_blocks=1, use_rla=use_rla)
        gather.spla_decode_gather(q[:, -1:], k, v, pos[:, -1:], stats, torch.zeros(B, H, D, D), slot_offsets(pos),
                                  params)
        assert len(calls) == gathers, (S, use_rla)


def test_gather_slots_equals_gather_on_every_layout():
    """`gather_slots` (rows of the storage where the strides allow, else indexing) equals torch.gather
    on a contiguous [B, H, S, D] cache, on a slice of a larger buffer (a cache with spare room), on the
    transpose of a [B, S, H, D] tensor and on a tensor expanded over the batch."""
    from subquadratic.kernels.spla.gather import gather_slots

    g = torch.Generator().manual_seed(0)
    B, H, S, D, L = 2, 3, 21, 8, 11
    buf = torch.randn(B, H, S + 9, D, generator=g)
    layouts = [buf[:, :, :S].contiguous(), buf[:, :, :S], torch.randn(B, S, H, D, generator=g).transpose(1, 2),
               torch.randn(1, H, S, D, generator=g).expand(B, H, S, D)]
    slot = torch.randint(0, S, (B, H, L), generator=g)
    for x in layouts:
        want = x.gather(2, slot[..., None].expand(-1, -1, -1, D))
        assert torch.equal(gather_slots(x, slot), want)


@pytest.mark.parametrize("case", CASES)
def test_attention_weights_match_bruteforce_fp64(case):
    """`return_weights`: the exact branch's softmax over each query's selected causal keys, zeros
    elsewhere ([B, HQ, T, S]), equals the definition's weights; o_sp is computed from them and equals
    the SDPA form's, and gradients through the weights (and the outputs) equal the definition's."""
    HQ, H, T, bs, top, sink, local, sel = case
    torch.manual_seed(hash(case) % 997)
    D = 8
    q = torch.randn(HQ, T, D, dtype=torch.float64, requires_grad=True)
    k = (torch.randn(H, T, D, dtype=torch.float64) * 1.5).requires_grad_()
    v = torch.randn(H, T, D, dtype=torch.float64, requires_grad=True)
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local, selection=sel)
    want_sp, want_rla, want_w = spla_naive(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), params,
                                           return_weights=True)
    pos = torch.arange(T)[None]
    stats = BlockStats.empty(1, H, D, "cpu", torch.float64).add(k.transpose(0, 1)[None], pos, bs)
    sbar = torch.zeros(1, H, D, D, dtype=torch.float64)
    o_sp, o_rla, _, w = spla_parallel(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], pos,
                                      pos, stats, sbar, params, return_weights=True)
    assert w.shape == (1, HQ, T, T) and w.dtype == q.dtype
    assert (w[0] - want_w).abs().max() < 1e-12
    assert (o_sp[0] - want_sp).abs().max() < 1e-10 and (o_rla[0] - want_rla).abs().max() < 1e-10
    plain = spla_parallel(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], pos, pos, stats,
                          sbar, params)
    assert (plain[0] - o_sp).abs().max() < 1e-10
    assert torch.all(w[0].triu(1) == 0) and torch.allclose(w[0].sum(-1), torch.ones(HQ, T, dtype=torch.float64))
    assert (w[0] == 0).any(-1)[:, -1].all()  # beyond the budget: the last query leaves keys out
    r1, r2 = torch.randn_like(want_w), torch.randn_like(want_sp)
    ga = torch.autograd.grad((want_w * r1).sum() + (want_sp * r2).sum(), (q, k, v))
    gb = torch.autograd.grad((w[0] * r1).sum() + (o_sp[0] * r2).sum(), (q, k, v))
    for x, y in zip(ga, gb, strict=True):
        assert x.abs().max() > 0 and (x - y).abs().max() / x.abs().max() < 1e-10


def test_attention_weights_of_padded_rows_and_a_cached_prefix():
    """Left padding: the padded slots get no weight and padded queries none at all; new tokens on a
    cached prefix see the cached keys' slots (S = cached + new)."""
    torch.manual_seed(5)
    HQ, H, T, D, p = 4, 2, 30, 8, 6
    params = SPLAParams(block_size=4, top_k_blocks=3, num_sink_blocks=1, num_local_blocks=1)
    q, k, v = torch.randn(1, T, HQ, D), torch.randn(1, T, H, D), torch.randn(1, T, H, D)
    pos = torch.arange(T)[None]
    stats = BlockStats.empty(1, H, D, "cpu").add(k, pos, 4)
    *_, alone = spla_parallel(q, k, v, pos, pos, stats, torch.zeros(1, H, D, D), params, return_weights=True)
    pad = lambda x: torch.cat([torch.randn(1, p, *x.shape[2:]) * 5, x], dim=1)  # noqa: E731
    ppos = torch.cat([torch.full((1, p), -1), pos], dim=1)
    pstats = BlockStats.empty(1, H, D, "cpu").add(pad(k), ppos, 4)
    *_, padded = spla_parallel(pad(q), pad(k), pad(v), ppos, ppos, pstats, torch.zeros(1, H, D, D), params,
                               return_weights=True)
    assert torch.equal(padded[:, :, :p], torch.zeros_like(padded[:, :, :p]))
    assert torch.equal(padded[:, :, :, :p], torch.zeros_like(padded[:, :, :, :p]))
    torch.testing.assert_close(padded[:, :, p:, p:], alone, rtol=1e-5, atol=1e-6)
    *_, tail = spla_parallel(q[:, -5:], k, v, pos[:, -5:], pos, stats, torch.zeros(1, H, D, D), params,
                             return_weights=True)  # 5 new tokens after 25 cached ones
    assert tail.shape == (1, HQ, 5, T)
    torch.testing.assert_close(tail, alone[:, :, -5:], rtol=1e-5, atol=1e-6)
