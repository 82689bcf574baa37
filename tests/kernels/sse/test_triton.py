"""SSE Triton kernels vs the fp64 PyTorch oracles: the SSE op (`sse_triton` vs `sse_recurrent`, K = 1
and 2, padded tokens, gradients through the router probs, gates and states; the varlen GLA kernels
it calls have their tests in tests/kernels/gla) and the decode kernel (vs `sse_recurrent`,
untouched partitions bit-identical). Kernel outputs start as NaN, so anything left unwritten fails. On CPU it runs
under TRITON_INTERPRET=1 at small shapes; on CUDA the `gpu` tests run bf16 at real shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before Triton is imported
pytest.importorskip("triton")
from subquadratic.kernels.sse import SSEState, router_topk, sse_attention, sse_recurrent, sse_varlen  # noqa: E402
from subquadratic.kernels.sse.triton_sse import sse_decode_triton, sse_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(x, ref):
    return ((x.double().cpu() - ref.double().cpu()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def loss_of(outs):
    g = torch.Generator().manual_seed(123)
    return sum((y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device)).sum() for y in outs)


# ---------------------------------------------------------------------------
# SSE
# ---------------------------------------------------------------------------


def sse_inputs(B, T, H, D, Dv, N, seed, pad=0):
    gen = torch.Generator().manual_seed(seed)
    q1, q2 = randn(gen, B, T, H, D), randn(gen, B, T, H, D)
    k1, k2 = randn(gen, B, T, H, D) / D**0.5, randn(gen, B, T, H, D) / D**0.5
    v = randn(gen, B, T, H, Dv)
    g1, g2 = Fn.logsigmoid(randn(gen, B, T, H, D) + 2), Fn.logsigmoid(randn(gen, B, T, H, D) + 1)
    logits = randn(gen, B, T, N)
    valid = torch.ones(B, T, dtype=torch.bool)
    if pad:  # padded tail of the last row: sel False, q / k / v and gates zero
        valid[-1, T - pad:] = False
        for x in (q1, q2, k1, k2, v, g1, g2):
            x[-1, T - pad:] = 0
    st = (randn(gen, B, H, D, Dv), randn(gen, B, N, H, D, Dv))
    return [q1, k1, q2, k2, v, g1, g2, logits], st, valid


def run_sse(fn, inputs, st, valid, topk, dtype):
    xs = [x.detach().to(DEV, dtype).clone().requires_grad_() for x in inputs]
    sts = [x.detach().to(DEV, dtype if dtype == torch.float64 else torch.float32).clone().requires_grad_()
           for x in st]
    probs, sel = router_topk(xs[7], topk, valid.to(DEV))
    o, new = fn(*xs[:7], probs, sel, SSEState(*sts))
    loss_of([o, new.shared, new.parts]).backward()
    return [o, new.shared, new.parts], [x.grad for x in xs + sts]


@pytest.mark.parametrize("topk,chunk,pad,dv", [(1, 16, 5, 16), (2, 32, 0, 16), (1, 16, 3, 24)])
def test_sse_values_and_grads(topk, chunk, pad, dv):
    inputs, st, valid = sse_inputs(2, 37, 2, 16, dv, 3, seed=topk, pad=pad)
    ref_o, ref_g = run_sse(sse_recurrent, inputs, st, valid, topk, torch.float64)
    got_o, got_g = run_sse(lambda *a: sse_triton(*a, chunk_size=chunk, topk=topk), inputs, st, valid, topk,
                           torch.float32)
    for i, (a, b) in enumerate(zip(got_o, ref_o, strict=True)):
        assert torch.isfinite(a).all() and rel(a, b) <= 1e-4, f"output {i}: {rel(a, b):.2e}"
    for i, (a, b) in enumerate(zip(got_g, ref_g, strict=True)):
        assert torch.isfinite(a).all() and rel(a, b) <= 1e-4, f"grad {i}: {rel(a, b):.2e}"


def test_padding_and_empty_partitions_keep_states():
    """Padded tokens leave every state as it was after the last real token; partitions that no
    token selects keep their initial state bit for bit."""
    B, T, pad, N = 2, 20, 6, 4
    inputs, st, valid = sse_inputs(B, T, 2, 16, 16, N, seed=5, pad=pad)
    xs = [x.float().to(DEV) for x in inputs]
    probs, sel = router_topk(xs[7], 1, valid.to(DEV))
    sel[:, :, 3] = False  # partition 3 is never selected
    sel[:, :, 0] |= valid.to(DEV) & ~sel.any(-1)
    state = SSEState(*[x.float().to(DEV) for x in st])
    with torch.no_grad():
        _, full = sse_triton(*xs[:7], probs, sel, state, chunk_size=16)
        _, ref = sse_triton(*[x[-1:, :T - pad] for x in xs[:7]], probs[-1:, :T - pad], sel[-1:, :T - pad],
                            SSEState(state.shared[-1:], state.parts[-1:]), chunk_size=16)
    assert rel(full.shared[-1:], ref.shared) <= 1e-6 and rel(full.parts[-1:], ref.parts) <= 1e-6
    assert torch.equal(full.parts[:, 3], state.parts[:, 3])


@pytest.mark.parametrize("inplace", [False, True])
def test_decode_matches_recurrence(inplace):
    B, H, D, Dv, N = 3, 2, 16, 48, 4  # Dv: several value blocks
    inputs, st, valid = sse_inputs(B, 3, H, D, Dv, N, seed=11)
    xs = [x.float().to(DEV) for x in inputs]
    probs, sel = router_topk(xs[7], 2, valid.to(DEV))
    ref_state = SSEState(*[x.float().to(DEV) for x in st])
    state = SSEState(ref_state.shared.clone(), ref_state.parts.clone())
    for t in range(3):
        before = state.parts.clone()
        step = [x[:, t:t + 1] for x in xs[:7]]
        ref_o, ref_state = sse_recurrent(*step, probs[:, t:t + 1], sel[:, t:t + 1], ref_state)
        got_o, new = sse_decode_triton(*step, probs[:, t:t + 1], sel[:, t:t + 1], state, inplace=inplace)
        if inplace:
            assert new.shared is state.shared and new.parts is state.parts
        else:
            assert torch.equal(state.parts, before)  # the input state is left as it was
        untouched = ~sel[:, t]                                        # [B, N]
        assert torch.equal(new.parts[untouched], before[untouched])
        assert rel(got_o, ref_o) <= 1e-5
        assert rel(new.shared, ref_state.shared) <= 1e-5 and rel(new.parts, ref_state.parts) <= 1e-5
        state = new


# ---------------------------------------------------------------------------
# GPU: real shapes in bf16
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("topk", [1, 2])
def test_gpu_sse_bf16(topk):
    """bf16 SSE (N = 4) at T = 2048, B = 2, d = 128 against `sse_varlen` in fp32 on the same
    bf16-rounded inputs; values and gradients within 1e-2; no host synchronisation."""
    B, T, H, D, N = 2, 2048, 4, 128, 4
    inputs, st, valid = sse_inputs(B, T, H, D, D, N, seed=topk, pad=100)
    inputs[0], inputs[2] = Fn.normalize(inputs[0], dim=-1), Fn.normalize(inputs[2], dim=-1)
    inputs = [x.bfloat16() if i < 7 else x for i, x in enumerate(inputs)]
    ref_o, ref_g = run_sse(sse_varlen, [x.float() for x in inputs], st, valid, topk, torch.float32)
    xs = [x.detach().to(DEV).clone().requires_grad_() for x in inputs]
    sts = [x.detach().to(DEV).float().clone().requires_grad_() for x in st]
    probs, sel = router_topk(xs[7].float(), topk, valid.to(DEV))
    gen = torch.Generator().manual_seed(123)
    shapes = [(B, T, H, D), (B, H, D, D), (B, N, H, D, D)]
    w = [torch.randn(s, generator=gen, dtype=torch.float64).to(DEV) for s in shapes]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, new = sse_triton(*xs[:7], probs, sel, SSEState(*sts), topk=topk)
        sum((y.double() * wy).sum() for y, wy in zip([o, new.shared, new.parts], w, strict=True)).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got_g = [x.grad for x in xs + sts]
    for i, (a, b) in enumerate(zip([o, new.shared, new.parts], ref_o, strict=True)):
        assert rel(a, b) <= 1e-2, f"output {i}: {rel(a, b):.2e}"
    for i, (a, b) in enumerate(zip(got_g, ref_g, strict=True)):
        assert rel(a, b) <= 1e-2, f"grad {i}: {rel(a, b):.2e}"


def test_dispatch_decides_the_path():
    """`sse_attention` alone decides: inputs the kernels cannot take are named (and go to the
    PyTorch forms under "auto"); an explicit "triton" off CUDA or on such inputs is a clear error."""
    from subquadratic.kernels.sse import triton_unsupported

    x = torch.zeros(1, 4, 2, 16)
    assert triton_unsupported(x, x, "gla", 64) is None
    assert "gdn" in triton_unsupported(x, x, "gdn", 64)
    assert "float64" in triton_unsupported(x.double(), x, "gla", 64)
    assert "chunk_size" in triton_unsupported(x, x, "gla", 48)
    if DEV == "cpu":
        gen = torch.Generator().manual_seed(0)
        B, T, H, D, N = 1, 4, 2, 16, 4
        q = torch.randn(B, T, H, D, generator=gen)
        probs, sel = router_topk(torch.randn(B, T, N, generator=gen), 1)
        g = torch.zeros(B, T, H, D)
        with pytest.raises(ValueError, match="CUDA"):
            sse_attention(q, q, q, q, q, g, g, probs, sel, backend="triton")


@pytest.mark.parametrize("B,T,N,topk,p", [(2, 37, 4, 4, 0.4), (1, 3, 8, 2, 0.2), (3, 9000, 2, 2, 0.5),
                                          (2, 5, 4, 1, 0.0), (1, 1, 3, 3, 1.0)])
def test_group_rows_kernel_equals_the_pytorch_ops(B, T, N, topk, p):
    """`group_rows` (two launches) against `group_rows_reference` (its PyTorch ops): the rows' tokens and
    partitions, the merged segments' bounds and each (token, partition)'s row, exactly, for selections
    of at most `topk` partitions per token (padding rows with none, empty partitions, segments over
    several blocks: 3 x 9000 x 2 entries)."""
    from subquadratic.kernels.sse.triton_sse import group_rows, group_rows_reference

    g = torch.Generator().manual_seed(B * 1000 + T + N)
    score = torch.rand(B, T, N, generator=g)
    keep = torch.rand(B, T, N, generator=g) < p
    sel = keep & (score >= score.topk(topk, -1).values[..., -1:])  # at most topk per token
    sel = sel.to(DEV)
    got, want = group_rows(sel, topk), group_rows_reference(sel, topk)
    for name, a, b in zip(("src", "cu", "inv"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("B,T,N,k", [(2, 37, 4, 1), (1, 2100, 4, 2), (3, 70, 8, 3), (1, 1, 3, 3)])
@pytest.mark.parametrize("with_valid", [False, True])
def test_group_rows_from_the_router_kernels_counts(B, T, N, k, with_valid):
    """The router kernel's selection counts (`router_topk(..., counts=True)`: per sample, partition and block of
    `triton_router.ROWS` tokens, blocks that never straddle two samples) are the selection's, and `group_rows`
    given them (one launch) returns the two-launch grouping's rows and bounds exactly (padding unselected,
    segments over several of the grouping's blocks: 2100 tokens)."""
    from subquadratic.kernels.sse.router import router_topk
    from subquadratic.kernels.sse.triton_router import ROWS
    from subquadratic.kernels.sse.triton_sse import group_rows, group_rows_reference

    g = torch.Generator().manual_seed(B * 100 + T + N)
    logits = torch.randn(B, T, N, generator=g).to(DEV)
    valid = (torch.rand(B, T, generator=g) > 0.3).to(DEV) if with_valid else None
    probs, sel, counts = router_topk(logits, k, valid, backend="triton", counts=True)
    nb = -(-T // ROWS)
    pad = torch.zeros(B, nb * ROWS, N, dtype=torch.int32, device=DEV)
    pad[:, :T] = sel.int()
    want_counts = pad.view(B, nb, ROWS, N).sum(2).transpose(1, 2)
    assert counts.dtype == torch.int32 and torch.equal(counts, want_counts)
    got, want = group_rows(sel, k, counts), group_rows_reference(sel, k)
    for name, a, b in zip(("src", "cu", "inv"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="counts"):
        group_rows(sel, k, counts[:, :, :0])
    # the PyTorch router has no counts: the grouping counts itself
    assert router_topk(logits, k, valid, counts=True)[-1] is None
