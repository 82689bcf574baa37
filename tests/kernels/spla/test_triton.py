"""SPLA Triton kernels (the "triton" and "triton_decode" plans of `spla_attention`) vs the PyTorch
form `spla_parallel`: values of prefill and split-K decode, and the gradients of the backward
kernels, GQA groups 1..16, left and right padding, with and without the residual term, poisoned
outputs (tests/kernels/conftest.py). On CPU it runs under TRITON_INTERPRET=1 at small shapes (the
plans made for a CUDA device, run on CPU tensors); on CUDA at the shapes given."""

from __future__ import annotations

import pytest
import torch

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before Triton is imported
pytest.importorskip("triton")
from subquadratic.kernels.spla import (  # noqa: E402
    BlockStats,
    Launch,
    SPLAParams,
    append_token_triton,
    plan_spla,
    queries_by_block,
    select_blocks,
    select_indices,
    spla_attention,
    spla_parallel,
    triton_unsupported,
)
from subquadratic.kernels.utils import slot_offsets  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def triton_plan(q, k, v, params, precision="ieee", **fields):
    """The plan of `spla_attention(backend="triton")` on CUDA for these inputs, with `fields` set; the
    device is data, so on the CPU the same plan runs the kernels in the interpreter. Exact fp32 dots
    unless `precision` says otherwise: the comparisons are at fp32 tolerances, and on a GPU the
    default ("auto") takes TF32."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return plan_spla(q.shape, k.shape, q.dtype, "cuda", params, backend="triton", grad=grad, precision=precision,
                     **fields)


def spla_triton(q, k, v, q_pos, k_pos, stats, sbar, params, **fields):
    """SPLA through the Triton kernels of `triton_plan(..., **fields)`."""
    return spla_attention(q, k, v, q_pos, k_pos, stats, sbar, params, plan=triton_plan(q, k, v, params, **fields))


def make(B, HQ, H, T, D, bs, pad=0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, n, D, generator=g).to(DEV, dtype) for n in (HQ, H, H))  # [B, T, heads, D]
    pos = torch.arange(T).expand(B, T).clone()
    if pad > 0:  # left padding of the last row
        pos[-1, :pad] = -1
        pos[-1, pad:] = torch.arange(T - pad)
    elif pad < 0:  # right padding of the last row
        pos[-1, pad:] = -1
    pos = pos.to(DEV)
    stats = BlockStats.empty(B, H, D, DEV).add(k, pos, bs)
    sbar = torch.randn(B, H, D, D, generator=g).to(DEV) * 0.1
    return q, k, v, pos, stats, sbar


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


CASES = [  # B, HQ, H, T, D, block, top_k, sink, local, use_rla, pad
    (2, 4, 2, 70, 16, 16, 3, 1, 1, True, 9),
    (1, 3, 1, 50, 32, 16, 2, 1, 1, True, 0),  # G = 3 (padded rows)
    (1, 8, 1, 48, 16, 16, 2, 0, 1, False, 0),  # G = 8, SPA ablation
    (2, 2, 2, 40, 16, 16, 8, 1, 2, True, 5),  # budget covers everything: o_rla exactly 0
    (2, 4, 2, 60, 16, 16, 2, 1, 1, True, -13),  # right padding (training batches)
]


@pytest.mark.parametrize("case", CASES)
def test_prefill_and_decode_match_reference(case):
    B, HQ, H, T, D, bs, top, sink, local, use_rla, pad = case
    q, k, v, pos, stats, sbar = make(B, HQ, H, T, D, bs, pad, seed=sum(case[:5]))
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local, use_rla=use_rla)
    want = spla_parallel(q, k, v, pos, pos, stats, sbar, params)
    got = spla_triton(q, k, v, pos, pos, stats, sbar, params)
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
            continue
        assert torch.isfinite(a).all()
        assert rel(a, b) <= 1e-4 or (a - b).abs().max() <= 1e-5
    if top * bs >= T:
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    # one decode step: the fused decode kernels, and the general kernel with the blocks split in two
    want = spla_parallel(q[:, -1:], k, v, pos[:, -1:], pos, stats, sbar, params)
    for fields in ({}, dict(path="triton", splits=2)):
        got = spla_triton(q[:, -1:], k, v, pos[:, -1:], pos, stats, sbar, params, **fields)
        for a, b in zip(got, want, strict=True):
            if b is not None:
                assert rel(a, b) <= 1e-4 or (a - b).abs().max() <= 1e-5, fields
    # the decode launches in other settings: scores as one dot, one block or all blocks per program
    for dot, per in ((True, 1), (False, 64)):
        launch = Launch(score_dot=dot, decode_blocks_per_split=per)
        got = spla_triton(q[:, -1:], k, v, pos[:, -1:], pos, stats, sbar, params, launch=launch)
        for a, b in zip(got, want, strict=True):
            if b is not None:
                assert rel(a, b) <= 1e-4 or (a - b).abs().max() <= 1e-5, (dot, per)


def forward_backward(fn, q, k, v, pos, stats, sbar, grads, dtype, params, **fields):
    """Values and input gradients of sum(o_sp * g_sp) + sum(o_rla * g_rla) in `dtype`."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    stats = BlockStats(*(x.to(torch.float64 if dtype == torch.float64 else torch.float32)
                         for x in (stats.sum_k, stats.sum_k2, stats.count)))
    o_sp, o_rla, _ = fn(q, k, v, pos, pos, stats, sbar.to(stats.sum_k.dtype), params, **fields)
    loss = (o_sp.double() * grads[0]).sum()
    if o_rla is not None:
        loss = loss + (o_rla.double() * grads[1]).sum()
    loss.backward()
    return [o_sp, o_rla, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("precompute_phik", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_backward_matches_reference(case, precompute_phik):
    """dq, dk, dv of the Triton backward (fp32 inputs) against the fp64 reference's autograd, with
    phi(k) from the loaded tiles or precomputed once per key."""
    B, HQ, H, T, D, bs, top, sink, local, use_rla, pad = case
    q, k, v, pos, stats, sbar = make(B, HQ, H, T, D, bs, pad, seed=sum(case[:5]) + 1)
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local, use_rla=use_rla)
    g = torch.Generator().manual_seed(T)
    grads = [torch.randn(B, T, HQ, D, generator=g, dtype=torch.float64).to(DEV) for _ in range(2)]
    want = forward_backward(spla_parallel, q, k, v, pos, stats, sbar, grads, torch.float64, params)
    got = forward_backward(spla_triton, q, k, v, pos, stats, sbar, grads, torch.float32, params,
                           precompute_phik=precompute_phik)
    for name, a, b in zip(["o_sp", "o_rla", "dq", "dk", "dv"], got, want, strict=True):
        if b is None:
            assert a is None
            continue
        assert torch.isfinite(a).all(), name
        assert rel(a, b) <= 1e-4, (name, rel(a, b))
    if pad:  # padded query and key slots get exactly zero gradient
        pads = slice(0, pad) if pad > 0 else slice(T + pad, T)
        assert torch.equal(got[2][-1, pads], torch.zeros_like(got[2][-1, pads]))
        assert torch.equal(got[3][-1, pads], torch.zeros_like(got[3][-1, pads]))


@pytest.mark.parametrize("case", [c for c in CASES if c[-1] == 0])
def test_causal_inputs_skip_the_padding_masks_exactly(case):
    """Unpadded inputs with causal=True (`SequenceInfo.causal`: the padding masks are skipped): the
    values and gradients of the fp64 reference, and exactly those of causal=False."""
    B, HQ, H, T, D, bs, top, sink, local, use_rla, _ = case
    q, k, v, pos, stats, sbar = make(B, HQ, H, T, D, bs, seed=sum(case[:5]) + 2)
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local, use_rla=use_rla)
    g = torch.Generator().manual_seed(T + 1)
    grads = [torch.randn(B, T, HQ, D, generator=g, dtype=torch.float64).to(DEV) for _ in range(2)]

    def fn(q, k, v, q_pos, k_pos, stats, sbar, params, causal):
        return spla_attention(q, k, v, q_pos, k_pos, stats, sbar, params, causal=causal,
                              plan=triton_plan(q, k, v, params))

    want = forward_backward(spla_parallel, q, k, v, pos, stats, sbar, grads, torch.float64, params)
    got = forward_backward(fn, q, k, v, pos, stats, sbar, grads, torch.float32, params, causal=True)
    masked = forward_backward(fn, q, k, v, pos, stats, sbar, grads, torch.float32, params, causal=False)
    for name, a, b, c in zip(["o_sp", "o_rla", "dq", "dk", "dv"], got, want, masked, strict=True):
        if b is None:
            assert a is None and c is None
            continue
        assert torch.isfinite(a).all(), name
        assert rel(a, b) <= 1e-4, (name, rel(a, b))
        assert torch.equal(a, c), name


