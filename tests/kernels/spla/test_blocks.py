"""Block-major SPLA sparse kernels (`triton_blocks`, backward in `triton_blocks_bwd`) against an fp64
brute-force definition of the sparse branch and the correction (written here: a dense mask of the
selected causal keys) and against the per-token kernels (`triton_parallel.SparseAttention`): values
of o_sp and otilde and the gradients dq, dk, dv on fresh random inputs with poisoned outputs. Left and
right padded rows, a cached prefix (koff and positions not starting at slot 0), GQA groups 1..8,
with and without the residual term, -1 entries and blocks after the token in idx, the current
partial block, T not a multiple of the block; plans small enough that a key's run spans several
segments, a segment several chunks and the pairs several windows. The inversion (both sorts) is
checked against the selection directly. On CPU under TRITON_INTERPRET=1 at small shapes; the gpu
tests compare with the per-token kernels at moderate sizes."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.spla import triton_blocks, triton_blocks_common, triton_parallel  # noqa: E402
from subquadratic.kernels.spla.stats import feature_map  # noqa: E402

# the fp64 relative error of the tile tests (tests/kernels/conftest.py poisons every output)
from .test_tile import rel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(B, HQ, H, T, D, bs, nsel, *, pad=0, prefix=0, seed=0, dtype=torch.float32, drop=0.2,
              future=0.0, device=DEV):
    """Random q [B, HQ, T, D], k, v [B, H, S, D] views of token-major tensors (S = prefix + T plus
    right-padding slack), qpos [B, T], koff [B] and a random selection idx [B, T, H, nsel]: the
    current and previous blocks and block 0 first, then distinct random past blocks; entries dropped
    to -1 with probability `drop`, a block after the token's own with probability `future`, and junk
    in the rows of padded queries. pad > 0: the last row is left-padded by pad slots; pad < 0: its
    last -pad queries are padding (right padding)."""
    g = torch.Generator().manual_seed(seed)
    S = prefix + T + 5
    q = torch.randn(B, T, HQ, D, generator=g, dtype=torch.float64).transpose(1, 2)
    k, v = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    koff = torch.zeros(B, dtype=torch.int32)
    qpos = (prefix + torch.arange(T)).expand(B, T).clone()
    if pad > 0:
        koff[-1] = pad
        qpos[-1] = prefix + torch.arange(T) - pad
        qpos[-1, : max(0, pad - prefix)] = -1
    elif pad < 0:
        qpos[-1, pad:] = -1
    NB = -(-S // bs)
    idx = torch.full((B, T, H, nsel), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            tp = int(qpos[b, t])
            for h in range(H):
                if tp < 0:  # padded query: junk that must be ignored
                    idx[b, t, h] = torch.randint(-1, NB, (nsel,), generator=g, dtype=torch.int32)
                    continue
                cur = tp // bs
                chosen = [x for x in dict.fromkeys([cur, cur - 1, 0]) if x >= 0]
                rest = [x for x in torch.randperm(cur + 1, generator=g).tolist() if x not in chosen]
                chosen = (chosen + rest)[:nsel]
                for i, blk in enumerate(chosen):
                    r = torch.rand((), generator=g).item()
                    if r < drop:
                        blk = -1
                    elif r < drop + future and cur + 1 < NB:
                        blk = int(torch.randint(cur + 1, NB, (), generator=g))
                    idx[b, t, h, i] = blk
    cast = dict(device=device, dtype=dtype)
    return (q.to(**cast), k.to(**cast), v.to(**cast), idx.to(device), qpos.to(torch.int32).to(device),
            koff.to(device))


def definition(q, k, v, idx, qpos, koff, bs, use_rla):
    """fp64 brute force: per (b, head, t) the keys of the selected blocks with position <= t; o_sp the
    softmax over them (0 where there is none), otilde = sum_j (phi(q).phi(k_j)) v_j over them."""
    B, HQ, T, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = HQ // H
    kpos = torch.arange(S, device=q.device)[None, :] - koff.long()[:, None]  # [B, S]
    blk = torch.where(kpos >= 0, kpos // bs, -2)
    sel = (idx.long()[:, :, :, :, None] == blk[:, None, None, None, :]).any(3)  # [B, T, H, S]
    causal = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qpos.long()[:, :, None])  # [B, T, S]
    allowed = (sel & causal[:, :, None, :] & (qpos >= 0)[:, :, None, None]).permute(0, 2, 1, 3)  # [B, H, T, S]
    allowed = allowed.repeat_interleave(G, dim=1)  # [B, HQ, T, S]
    kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = (q @ kk.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows without keys -> 0
    o = (p @ vv).transpose(1, 2)
    if not use_rla:
        return o, None
    a = (feature_map(q) @ feature_map(kk).transpose(-1, -2)) * allowed
    return o, (a @ vv).transpose(1, 2)


def weights(outs, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.device) for x in outs if x is not None]


def loss(outs, w):
    return sum((x.double() * wi).sum() for x, wi in zip([x for x in outs if x is not None], w, strict=True))


# exact fp32 dots ("ieee") on every device: the fp32 cases hold the same bound on the GPU (tf32 there by default)
TINY = dict(rows=16, bwd_rows=16, lse_rows=32, seg_chunks=2, bwd_seg_chunks=2, window=16, dkdv_keys=16,
            bwd="split3", precision="ieee")

CASES = [  # B, HQ, H, T, D, block, nsel, use_rla, pad, prefix
    (2, 4, 2, 45, 16, 16, 3, True, 7, 0),  # G = 2, left padding, T not a multiple of the block
    (1, 3, 1, 40, 32, 16, 3, True, 0, 0),  # G = 3 (rows not a multiple of G)
    (1, 4, 1, 50, 16, 16, 4, True, 0, 9),  # G = 4, cached prefix
    (2, 2, 2, 37, 16, 16, 3, True, -11, 0),  # G = 1, right padding
    (1, 8, 1, 33, 16, 16, 3, False, 0, 0),  # G = 8, SPA (no residual term)
    (2, 4, 2, 30, 16, 16, 2, False, 5, 13),  # left padding over a prefix, no residual term
    (1, 4, 2, 70, 16, 32, 3, True, 0, 0),  # blocks of 32: the dk/dv kernel over two parts of a block
]


@pytest.mark.parametrize("sort", ["sort", "count"])
def test_pairs_and_segments_invert_the_selection(sort):
    B, HQ, H, T, D, bs, nsel = 2, 2, 2, 50, 16, 16, 4
    q, k, v, idx, qpos, koff = make_case(B, HQ, H, T, D, bs, nsel, pad=-7, seed=3, future=0.1)
    NB, window = -(-k.shape[2] // bs), 16
    bp = triton_blocks.block_pairs(idx, qpos, NB, bs, window, sort)
    NW = -(-T // window)
    want = {}
    for e in range(idx.numel()):
        b, rest = divmod(e, T * H * nsel)
        t, rest = divmod(rest, H * nsel)
        h, i = divmod(rest, nsel)
        blk, tp = int(idx[b, t, h, i]), int(qpos[b, t])
        if blk >= 0 and 0 <= blk * bs <= tp:
            want.setdefault(((b * H + h) * NW + t // window) * NB + blk, []).append(e)
    starts = bp.starts.tolist()
    pairs = bp.pairs.tolist()
    assert starts[-1] == sum(map(len, want.values()))
    for key in range(len(starts) - 1):
        got = pairs[starts[key]:starts[key + 1]]
        if sort == "count":
            got = sorted(got)
        assert got == want.get(key, []), key
    for n in (1, 3, 64):  # the kernel equals its PyTorch form (one segment a pair .. one a key)
        for a, b in zip(triton_blocks.segments(bp, n), triton_blocks_common.segments_reference(bp, n), strict=True):
            assert a.dtype == torch.int32 and torch.equal(a, b), n
    seg_pairs = 5
    key, first, count = (x.tolist() for x in triton_blocks.segments(bp, seg_pairs))
    covered = []
    for kk, f, c in zip(key, first, count, strict=True):
        assert 0 <= c <= seg_pairs
        if c:
            assert starts[kk] <= f and f + c <= starts[kk + 1]
            covered += range(f, f + c)
    assert sorted(covered) == list(range(starts[-1]))  # every valid pair in exactly one segment


def test_segments_over_many_keys():
    """More keys than one tile of the segment kernel (the running count carried over tiles), runs of
    0 .. 40 pairs, one key with thousands (a sink block): the kernel equals its PyTorch form."""
    g = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 41, (2500,), generator=g)
    counts[1700] = 5000
    starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).to(DEV)
    bp = triton_blocks.BlockPairs(torch.arange(int(starts[-1]), dtype=torch.int32, device=DEV), starts, 16, 1, 2500)
    for n in (7, 32):
        got, want = triton_blocks.segments(bp, n), triton_blocks_common.segments_reference(bp, n)
        assert int((got[2] > 0).sum()) == int(((counts + n - 1) // n).sum())
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), n


def run(case, grad, *, plan_kw=TINY, dtype=torch.float32, seed=None):
    B, HQ, H, T, D, bs, nsel, use_rla, pad, prefix = case
    seed = sum(case[:7]) if seed is None else seed
    q, k, v, idx, qpos, koff = make_case(B, HQ, H, T, D, bs, nsel, pad=pad, prefix=prefix, seed=seed, future=0.1)
    plan = triton_blocks.blocks_plan(HQ // H, D, DEV, use_rla, **plan_kw)
    ins = [x.detach().double().requires_grad_(grad) for x in (q, k, v)]
    want = definition(*ins, idx, qpos, koff, bs, use_rla)
    outs = [x.detach().to(dtype).requires_grad_(grad) for x in (q, k, v)]
    got = triton_blocks.blocks_sparse_attention(*outs, idx, qpos, koff, use_rla, bs, plan=plan)
    return ins, want, outs, got, (idx, qpos, koff, use_rla, bs)


@pytest.mark.parametrize("forward", ["split", "atomic"])
@pytest.mark.parametrize("case,atomics", [(c, "scalar") for c in CASES] + [(CASES[1], "v4-split")])
def test_forward_matches_definition(case, atomics, forward):
    """Both forward forms: one pass of per-slot partials and their combine, or two passes with atomics."""
    _, want, _, got, _ = run(case, False, plan_kw=dict(TINY, atomics=atomics, forward=forward))
    assert (got[1] is None) == (want[1] is None)
    for name, a, b in zip(["o_sp", "otilde"], got, want, strict=True):
        if b is not None:
            assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
            assert rel(a, b) <= 1e-5, (name, rel(a, b))


@pytest.mark.parametrize("case,atomics", [(c, "scalar") for c in CASES] + [(CASES[1], "v4-split")])
def test_split_forward_adds_the_correction_with_atomics(case, atomics):
    """rla_sum="atomic": the split form adds each pair's otilde to its token's row (no otilde partials):
    the fp64 definition within fp32 rounding, O as with the partials."""
    _, want, _, got, _ = run(case, False, plan_kw=dict(TINY, atomics=atomics, forward="split", rla_sum="atomic"))
    _, _, _, kept, _ = run(case, False, plan_kw=dict(TINY, atomics=atomics, forward="split"))
    assert (got[1] is None) == (want[1] is None)
    assert torch.equal(got[0], kept[0])
    for name, a, b in zip(["o_sp", "otilde"], got, want, strict=True):
        if b is not None:
            assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
            assert rel(a, b) <= 1e-5, (name, rel(a, b))


def epilogue_case(case, seed=0):
    """An `RLAEpilogue` for `case`'s shapes: random o_lin, dropped rows (padded queries always), weight."""
    B, HQ, H, T, D = case[:5]
    g = torch.Generator().manual_seed(seed)
    drop = torch.rand(B, T, H, generator=g) < 0.3
    return triton_blocks_common.RLAEpilogue(torch.randn(B, T, HQ, D, generator=g).to(DEV),
                                            drop.to(DEV), (0.5 + torch.rand(HQ, D, generator=g)).to(DEV), 1e-5)


