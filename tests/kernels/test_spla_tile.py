"""Query-tile SPLA kernels (kernels/spla/triton_tile.py) vs the fp64 reference: values of o_sp and
o_rla and the gradients dq, dk, dv, through the same host path as the current kernels
(`triton_ops.spla_attention_triton` with the tile kernels in place of `select_indices`,
`sparse_forward` and `SparseAttention`), and the tile selection against `reference.select_blocks`.
GQA groups 1..8 (16 on CUDA), left and right padding, cached prefixes, budgets smaller than the
context. On CPU under TRITON_INTERPRET=1 at small shapes."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.spla import BlockStats, spla_attention_reference, triton_ops, triton_tile  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def tile_kernels(monkeypatch):
    """Poisoned outputs everywhere, and the tile kernels in place of the per-token sparse kernel and
    of the two-launch selection."""
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)
    monkeypatch.setattr(triton_tile, "POISON_OUTPUTS", True)

    def fwd(q, k, v, idx, qpos, koff, use_rla, block_size, num_splits=1, phik=None):
        return triton_tile.tile_sparse_forward(q, k, v, idx, qpos, koff, use_rla, block_size, phik=phik)[:3]

    monkeypatch.setattr(triton_ops, "sparse_forward", fwd)
    monkeypatch.setattr(triton_ops, "select_indices", triton_tile.select_indices_fast)
    monkeypatch.setattr(triton_ops, "SparseAttention", types.SimpleNamespace(apply=triton_tile.tile_sparse_attention))


def make(B, HQ, H, S, D, bs, pad=0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, S, D, generator=g).to(DEV, dtype) for n in (HQ, H, H))
    pos = torch.arange(S).expand(B, S).clone()
    if pad > 0:  # left padding of the last row
        pos[-1, :pad] = -1
        pos[-1, pad:] = torch.arange(S - pad)
    elif pad < 0:  # right padding of the last row
        pos[-1, pad:] = -1
    pos = pos.to(DEV)
    stats = BlockStats.empty(B, H, D, DEV).add(k, pos, bs)
    sbar = torch.randn(B, H, D, D, generator=g).to(DEV) * 0.1
    return q, k, v, pos, stats, sbar


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


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


def run_case(case, grad, precompute_phik=False):
    B, HQ, H, S, D, bs, top, sink, local, use_rla, pad, prefix = case
    q, k, v, pos, stats, sbar = make(B, HQ, H, S, D, bs, pad, seed=sum(case[:5]))
    q, qpos = q[:, :, prefix:], pos[:, prefix:]
    cfg = dict(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local, use_rla=use_rla)
    sbar0 = sbar if prefix == 0 else sbar * 0  # the reference's Sbar covers the cached tokens only
    if prefix:
        phik = torch.softmax(k[:, :, :prefix].double(), -1) * (pos[:, None, :prefix, None] >= 0)
        sbar0 = torch.einsum("bhsd,bhse->bhde", phik, v[:, :, :prefix].double()).float()
    ins = [x.detach().double().requires_grad_(grad) for x in (q, k, v)]
    want = spla_attention_reference(*ins, qpos, pos, stats, sbar0.double(), **cfg)
    outs = [x.detach().requires_grad_(grad) for x in (q, k, v)]
    old = triton_ops.PHIK_PRECOMPUTE_MIN_TQ
    triton_ops.PHIK_PRECOMPUTE_MIN_TQ = 1 if precompute_phik else 1 << 30
    try:
        got = triton_ops.spla_attention_triton(*outs, qpos, pos, stats, sbar0, **cfg)
    finally:
        triton_ops.PHIK_PRECOMPUTE_MIN_TQ = old
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
            continue
        assert torch.isfinite(a).all()
        assert rel(a, b) <= 1e-4 or (a.double() - b).abs().max() <= 1e-5
    if top * bs >= S:
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    if grad:
        g = torch.Generator().manual_seed(1)
        w = [torch.randn(x.shape, generator=g, dtype=torch.float64).to(DEV) for x in want[:2] if x is not None]
        sum((x * wi).sum() for x, wi in zip(want[:2], w, strict=False)).backward()
        sum((x.double() * wi).sum() for x, wi in zip(got[:2], w, strict=False)).backward()
        for a, b in zip(outs, ins, strict=True):
            assert torch.isfinite(a.grad).all()
            assert rel(a.grad, b.grad) <= 1e-4, rel(a.grad, b.grad)


@pytest.mark.parametrize("case", CASES)
def test_tile_forward_matches_reference(case):
    run_case(case, grad=False)


@pytest.mark.parametrize("case", CASES[::2] + CASES[1::4])
def test_tile_backward_matches_reference(case):
    run_case(case, grad=True, precompute_phik=case[3] == 1)


def test_union_lists_are_the_union_of_the_selection():
    g = torch.Generator().manual_seed(3)
    B, T, H, K, NB, BM = 2, 45, 3, 5, 12, 8
    idx = torch.randint(-1, NB, (B, T, H, K), generator=g, dtype=torch.int32).to(DEV)
    ul, ub, uc, NU = triton_tile.tile_union(idx, NB, BM)
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


@pytest.mark.skipif(DEV != "cuda", reason="real shapes on the GPU")
@pytest.mark.parametrize("G,D", [(1, 64), (4, 128), (8, 64), (16, 128)])
def test_tile_bf16_real_shapes_on_gpu(G, D):
    case = (1, 2 * G, 2, 2048, D, 64, 8, 1, 2, True, 0, 0)
    B, HQ, H, S, D, bs, top, sink, local, use_rla, pad, prefix = case
    q, k, v, pos, stats, sbar = make(B, HQ, H, S, D, bs, seed=G, dtype=torch.bfloat16)
    stats = BlockStats.empty(B, H, D, DEV).add(k.float(), pos, bs)
    cfg = dict(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local, use_rla=use_rla)
    want = spla_attention_reference(q.float(), k.float(), v.float(), pos, pos, stats, sbar, **cfg)
    got = triton_ops.spla_attention_triton(q, k, v, pos, pos, stats, sbar, **cfg)
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) <= 1e-2


@pytest.mark.parametrize("selection", ["taylor", "mean"])
@pytest.mark.parametrize("case", [(2, 4, 2, 90, 16, 16, 4, 1, 2, 7), (1, 3, 1, 64, 32, 16, 3, 0, 1, 0),
                                  (1, 8, 2, 100, 16, 16, 3, 1, 1, -9), (1, 1, 1, 70, 32, 16, 2, 2, 1, 0)])
@pytest.mark.parametrize("max_scores", [None, 40])
def test_select_indices_fast_selects_the_reference_blocks(case, selection, max_scores):
    """The one-launch tile selection vs reference.select_blocks, whole or in query chunks."""
    from subquadratic.kernels.spla import select_blocks

    B, HQ, H, T, D, bs, top, sink, local, pad = case
    q, k, v, pos, stats, sbar = make(B, HQ, H, T, D, bs, pad, seed=T + D)
    cfg = dict(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local, selection=selection)
    want = select_blocks(q, stats, pos, **cfg)  # [B, H, T, NB]
    kw = {} if max_scores is None else dict(max_scores=max_scores * B * H * stats.num_blocks)
    idx = triton_tile.select_indices_fast(q, stats, pos, **cfg, **kw).long()  # [B, T, H, K]
    got = torch.zeros(B, T, H, want.shape[-1] + 1, dtype=torch.bool, device=DEV)
    got.scatter_(-1, torch.where(idx >= 0, idx, want.shape[-1]), True)
    assert torch.equal(got[..., :-1].permute(0, 2, 1, 3), want)
    kept = torch.sort(idx, -1).values
    assert (kept[..., 1:] != kept[..., :-1])[kept[..., 1:] >= 0].all()  # no block twice