def test_queries_by_block_inverts_the_selection():
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(-1, 6, (2, 9, 3, 4), generator=g).to(DEV, torch.int32)
    toks, off = queries_by_block(idx, 6)
    assert off.shape == (2 * 3 * 6 + 1,) and off[-1] == (idx >= 0).sum()
    for b in range(2):
        for h in range(3):
            for n in range(6):
                row = (b * 3 + h) * 6 + n
                got = sorted(toks[off[row]:off[row + 1]].tolist())
                want = sorted(t for t in range(9) for x in idx[b, t, h].tolist() if x == n)
                assert got == want


@pytest.mark.parametrize("selection", ["taylor", "mean"])
@pytest.mark.parametrize("case", [(2, 4, 2, 90, 16, 16, 4, 1, 2, 7), (1, 3, 1, 64, 32, 16, 3, 0, 1, 0)])
@pytest.mark.parametrize("setting", [("tf32x3", True, None, True), ("ieee", False, 40, True), (None, None, 40, False)])
@pytest.mark.parametrize("topk_bn", [128, 2])
def test_selection_kernels_select_the_reference_blocks(case, selection, setting, topk_bn):
    """Scores (scoring kernel as one dot or elementwise sums, or matmuls) + group top-k kernel (its
    softmax passes over all blocks at once or in steps of 2), whole or in query chunks, vs the
    PyTorch select_blocks."""
    B, HQ, H, T, D, bs, top, sink, local, pad = case
    prec, use_dot, max_scores, use_kernel = setting
    launch = Launch(topk_bn=topk_bn) if prec is None else Launch(topk_bn=topk_bn, score_prec=prec, score_dot=use_dot)
    q, k, v, pos, stats, sbar = make(B, HQ, H, T, D, bs, pad, seed=T + D)
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local,
                        selection=selection)
    want = select_blocks(q, stats, pos, params)  # [B, H, T, NB]
    kw = {} if max_scores is None else dict(max_scores=max_scores * B * HQ)  # chunks of 40 queries
    idx = select_indices(q, stats, pos, params, matmul=not use_kernel, launch=launch, **kw).long()  # [B, T, H, K]
    got = torch.zeros(B, T, H, want.shape[-1] + 1, dtype=torch.bool, device=DEV)
    got.scatter_(-1, torch.where(idx >= 0, idx, want.shape[-1]), True)
    assert torch.equal(got[..., :-1].permute(0, 2, 1, 3), want)
    kept = torch.sort(idx, -1).values
    assert (kept[..., 1:] != kept[..., :-1])[kept[..., 1:] >= 0].all()  # no block twice


