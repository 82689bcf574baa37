"""SPLA prefill kernels through the real dispatch (`spla_attention` with the Triton plan of the
inputs, `test_triton.spla_triton`) vs the fp64 PyTorch form (`spla_parallel`): values of o_sp,
o_rla and Sbar and the gradients dq, dk, dv, for the three forms of the longer calls
(`SPLAPlan.form`: "blocks", the block-major kernels of `triton_blocks` that training takes; "tile",
the query-tile kernels of `triton_tile`; "token", the per-token kernels), poisoned outputs; the
one-launch tile selection (`select_indices_fast`) against `select_blocks`; the union lists of a
tile; the streamed selection through the plan. GQA groups 1..8 (16 on CUDA), left and right
padding, cached prefixes, budgets smaller than the context. On CPU under TRITON_INTERPRET=1 at small shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before Triton is imported
pytest.importorskip("triton")
from subquadratic.kernels.spla import (  # noqa: E402
    BlockStats,
    SPLAParams,
    select_blocks,
    select_indices_fast,
    spla_parallel,
    tile_union,
    triton_parallel,
)
from tests.conftest import count_calls  # noqa: E402

# the same random inputs and Triton plans as the per-token kernel tests
from .test_triton import make, spla_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
#: The entry point of each sparse form the executor runs (the per-token form runs `sparse_forward`,
#: with or without gradients), as `count_calls` takes them.
SPARSE_FORMS = {"blocks": (triton_parallel, "blocks_sparse_attention"),
                "tile": (triton_parallel, "tile_sparse_attention"), "token": (triton_parallel, "sparse_forward")}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Count the calls of each sparse form the executor runs."""
    return count_calls(monkeypatch, SPARSE_FORMS)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


CASES = [  # B, HQ, H, S, D, block, top_k, sink, local, use_rla, pad, cached prefix
    (2, 4, 2, 70, 16, 16, 3, 1, 1, True, 9, 0),  # G = 2, left padding
    (1, 3, 1, 50, 32, 16, 2, 1, 1, True, 0, 0),  # G = 3 (padded rows)
    (1, 4, 1, 80, 16, 16, 2, 1, 2, True, 0, 0),  # G = 4
    (1, 2, 2, 96, 32, 16, 3, 1, 1, True, 0, 0),  # G = 1
    (1, 8, 1, 48, 16, 16, 2, 0, 1, False, 0, 0),  # G = 8, SPA ablation
    (2, 2, 2, 40, 16, 16, 8, 1, 2, True, 5, 0),  # budget covers everything: o_rla exactly 0
    (2, 4, 2, 60, 16, 16, 2, 1, 1, True, -13, 0),  # right padding (training batches)
    (1, 4, 2, 90, 16, 16, 3, 1, 1, True, 0, 37),  # chunked prefill over a cached prefix
]


def run_case(case, grad, kernel, calls, precompute_phik=False):
    B, HQ, H, S, D, bs, top, sink, local, use_rla, pad, prefix = case
    q, k, v, pos, stats, sbar = make(B, HQ, H, S, D, bs, pad, seed=sum(case[:5]))
    q, qpos = q[:, prefix:], pos[:, prefix:]
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local, use_rla=use_rla)
    stats64 = BlockStats(*(x.double() for x in (stats.sum_k, stats.sum_k2, stats.count)))
    ins = [x.detach().double().requires_grad_(grad) for x in (q, k, v)]
    want = spla_parallel(*ins, qpos, pos, stats64, sbar.double(), params)
    outs = [x.detach().requires_grad_(grad) for x in (q, k, v)]
    got = spla_triton(*outs, qpos, pos, stats, sbar, params, form=kernel, precompute_phik=precompute_phik)
    assert calls[kernel] == 1 and sum(calls.values()) == 1, calls
    for name, a, b in zip(["o_sp", "o_rla", "sbar"], got, want, strict=True):
        if b is None:
            assert a is None
            continue
        assert torch.isfinite(a).all(), name
        assert rel(a, b) <= 1e-4 or (a.double() - b).abs().max() <= 1e-5, (name, rel(a, b))
    if top * bs >= S:
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    if grad:
        g = torch.Generator().manual_seed(1)
        w = [torch.randn(x.shape, generator=g, dtype=torch.float64).to(DEV) for x in want[:2] if x is not None]
        sum((x * wi).sum() for x, wi in zip(want[:2], w, strict=False)).backward()
        sum((x.double() * wi).sum() for x, wi in zip(got[:2], w, strict=False)).backward()
        for name, a, b in zip(["dq", "dk", "dv"], outs, ins, strict=True):
            assert torch.isfinite(a.grad).all(), name
            assert rel(a.grad, b.grad) <= 1e-4, (name, rel(a.grad, b.grad))
    return got, outs