def epilogue_definition(want, epi, qpos):
    """fp64: o_sp + RMSNorm_weight(o_lin - otilde), the residual term 0 on dropped rows and padded queries."""
    o_sp, otilde = want
    drop = (epi.drop.to(o_sp.device) | (qpos < 0)[:, :, None]).repeat_interleave(o_sp.shape[2] // epi.drop.shape[2], 2)
    x = (epi.o_lin.double() - otilde).masked_fill(drop[..., None], 0.0)
    return o_sp + x * torch.rsqrt(x.square().mean(-1, keepdim=True) + epi.eps) * epi.weight.double()


@pytest.mark.parametrize("over", [{}, dict(forward="atomic"), dict(rla_sum="atomic"), dict(atomics="v4-split")])
@pytest.mark.parametrize("case", [c for c in CASES if c[7]])
def test_the_epilogue_adds_the_normed_residual_term(case, over):
    """With an `RLAEpilogue` the call returns (o_sp + RMSNorm_weight(o_rla), None): the combine computes it
    on the split form (the atomic forms in PyTorch after); the fp64 definition within fp32 rounding, and
    on a GPU within bf16 rounding for bf16 inputs, whose o comes back in bf16 (the CPU interpreter does
    not run these kernels' bf16 dots faithfully)."""
    B, HQ, H, T, D, bs, nsel, use_rla, pad, prefix = case
    q, k, v, idx, qpos, koff = make_case(B, HQ, H, T, D, bs, nsel, pad=pad, prefix=prefix, seed=sum(case[:7]),
                                         future=0.1)
    epi = epilogue_case(case)
    epi = epi._replace(drop=epi.drop | (qpos < 0)[:, :, None])  # the caller's dropped rows include padding
    want = epilogue_definition(definition(q.double(), k.double(), v.double(), idx, qpos, koff, bs, True), epi, qpos)
    plan = triton_blocks.blocks_plan(HQ // H, D, DEV, True, **dict(TINY, **over))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2))[:2 if DEV == "cuda" else 1]:
        ins = [x.to(dtype) for x in (q, k, v)]
        o, none = triton_blocks.blocks_sparse_attention(*ins, idx, qpos, koff, True, bs, plan=plan, o_dtype=dtype,
                                                        epilogue=epi)
        assert none is None and o.dtype == dtype and torch.isfinite(o).all()
        assert rel(o, want) <= tol, (dtype, rel(o, want))


def test_the_epilogue_over_query_chunks_and_refused_with_gradients(monkeypatch):
    """Past SPLIT_BYTES the epilogue's rows go with each query chunk; a call with gradients or without the
    residual term refuses an epilogue with a reason."""
    case = CASES[0]
    B, HQ, H, T, D, bs, nsel, use_rla, pad, prefix = case
    q, k, v, idx, qpos, koff = make_case(B, HQ, H, T, D, bs, nsel, pad=pad, seed=3, future=0.1)
    epi = epilogue_case(case, seed=1)
    epi = epi._replace(drop=epi.drop | (qpos < 0)[:, :, None])
    want = epilogue_definition(definition(q.double(), k.double(), v.double(), idx, qpos, koff, bs, True), epi, qpos)
    chunks = []
    real_split = triton_blocks.split_pass
    monkeypatch.setattr(triton_blocks, "split_pass",
                        lambda q, *a, **kw: chunks.append(q.shape[2]) or real_split(q, *a, **kw))
    monkeypatch.setattr(triton_blocks, "SPLIT_BYTES", B * T * HQ * nsel * D * 8 // 4)
    plan = triton_blocks.blocks_plan(HQ // H, D, DEV, True, **TINY)
    o, _ = triton_blocks.blocks_sparse_attention(q, k, v, idx, qpos, koff, True, bs, plan=plan, epilogue=epi)
    assert len(chunks) >= 4 and sum(chunks) == T and rel(o, want) <= 1e-5
    with pytest.raises(ValueError, match="without gradients"):
        triton_blocks.blocks_sparse_attention(q.requires_grad_(), k, v, idx, qpos, koff, True, bs, epilogue=epi)
    with pytest.raises(ValueError, match="residual term"):
        triton_blocks.blocks_sparse_attention(q.detach(), k, v, idx, qpos, koff, False, bs, epilogue=epi)


BWD = [(c, {}) for c in CASES[:4] + CASES[5:]] + [  # (case, plan overrides of TINY)
    (CASES[0], dict(rla_sum="atomic")), (CASES[6], dict(rla_sum="atomic", atomics="v4-split")),
    (CASES[0], dict(bwd="split")), (CASES[4], dict(bwd="split")), (CASES[6], dict(bwd="split", dq_keys=16)),
    (CASES[2], dict(atomics="v4-split")), (CASES[3], dict(bwd="split", atomics="v4-split")),
    (CASES[5], dict(bwd="split", window=8)), (CASES[0], dict(forward="atomic")), (CASES[4], dict(forward="atomic")),
    # dq per pair: stored (whole blocks), or added per part of the block into the pairs' rows
    (CASES[0], dict(dq="pairs")), (CASES[4], dict(dq="pairs", bwd="split")), (CASES[6], dict(dq="pairs", dq_keys=16)),
    (CASES[2], dict(dq="pairs", atomics="v4-split", dq_keys=16)),
    # dq, dk and dv in one pass over whole blocks (with and without the residual term, G 1..8, blocks of 32)
    *((c, dict(bwd="fused")) for c in CASES), (CASES[1], dict(bwd="fused", atomics="v4-split")),
    (CASES[0], dict(bwd="fused", dq="pairs"))]


@pytest.mark.parametrize("case,over", BWD)
def test_backward_matches_definition(case, over):
    ins, want, outs, got, _ = run(case, True, plan_kw=dict(TINY, **over))
    w = weights(want)
    loss(want, w).backward()
    loss(got, w).backward()
    for name, a, b in zip(["dq", "dk", "dv"], outs, ins, strict=True):
        assert a.grad.shape == a.shape and torch.isfinite(a.grad).all(), name
        assert rel(a.grad, b.grad) <= 1e-5, (name, rel(a.grad, b.grad))


def test_dq_per_pair_past_its_budget_adds_with_atomics(monkeypatch):
    """A backward whose per-pair dq rows would pass DQ_PAIR_BYTES adds dq with atomics (same values)."""
    from subquadratic.kernels.spla import triton_blocks_bwd

    monkeypatch.setattr(triton_blocks_bwd, "DQ_PAIR_BYTES", 0)
    launched = []
    real = triton_blocks_bwd.blocks_bwd_dq_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                launched.append(kw["PAIR_ROWS"])
                return real[grid](*a, **kw)
            return launch

    monkeypatch.setattr(triton_blocks_bwd, "blocks_bwd_dq_kernel", Spy())
    ins, want, outs, got, _ = run(CASES[0], True, plan_kw=dict(TINY, dq="pairs"))
    w = weights(want)
    loss(want, w).backward()
    loss(got, w).backward()
    assert launched == [False]
    assert rel(outs[0].grad, ins[0].grad) <= 1e-5


def test_split_forward_past_its_budget_with_a_backward_takes_the_atomic_form(monkeypatch):
    """A call with a backward whose partials would pass SPLIT_BYTES runs the two atomic passes (same values)."""
    calls = []
    real = triton_blocks.lse_pass
    monkeypatch.setattr(triton_blocks, "lse_pass", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    _, want, _, got, _ = run(CASES[0], True)
    assert not calls and rel(got[0], want[0]) <= 1e-5
    monkeypatch.setattr(triton_blocks, "SPLIT_BYTES", 0)
    _, want, _, got, _ = run(CASES[0], True)
    assert calls and rel(got[0], want[0]) <= 1e-5 and rel(got[1], want[1]) <= 1e-5


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]])
def test_split_forward_past_its_budget_without_a_backward_runs_over_query_chunks(case, monkeypatch):
    """A call without a backward whose partials would pass SPLIT_BYTES runs the split form over
    consecutive query chunks that each stay within it (no atomic pass): the definition's values."""
    B, HQ, H, T, D, bs, nsel, use_rla = case[:8]
    need = B * T * HQ * nsel * D * 4 * (2 if use_rla else 1)  # fp32 partials of all T rows
    lse_calls, chunks = [], []
    real_lse, real_split = triton_blocks.lse_pass, triton_blocks.split_pass
    monkeypatch.setattr(triton_blocks, "lse_pass", lambda *a, **kw: lse_calls.append(1) or real_lse(*a, **kw))
    monkeypatch.setattr(triton_blocks, "split_pass",
                        lambda q, *a, **kw: chunks.append(q.shape[2]) or real_split(q, *a, **kw))
    monkeypatch.setattr(triton_blocks, "SPLIT_BYTES", need // 4)
    _, want, _, got, _ = run(case, False)
    assert not lse_calls and len(chunks) >= 4 and sum(chunks) == T and max(chunks) <= T // 4 + 1, chunks
    for a, b in zip(got, want, strict=True):
        if b is not None:
            assert a.shape == b.shape and rel(a, b) <= 1e-5, rel(a, b)


@pytest.mark.parametrize("case", [CASES[0], CASES[5]])
def test_bf16_partials(case):
    """Partials stored in bf16: the fp64 definition to bf16's rounding (each slot's O_i and otilde_i
    rounded once), fp32 outputs."""
    _, want, _, got, _ = run(case, False, plan_kw=dict(TINY, partials="bf16"))
    for a, b in zip(got, want, strict=True):
        if b is not None:
            assert a.dtype == torch.float32 and 1e-5 < rel(a, b) <= 1e-2, rel(a, b)


def test_fp64_inputs_run_in_fp32_and_return_fp64_gradients():
    ins, want, outs, got, _ = run(CASES[0], True, dtype=torch.float64)
    w = weights(want)
    loss(want, w).backward()
    loss(got, w).backward()
    assert got[0].dtype == torch.float32
    for a, b in zip(outs, ins, strict=True):
        assert a.grad.dtype == torch.float64 and rel(a.grad, b.grad) <= 1e-5


TOKEN_CASES = [(2, 4, 2, 24, 16, 16, 3, True, 5, 0), (2, 2, 2, 22, 16, 16, 3, True, -5, 0),
               (1, 8, 1, 20, 16, 16, 2, False, 0, 3)]  # small: the per-token kernels are slow in the interpreter


@pytest.mark.parametrize("case,sort", [(TOKEN_CASES[0], "sort"), (TOKEN_CASES[0], "count"), (TOKEN_CASES[1], "sort"),
                                       (TOKEN_CASES[2], "count")])
def test_matches_the_per_token_kernels(case, sort):
    """Values and gradients equal the per-token kernels' (`SparseAttention`) on the same operands."""
    _, _, outs, got, (idx, qpos, koff, use_rla, bs) = run(case, True, plan_kw=dict(TINY, sort=sort))
    ref_in = [x.detach().clone().requires_grad_() for x in outs]
    ref = triton_parallel.SparseAttention.apply(*ref_in, idx, qpos, koff, use_rla, bs, False)
    for a, b in zip(got, ref, strict=True):
        assert (a is None) == (b is None)
        if b is not None:
            assert rel(a, b) <= 1e-5
    w = weights(ref)
    loss(ref, w).backward()
    loss(got, w).backward()
    for a, b in zip(outs, ref_in, strict=True):
        assert rel(a.grad, b.grad) <= 1e-5


def test_default_plan_and_no_grad_forward():
    """The default plan (one segment per key, one window) without autograd: the forward alone (exact
    fp32 dots, the default of fp32 inputs off CUDA)."""
    case = CASES[2]
    B, HQ, H, T, D, bs, nsel, use_rla, pad, prefix = case
    q, k, v, idx, qpos, koff = make_case(B, HQ, H, T, D, bs, nsel, prefix=prefix, seed=11)
    want = definition(q.double(), k.double(), v.double(), idx, qpos, koff, bs, use_rla)
    with torch.no_grad():
        got = triton_blocks.blocks_sparse_attention(q, k, v, idx, qpos, koff, use_rla, bs, precision="ieee")
    assert rel(got[0], want[0]) <= 1e-5 and rel(got[1], want[1]) <= 1e-5


def test_bad_inputs_are_refused_with_a_reason():
    q, k, v, idx, qpos, koff = make_case(1, 2, 1, 20, 16, 16, 2)
    with pytest.raises(ValueError, match="idx must be int32"):
        triton_blocks.blocks_sparse_attention(q, k, v, idx.long(), qpos, koff, True, 16)
    with pytest.raises(ValueError, match="sort must be"):
        triton_blocks.blocks_plan(2, 16, DEV, sort="radix")
    with pytest.raises(ValueError, match="precision must be"):
        triton_blocks.blocks_plan(2, 16, DEV, precision="bf16")
    with pytest.raises(ValueError, match="atomics must be"):
        triton_blocks.blocks_plan(2, 16, DEV, atomics="v8")
    with pytest.raises(ValueError, match="bwd must be"):
        triton_blocks.blocks_plan(2, 16, DEV, bwd="both")
    with pytest.raises(ValueError, match="forward must be"):
        triton_blocks.blocks_plan(2, 16, DEV, forward="fused")
    with pytest.raises(ValueError, match="rla_sum must be"):
        triton_blocks.blocks_plan(2, 16, DEV, rla_sum="sum")
    with pytest.raises(ValueError, match="partials must be"):
        triton_blocks.blocks_plan(2, 16, DEV, partials="fp8")
    with pytest.raises(ValueError, match="dq must be"):
        triton_blocks.blocks_plan(2, 16, DEV, dq="sorted")
    # vector atomics only where each tile has a group of four floats per thread
    assert triton_blocks.blocks_plan(2, 16, DEV, rows=16, atomics="v4").atomics == "scalar"
    assert triton_blocks.blocks_plan(2, 64, DEV, atomics="v4").atomics == "v4"
    assert triton_blocks.partial_dtype(q.bfloat16(), triton_blocks.blocks_plan(2, 16, DEV)) == torch.bfloat16
    assert triton_blocks.partial_dtype(q.half(), triton_blocks.blocks_plan(2, 16, DEV)) == torch.float16
    assert triton_blocks.partial_dtype(q, triton_blocks.blocks_plan(2, 16, DEV)) == torch.float32
    with pytest.raises(ValueError, match="rows must be a power of two"):
        triton_blocks.blocks_plan(2, 16, DEV, rows=48)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("G,D", [(1, 64), (4, 128), (8, 64), (16, 128), (4, 256), (2, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_matches_the_per_token_kernels(G, D, dtype):
    """Moderate sizes on the GPU (the default plans; tf32 for fp32): values and gradients of the
    block-major kernels vs the per-token kernels on the same operands and vs the fp64 definition."""
    B, H, T, bs, nsel = 1, 2, 1536, 64, 8
    q, k, v, idx, qpos, koff = make_case(B, H * G, H, T, D, bs, nsel, pad=-100, seed=G + D, dtype=dtype,
                                         drop=0.05, future=0.02)
    ins = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = definition(*ins, idx, qpos, koff, bs, True)
    outs = [x.detach().requires_grad_() for x in (q, k, v)]
    got = triton_blocks.blocks_sparse_attention(*outs, idx, qpos, koff, True, bs)
    ref_in = [x.detach().clone().requires_grad_() for x in outs]
    ref = triton_parallel.SparseAttention.apply(*ref_in, idx, qpos, koff, True, bs, False)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3  # tf32 dots for fp32
    for a, b, c in zip(got, ref, want, strict=True):
        assert torch.isfinite(a).all() and rel(a, c) <= tol and rel(a, b) <= tol
    w = weights(want)
    loss(want, w).backward()
    loss(got, w).backward()
    # the per-token dk/dv kernel needs more shared memory than the H200 has for fp32 at d256
    per_token = not (dtype == torch.float32 and D >= 256)
    if per_token:
        loss(ref, w).backward()
    for a, b, c in zip(outs, ref_in, ins, strict=True):
        assert torch.isfinite(a.grad).all()
        assert rel(a.grad, c.grad) <= tol, rel(a.grad, c.grad)
        assert not per_token or rel(a.grad, b.grad) <= tol, rel(a.grad, b.grad)