def test_slot_offsets():
    pos = torch.tensor([[-1, -1, 0, 1, 2], [0, 1, 2, -1, -1], [-1, 0, 1, -1, -1], [0, 1, 2, 3, 4]])
    assert slot_offsets(pos).tolist() == [2, 0, 1, 0]
    assert slot_offsets(torch.tensor([[0, 1, -1, 2, 3]])) is None  # padding in the middle
    assert slot_offsets(torch.tensor([[1, 0, 2]])) is None  # out of order


def test_dispatch_sends_unsupported_inputs_to_the_pytorch_form():
    """Padding in the middle of a row, head dims and block sizes the kernels do not take: the plan
    decides ("auto" -> the PyTorch form, "triton" -> an error); a given Triton plan refuses such rows."""
    q, k, v, pos, stats, sbar = make(1, 2, 1, 40, 16, 16)
    pos = pos.clone()
    pos[0, 10:15] = -1
    pos[0, 15:] = torch.arange(10, 35, device=DEV)
    assert slot_offsets(pos) is None
    assert "middle" in triton_unsupported(16, 16, consecutive=False)
    assert "head_dim" in triton_unsupported(24, 16)
    assert "block_size" in triton_unsupported(16, 8)
    assert triton_unsupported(64, 64) is None
    params = SPLAParams(block_size=16, top_k_blocks=2, num_sink_blocks=1, num_local_blocks=1)
    stats = BlockStats.empty(1, 1, 16, DEV).add(k, pos, 16)
    want = spla_parallel(q, k, v, pos, pos, stats, sbar, params)
    got = spla_attention(q, k, v, pos, pos, stats, sbar, params, backend="auto")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="consecutive"):
        spla_triton(q, k, v, pos, pos, stats, sbar, params)
    with pytest.raises(ValueError, match="middle"):
        plan_spla(q.shape, k.shape, q.dtype, "cuda", params, backend="triton", consecutive=False)
    with pytest.raises(ValueError):  # off CUDA, or padding in the middle on CUDA
        spla_attention(q, k, v, pos, pos, stats, sbar, params, backend="triton")
    with pytest.raises(ValueError, match="naive"):
        spla_attention(q, k, v, pos, pos, stats, sbar, params, backend="naive")