@pytest.mark.parametrize("case", CASES)
def test_tile_forward_matches_reference(case, kernel_calls):
    run_case(case, False, "tile", kernel_calls)


@pytest.mark.parametrize("case", CASES[::2] + CASES[1::4])
def test_tile_backward_matches_reference(case, kernel_calls):
    run_case(case, True, "tile", kernel_calls, precompute_phik=case[3] == 1)


@pytest.mark.parametrize("case", CASES[6:])
@pytest.mark.parametrize("grad", [False, True])
def test_token_kernels_match_reference(case, grad, kernel_calls):
    """form="token": the per-token kernels on the same calls."""
    run_case(case, grad, "token", kernel_calls)


@pytest.mark.parametrize("case,grad", [(CASES[0], True), (CASES[4], True), (CASES[6], True), (CASES[7], True),
                                       (CASES[1], False), (CASES[5], False)])
def test_blocks_kernels_match_reference(case, grad, kernel_calls):
    """form="blocks" (what training takes): values and gradients against the fp64 reference."""
    run_case(case, grad, "blocks", kernel_calls)


def test_blocks_kernels_equal_the_token_kernels(kernel_calls):
    """Values and gradients of form "blocks" and form "token" on the same inputs (G = 2, left padding)."""
    case = (1, 4, 2, 40, 16, 16, 2, 1, 1, True, 5, 0)
    got, outs = run_case(case, True, "blocks", kernel_calls)
    for c in kernel_calls:
        kernel_calls[c] = 0
    token, token_outs = run_case(case, True, "token", kernel_calls)
    for a, b in zip(got, token, strict=True):
        assert rel(a, b) <= 1e-5 or (a.double() - b.double()).abs().max() <= 1e-6
    for a, b in zip(outs, token_outs, strict=True):
        assert rel(a.grad, b.grad) <= 1e-5


def test_the_plan_takes_the_blocks_kernels_with_gradients(kernel_calls):
    """Without a form given: 16 new tokens with gradients run the block-major kernels (training),
    without gradients the tile kernels (prefill)."""
    q, k, v, pos, stats, sbar = make(1, 4, 2, 50, 16, 16, seed=6)
    params = SPLAParams(block_size=16, top_k_blocks=2, num_sink_blocks=1, num_local_blocks=1)
    qs = q[:, -16:].clone().requires_grad_()
    o_sp, o_rla, _ = spla_triton(qs, k, v, pos[:, -16:], pos, stats, sbar, params)
    (o_sp.sum() + o_rla.sum()).backward()
    assert kernel_calls == {"blocks": 1, "tile": 0, "token": 0} and torch.isfinite(qs.grad).all()
    with torch.no_grad():
        spla_triton(qs, k, v, pos[:, -16:], pos, stats, sbar, params)
    assert kernel_calls == {"blocks": 1, "tile": 1, "token": 0}


def test_streamed_selection_through_the_plan(monkeypatch):
    """select="stream" runs `select_indices_stream` and gives the reference's values (exact fp32
    scores: the same blocks on these inputs, whose scores are far from ties)."""
    calls = []
    real = triton_parallel.select_indices_stream
    monkeypatch.setattr(triton_parallel, "select_indices_stream",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    B, HQ, H, S, D, bs, top, sink, local, use_rla, pad, _ = CASES[0]
    q, k, v, pos, stats, sbar = make(B, HQ, H, S, D, bs, pad, seed=11)
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local)
    want = spla_parallel(q.double(), k.double(), v.double(), pos, pos,
                         BlockStats(*(x.double() for x in (stats.sum_k, stats.sum_k2, stats.count))),
                         sbar.double(), params)
    got = spla_triton(q, k, v, pos, pos, stats, sbar, params, select="stream", select_prec="ieee")
    assert calls == [{"precision": "ieee"}]
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) <= 1e-4


