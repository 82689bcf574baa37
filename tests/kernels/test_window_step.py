"""A window branch's one-token step on the Triton kernel (`kernels.window_attention.window_step`), step
after step from an empty ring: each step's output against the definition over the row's whole history
in fp64 (key j of query p when p - j < W or j < sinks), and the ring and sinks it writes equal to the
PyTorch step's (`window_step_reference`), rows at different positions, GQA groups 1..4, head dims and
windows that are not powers of two, windows over one key tile, more sinks than the window, poisoned
empty slots and outputs. On CPU the kernel runs under TRITON_INTERPRET=1; the `gpu` test runs bf16 at
real shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.triton_window import window_step_triton  # noqa: E402
from subquadratic.kernels.window_attention import (  # noqa: E402
    window_step,
    window_step_reference,
    window_step_unsupported,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # B, HQ, H, D, window, sinks, steps, row offsets
    (2, 4, 2, 16, 8, 3, 22, (0, 5)),
    (1, 4, 1, 24, 20, 0, 26, (3,)),
    (2, 2, 2, 16, 5, 8, 14, (0, 2)),
    (1, 2, 1, 32, 200, 2, 6, (190,)),  # two key tiles of the ring
]


def buffers(B, H, W, D, sinks, dtype):
    """An empty ring and sinks as a cache makes them, the key / value slots poisoned with large values
    (an empty slot must not count)."""
    ring = [torch.full((B, H, W, D), 1e4, dtype=dtype, device=DEV) for _ in range(2)]
    ring.append(torch.full((B, W), -1, dtype=torch.long, device=DEV))
    if not sinks:
        return ring + [None] * 3
    return ring + [torch.full((B, H, sinks, D), 1e4, dtype=dtype, device=DEV) for _ in range(2)] + \
        [torch.full((B, sinks), -1, dtype=torch.long, device=DEV)]


def definition(q, keys, values, p, W, sinks, scale):
    """o [HQ, D] of one row's query q [HQ, D] at position p over its history keys, values [H, p + 1, D]."""
    G = q.shape[0] // keys.shape[0]
    j = torch.arange(p + 1, device=q.device)
    allowed = (p - j < W) | (j < sinks)
    kk, vv = keys.repeat_interleave(G, 0)[:, allowed], values.repeat_interleave(G, 0)[:, allowed]
    w = ((q[:, None] * kk).sum(-1) * scale).softmax(-1)
    return (w[..., None] * vv).sum(1)


@pytest.mark.parametrize("case", CASES)
def test_steps_match_the_definition_and_write_what_the_torch_step_writes(case):
    B, HQ, H, D, W, sinks, steps, offsets = case
    g = torch.Generator().manual_seed(sum(case[:6]))
    n = max(offsets) + steps
    # every row's keys / values / queries by position
    K, V, Q = (torch.randn(B, heads, n, D, generator=g, dtype=torch.float64).to(DEV) for heads in (H, H, HQ))
    kern, ref = buffers(B, H, W, D, sinks, torch.float32), buffers(B, H, W, D, sinks, torch.float32)
    scale = D ** -0.5
    for b, off in enumerate(offsets):  # row b's first `off` tokens, written by the PyTorch step
        for p in range(off):
            for bufs in (kern, ref):
                view = [None if x is None else x[b:b + 1] for x in bufs]
                window_step_reference(*(X[b:b + 1, :, p:p + 1].float() for X in (Q, K, V)), *view,
                                      torch.tensor([p], device=DEV), W, scale)
    off = torch.tensor(offsets, device=DEV)
    for t in range(steps):
        pos = off + t
        rows = torch.arange(B, device=DEV)
        q, k, v = (X[rows, :, pos][:, :, None].float() for X in (Q, K, V))  # [B, heads, 1, D]
        got = window_step_triton(q, k, v, *kern, pos, W, scale, ieee=True)
        want = window_step_reference(q, k, v, *ref, pos, W, scale)
        for b in range(B):
            p = int(pos[b])
            exact = definition(Q[b, :, p], K[b, :, : p + 1], V[b, :, : p + 1], p, W, sinks, scale)
            assert torch.allclose(got[b, :, 0].double(), exact, atol=2e-5, rtol=0), (t, b)
        assert torch.allclose(got, want, atol=2e-5, rtol=0)
        for a, r in zip(kern, ref, strict=True):
            assert a is None and r is None or torch.equal(a, r)