def stats_upto(k, pos, t, bs):
    return BlockStats.empty(k.shape[0], k.shape[2], k.shape[3], k.device, torch.float64).add(
        k[:, :t + 1].double(), pos[:, :t + 1], bs)


@pytest.mark.skipif(DEV != "cuda", reason="bf16 at real shapes needs the GPU")
@pytest.mark.parametrize("G", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("D", [64, 128])
def test_bf16_real_shapes_on_gpu(G, D):
    H, T = 2, 4096
    q, k, v, pos, stats, sbar = make(1, H * G, H, T, D, 64, seed=G + D, dtype=torch.bfloat16)
    params = SPLAParams(block_size=64, top_k_blocks=16, num_sink_blocks=1, num_local_blocks=2)
    stats64 = BlockStats(*(x.double() for x in (stats.sum_k, stats.sum_k2, stats.count)))
    want = spla_parallel(q.double(), k.double(), v.double(), pos, pos, stats64, sbar.double(), params)
    # the kernels on the exact selection (tile selection, fp32 scores): bf16 rounding only
    got = spla_triton(q, k, v, pos, pos, stats, sbar, params, select="tile")
    assert rel(got[0], want[0]) <= 1e-2 and rel(got[1], want[1]) <= 1e-2
    # the default's streamed selection scores in bf16 and picks another block for a few near-ties (its
    # recall is measured in test_select_stream): those tokens move the comparison, not the kernels
    got = spla_triton(q, k, v, pos, pos, stats, sbar, params)
    assert rel(got[0], want[0]) <= 6e-2 and rel(got[1], want[1]) <= 6e-2
    for b in range(1, 4):  # decode rows at several depths
        t = T - 1 - 997 * b
        sel = slice(t, t + 1)
        want = spla_parallel(q[:, sel].double(), k[:, :t + 1].double(), v[:, :t + 1].double(),
                             pos[:, sel], pos[:, :t + 1], stats_upto(k, pos, t, 64), sbar.double(), params)
        got = spla_triton(q[:, sel], k[:, :t + 1], v[:, :t + 1], pos[:, sel], pos[:, :t + 1],
                          stats_upto(k, pos, t, 64), sbar, params)
        assert rel(got[0], want[0]) <= 1e-2 and rel(got[1], want[1]) <= 1e-2
        assert (got[2] - want[2]).abs().max() <= 1e-3


@pytest.mark.skipif(DEV != "cuda", reason="the model takes the Triton path on CUDA only")
def test_model_on_gpu_uses_kernel_and_matches_reference():
    from subquadratic.modeling.base import CACHE_FIELD
    from tests.models.spla.tiny import tiny_spla

    # exact fp32 dots: the comparison below is at fp32 tolerances (the default on CUDA is TF32)
    model = tiny_spla(block_size=16, top_k_blocks=3, num_sink_blocks=1, num_local_blocks=1,
                      kernel_precision="ieee").cuda()
    x = torch.randint(1, 128, (2, 150), device="cuda")
    with torch.no_grad():
        want = model(x, use_cache=False).logits  # Triton path (auto on CUDA)
        model.config.kernel_backend = "torch"
        ref = model(x, use_cache=False).logits
        model.config.kernel_backend = "auto"
        out = model(x[:, :100], use_cache=True)
        cache, steps = getattr(out, CACHE_FIELD), [out.logits]
        for t in range(100, 150):
            out = model(x[:, t:t + 1], use_cache=True, **{CACHE_FIELD: cache})
            steps.append(out.logits)
    assert (want - ref).abs().max() <= 1e-3
    assert (torch.cat(steps, 1) - ref).abs().max() <= 1e-3


@pytest.mark.skipif(DEV != "cuda", reason="bf16 at real shapes needs the GPU")
@pytest.mark.parametrize("G", [1, 3, 4, 16])
@pytest.mark.parametrize("D", [64, 128])
def test_bf16_backward_real_shapes_on_gpu(G, D):
    H, T, B = 2, 2048, 2
    q, k, v, pos, stats, sbar = make(B, H * G, H, T, D, 64, pad=100, seed=G * D, dtype=torch.bfloat16)
    params = SPLAParams(block_size=64, top_k_blocks=8, num_sink_blocks=1, num_local_blocks=2)
    g = torch.Generator().manual_seed(G)
    grads = [torch.randn(B, T, H * G, D, generator=g, dtype=torch.float64).to(DEV) for _ in range(2)]
    want = forward_backward(spla_parallel, q, k, v, pos, stats, sbar, grads, torch.float64, params)
    # the exact selection (the streamed default's bf16 scores differ at near-ties: see the test above)
    got = forward_backward(spla_triton, q, k, v, pos, stats, sbar, grads, torch.bfloat16, params, select="tile")
    for name, a, b in zip(["o_sp", "o_rla", "dq", "dk", "dv"], got, want, strict=True):
        assert rel(a, b) <= 1e-2, (name, rel(a, b))


@pytest.mark.skipif(DEV != "cuda", reason="the model takes the Triton path on CUDA only")
def test_model_training_step_on_gpu_matches_reference():
    from tests.models.spla.tiny import tiny_spla

    # gamma random (tiny_spla), so the residual term reaches the loss; exact fp32 dots (fp32 tolerances)
    model = tiny_spla(block_size=16, top_k_blocks=3, num_sink_blocks=1, num_local_blocks=1,
                      kernel_precision="ieee").cuda().train()
    x = torch.randint(1, 128, (3, 150), device="cuda")
    mask = torch.ones_like(x)
    mask[1, :20] = 0  # left padding
    mask[2, -25:] = 0  # right padding
    labels = x.masked_fill(mask == 0, -100)
    grads = {}
    for backend in ("auto", "torch"):
        model.config.kernel_backend = backend
        model.zero_grad()
        loss = model(x, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads[backend] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert abs(grads["auto"][0] - grads["torch"][0]) <= 1e-4
    for name, g_ref in grads["torch"][1].items():
        assert rel(grads["auto"][1][name], g_ref) <= 1e-3, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_token_one_launch_equals_index_copy_and_block_sums(dtype):
    """A static cache's one-token write (key, value at their slot; real tokens into their block's
    sums and count) gives what index_copy_ and BlockStats.add_ give, padded rows included: the same
    bits, but for fp32 keys' squared sums, where the kernel may fuse the square into the add (FMA)."""
    from subquadratic.kernels.spla import append_token

    B, H, S, D, bs = 3, 2, 40, 16, 8
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(B, H, 1, D, generator=g).to(DEV, dtype) for _ in range(2))
    K, V = (torch.randn(B, H, S, D, generator=g).to(DEV, dtype) for _ in range(2))
    stats = BlockStats(*(torch.randn(*shape, generator=g).to(DEV) for shape in
                         ((B, H, S // bs, D), (B, H, S // bs, D), (B, S // bs))))
    slot, pos = torch.tensor([29], device=DEV), torch.tensor([[29], [-1], [21]], device=DEV)
    want = [x.clone() for x in (K, V, stats.sum_k, stats.sum_k2, stats.count)]
    append_token(*want[:2], BlockStats(*want[2:]), k, v, slot, pos, bs, backend="torch")
    one_launch = append_token if DEV == "cuda" else append_token_triton  # CPU: the interpreter
    one_launch(K, V, stats, k, v, slot, pos, bs)
    got = (K, V, stats.sum_k, stats.sum_k2, stats.count)
    for name, a, b in zip(("K", "V", "sum_k", "sum_k2", "count"), got, want, strict=True):
        if name == "sum_k2" and dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
        else:
            assert torch.equal(a, b), name