def test_short_calls_take_the_per_token_kernels(kernel_calls):
    """The plan's own choice without gradients: the tile kernels from 16 new tokens, the per-token
    kernels below."""
    q, k, v, pos, stats, sbar = make(1, 4, 2, 50, 16, 16, seed=5)
    params = SPLAParams(block_size=16, top_k_blocks=2, num_sink_blocks=1, num_local_blocks=1)
    for tq in (15, 16):
        want = spla_parallel(q[:, -tq:].double(), k.double(), v.double(), pos[:, -tq:], pos,
                             BlockStats(*(x.double() for x in (stats.sum_k, stats.sum_k2, stats.count))),
                             sbar.double(), params)
        got = spla_triton(q[:, -tq:], k, v, pos[:, -tq:], pos, stats, sbar, params)
        assert rel(got[0], want[0]) <= 1e-4 and rel(got[1], want[1]) <= 1e-4
    assert kernel_calls == {"blocks": 0, "tile": 1, "token": 1}


def test_union_lists_are_the_union_of_the_selection():
    g = torch.Generator().manual_seed(3)
    B, T, H, K, NB, BM = 2, 45, 3, 5, 12, 8
    idx = torch.randint(-1, NB, (B, T, H, K), generator=g, dtype=torch.int32).to(DEV)
    ul, ub, uc, NU = tile_union(idx, NB, BM)
    for bh in range(B * H):
        b, h = divmod(bh, H)
        for tile in range(ul.shape[1]):
            toks = idx[b, tile * BM:(tile + 1) * BM, h]  # [<=BM, K]
            blocks = sorted({int(x) for x in toks.flatten() if x >= 0})
            n = int(uc[bh, tile])
            assert ul[bh, tile, :n].tolist() == blocks
            for u, blk in enumerate(blocks):
                want = sum(1 << m for m in range(toks.shape[0]) if (toks[m] == blk).any())
                assert int(ub[bh, tile, u]) & 0xFFFFFFFF == want


@pytest.mark.parametrize("selection", ["taylor", "mean"])
@pytest.mark.parametrize("case", [(2, 4, 2, 90, 16, 16, 4, 1, 2, 7), (1, 3, 1, 64, 32, 16, 3, 0, 1, 0),
                                  (1, 8, 2, 100, 16, 16, 3, 1, 1, -9), (1, 1, 1, 70, 32, 16, 2, 2, 1, 0)])
@pytest.mark.parametrize("max_scores", [None, 40])
def test_select_indices_fast_selects_the_reference_blocks(case, selection, max_scores):
    """The one-launch tile selection vs select_blocks, whole or in query chunks."""
    B, HQ, H, T, D, bs, top, sink, local, pad = case
    q, k, v, pos, stats, sbar = make(B, HQ, H, T, D, bs, pad, seed=T + D)
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local,
                        selection=selection)
    want = select_blocks(q, stats, pos, params)  # [B, H, T, NB]
    kw = {} if max_scores is None else dict(max_scores=max_scores * B * H * stats.num_blocks)
    idx = select_indices_fast(q, stats, pos, params, **kw).long()  # [B, T, H, K]
    got = torch.zeros(B, T, H, want.shape[-1] + 1, dtype=torch.bool, device=DEV)
    got.scatter_(-1, torch.where(idx >= 0, idx, want.shape[-1]), True)
    assert torch.equal(got[..., :-1].permute(0, 2, 1, 3), want)
    kept = torch.sort(idx, -1).values
    assert (kept[..., 1:] != kept[..., :-1])[kept[..., 1:] >= 0].all()  # no block twice