def test_the_kernel_is_taken_as_asked_and_checks_its_inputs(monkeypatch):
    """`kernel` (the window plan's `step_kernel`) picks the kernel or the PyTorch step, which agree; the kernel
    refuses inputs it does not take in one line; the plan's shape check agrees with the tensors'."""
    from subquadratic.kernels import triton_window
    from subquadratic.kernels.window_attention import window_step_shapes_unsupported

    B, H, W, D = 1, 2, 8, 16
    q, k, v = (torch.randn(B, h, 1, D).to(DEV) for h in (4, H, H))
    bufs = buffers(B, H, W, D, 2, torch.float32)
    ring_k, ring_v, _, sink_k, sink_v, _ = bufs
    assert window_step_unsupported(q, k, v, ring_k, ring_v, sink_k, sink_v) is None
    assert window_step_shapes_unsupported(tuple(q.shape), tuple(k.shape), q.dtype, 2) is None
    assert "dtypes" in window_step_unsupported(q.double(), k, v, ring_k, ring_v, sink_k, sink_v)
    strided_v = torch.randn(B, H, 1, 2 * D, device=DEV)[..., ::2]
    assert "unit stride" in window_step_unsupported(q, k, strided_v, ring_k, ring_v, sink_k, sink_v)
    assert "dtype" in window_step_shapes_unsupported(tuple(q.shape), tuple(k.shape), torch.float64, 2)
    assert "H dividing HQ" in window_step_shapes_unsupported((B, 4, 1, D), (B, 3, 1, D), q.dtype, 2)
    assert "sinks" in window_step_shapes_unsupported(tuple(q.shape), tuple(k.shape), q.dtype, 65)
    with pytest.raises(ValueError, match="window decode step kernel does not take these inputs: dtypes"):
        window_step(q.double(), k, v, *bufs, torch.tensor([0], device=DEV), W, 0.25, kernel=True)
    calls, real = [], triton_window.window_step_triton
    monkeypatch.setattr(triton_window, "window_step_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    pos = torch.tensor([0], device=DEV)
    out = window_step(q, k, v, *bufs, pos, W, 0.25, kernel=True, precision="ieee")
    assert len(calls) == 1
    ref_bufs = buffers(B, H, W, D, 2, torch.float32)
    ref = window_step(q, k, v, *ref_bufs, pos, W, 0.25)  # kernel=False: the PyTorch step
    assert len(calls) == 1
    assert out.shape == (B, 4, 1, D) and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    for a, r in zip(bufs, ref_bufs, strict=True):
        assert torch.equal(a, r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_steps_at_real_shapes_match_the_torch_step():
    B, HQ, H, D, W, sinks = 2, 32, 8, 64, 64, 4
    g = torch.Generator().manual_seed(0)
    kern, ref = buffers(B, H, W, D, sinks, torch.bfloat16), buffers(B, H, W, D, sinks, torch.bfloat16)
    for t in range(80):
        q, k, v = (torch.randn(B, h, 1, D, generator=g).to(DEV, torch.bfloat16) for h in (HQ, H, H))
        pos = torch.tensor([t, t + 7], device=DEV)
        got = window_step_triton(q, k, v, *kern, pos, W, D ** -0.5, ieee=False)
        want = window_step_reference(q, k, v, *ref, pos, W, D ** -0.5)
        assert (got.float() - want.float()).abs().max() < 2e-2
        for a, r in zip(kern, ref, strict=True):
            assert torch.equal(a, r)