@pytest.mark.skipif(DEV != "cuda", reason="real shapes on the GPU")
@pytest.mark.parametrize("kernel", ["tile", "token"])
@pytest.mark.parametrize("G,D", [(1, 64), (4, 128), (8, 64), (16, 128)])
def test_bf16_real_shapes_on_gpu(G, D, kernel, kernel_calls):
    """bf16 values and gradients at 2k tokens through the dispatch vs the fp64 PyTorch form."""
    B, H, S, bs = 1, 2, 2048, 64
    q, k, v, pos, stats, sbar = make(B, H * G, H, S, D, bs, seed=G, dtype=torch.bfloat16)
    stats = BlockStats.empty(B, H, D, DEV).add(k.float(), pos, bs)
    stats64 = BlockStats(*(x.double() for x in (stats.sum_k, stats.sum_k2, stats.count)))
    params = SPLAParams(block_size=bs, top_k_blocks=8, num_sink_blocks=1, num_local_blocks=2)
    ins = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = spla_parallel(*ins, pos, pos, stats64, sbar.double(), params)
    outs = [x.detach().requires_grad_() for x in (q, k, v)]
    got = spla_triton(*outs, pos, pos, stats, sbar, params, form=kernel)
    assert kernel_calls[kernel] == 1
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) <= 1e-2
    g = [torch.randn_like(x) for x in want[:2]]
    torch.autograd.backward(want[:2], g)
    torch.autograd.backward(got[:2], [x.to(got[0].dtype) for x in g])
    for a, b in zip(outs, ins, strict=True):
        assert rel(a.grad, b.grad) <= 1e-2


@pytest.mark.parametrize("tile_max,form", [(0.0, "blocks"), (1e9, "tile")])
def test_the_union_form_picks_by_the_measured_union(monkeypatch, kernel_calls, tile_max, form):
    """A long prefill call without gradients or residual term plans form "union" (with the term:
    block-major): it measures its query tiles' unions and runs the block-major kernels past
    UNION_TILE_MAX blocks per tile, the tile kernels below, with the reference's values either way
    (chunked prefill over a cached prefix; the term computed, the union form asked for)."""
    from subquadratic.kernels.spla import plan as plan_mod
    from subquadratic.kernels.spla import plan_spla

    monkeypatch.setattr(plan_mod, "UNION_MIN_TQ", 16)
    monkeypatch.setattr(plan_mod, "UNION_MIN_BLOCKS", 2)
    monkeypatch.setattr(triton_parallel, "UNION_TILE_MAX", tile_max)
    params = SPLAParams(block_size=16, top_k_blocks=3, num_sink_blocks=1, num_local_blocks=1)
    no_rla = dataclasses.replace(params, use_rla=False)
    assert plan_spla((1, 53, 4, 16), (1, 90, 2, 16), torch.float32, "cuda", no_rla).form == "union"
    assert plan_spla((1, 53, 4, 16), (1, 90, 2, 16), torch.float32, "cuda", params).form == "blocks"
    assert plan_spla((1, 53, 4, 16), (1, 90, 2, 16), torch.float32, "cuda", params, grad=True).form == "blocks"
    case = (1, 4, 2, 90, 16, 16, 3, 1, 1, True, 0, 37)
    q, k, v, pos, stats, sbar = make(*case[:6], case[10], seed=sum(case[:5]))
    q, qpos = q[:, 37:], pos[:, 37:]
    stats64 = BlockStats(*(x.double() for x in (stats.sum_k, stats.sum_k2, stats.count)))
    want = spla_parallel(q.double(), k.double(), v.double(), qpos, pos, stats64, sbar.double(), params)
    with torch.no_grad():
        got = spla_triton(q, k, v, qpos, pos, stats, sbar, params, form="union")
    assert kernel_calls[form] == 1 and sum(kernel_calls.values()) == 1, kernel_calls
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) <= 1e-4


def test_a_union_hint_reads_host_tensors_at_once():
    """Off CUDA there is nothing to overlap: each layer decides by its own measurement."""
    from subquadratic.kernels.spla.plan import UnionHint

    hint = UnionHint()
    assert hint.decide(torch.tensor(3.0)) == 3.0 and hint.decide(torch.tensor(70.0)) == 70.0
    assert hint.pending is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_union_hint_hands_each_layers_measurement_to_the_next():
    """On CUDA the first layer of a forward reads its own mean union; each later one the layer's before
    it (copied without blocking, read after that layer's event), so a given input always gets the same
    forms and only the first read waits for the queue."""
    from subquadratic.kernels.spla.plan import UnionHint

    hint = UnionHint()
    means = [torch.tensor(v, device="cuda") for v in (5.0, 90.0, 12.0)]
    assert [hint.decide(m) for m in means] == [5.0, 5.0, 90.0]
    assert float(hint.pending[0]) == 12.0
