"""Sliding-window attention with sinks on the Triton kernels (`kernels.window_attention`) against its
definition in fp64 (a [T, T] mask: key j of query t when j <= t and (t - j < W or j < sinks)): values
and the gradients of q, k and v, GQA groups 1..4, head dims that are not powers of two, lengths that
are not a multiple of the tiles, windows shorter and longer than a tile, more sinks than the window,
poisoned outputs (tests/kernels/conftest.py). On CPU the kernels run under TRITON_INTERPRET=1; the
`gpu` test runs bf16 at real shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.window_attention import window_attention, window_unsupported  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # B, HQ, H, T, D, window, sinks
    (2, 4, 2, 150, 32, 16, 4),    # W below a tile, T not a multiple of 64
    (1, 4, 1, 200, 24, 40, 3),    # G = 4, D not a power of two
    (1, 2, 2, 130, 16, 100, 8),   # W above a tile
    (1, 2, 1, 90, 16, 4, 8),      # more sinks than the window
    (1, 3, 3, 70, 16, 64, 0),     # no sinks
    (1, 2, 1, 20, 16, 32, 2),     # T below the window
]


def definition(q, k, v, window, sinks, scale):
    """o [B, T, HQ, D] by the definition, in q's dtype: q [B, HQ, T, D], k, v [B, H, T, D]."""
    B, HQ, T, D = q.shape
    G = HQ // k.shape[1]
    t = torch.arange(T, device=q.device)
    d = t[:, None] - t[None, :]
    allowed = (d >= 0) & ((d < window) | (t[None, :] < sinks))
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return (p @ vv).transpose(1, 2)


def make(B, HQ, H, T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # q as the model passes it: a [B, HQ, T, D] view of [B, T, HQ, D]
    q = torch.randn(B, T, HQ, D, generator=g, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(B, T, H, D, generator=g, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(B, T, H, D, generator=g, dtype=torch.float64).transpose(1, 2)
    return [x.to(DEV, dtype) for x in (q, k, v)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def values_and_grads(fn, q, k, v, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v)
    o.backward(do.to(o.dtype))
    return [o.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("case", CASES)
def test_fp32_values_and_gradients_equal_the_definition(case):
    B, HQ, H, T, D, W, sinks = case
    q, k, v = make(B, HQ, H, T, D, torch.float32, seed=T + D)
    do = torch.randn(B, T, HQ, D, generator=torch.Generator().manual_seed(T), dtype=torch.float64).to(DEV)
    scale = D ** -0.5
    got = values_and_grads(lambda *x: window_attention(*x, W, scale, sinks, precision="ieee"), q, k, v, do)
    want = values_and_grads(lambda *x: definition(*x, W, sinks, scale), *(x.double() for x in (q, k, v)), do)
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert rel(a, b) <= 2e-6, (name, rel(a, b))


def test_16_bit_operands_within_rounding():
    """fp16 operands (the interpreter's bf16 dots are wrong: bf16 runs in the `gpu` test), fp32 sums."""
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float16
    B, HQ, H, T, D, W, sinks = 1, 4, 2, 140, 32, 48, 4
    q, k, v = make(B, HQ, H, T, D, dtype, seed=5)
    do = torch.randn(B, T, HQ, D, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(DEV)
    got = values_and_grads(lambda *x: window_attention(*x, W, D ** -0.5, sinks), q, k, v, do)
    want = values_and_grads(lambda *x: definition(*x, W, sinks, D ** -0.5), *(x.double() for x in (q, k, v)), do)
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want, strict=True):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        assert rel(a, b) <= 2e-2, (name, rel(a, b))


def test_unsupported_inputs_say_why():
    q = torch.zeros(1, 3, 8, 16)
    k = torch.zeros(1, 2, 8, 16)
    assert "query heads" in window_unsupported(q, k, k, 4, 0)
    assert "dtypes" in window_unsupported(q.double(), k.double(), k.double(), 4, 0)
    assert "sinks" in window_unsupported(q[:, :2], k, k, 4, 100)
    many = torch.zeros(16384, 4, 1, 16).expand(16384, 4, 8, 16)  # 65536 rows x heads, no memory
    assert "grid" in window_unsupported(many, many, many, 4, 0)
    with pytest.raises(ValueError, match="window_attention does not take"):
        window_attention(q, k, k, 4, 0.25)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_bf16_real_shapes(D):
    """bf16, 16 query heads over 4 KV heads, T = 4096 + 17, window 64 and 4 sinks (the hybrids' default
    window branch): values and gradients within 2e-2 of the fp64 definition on the same rounded inputs."""
    B, HQ, H, T, W, sinks = 1, 16, 4, 4096 + 17, 64, 4
    q, k, v = make(B, HQ, H, T, D, torch.bfloat16, seed=D)
    do = torch.randn(B, T, HQ, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    got = values_and_grads(lambda *x: window_attention(*x, W, D ** -0.5, sinks), q, k, v, do)
    want = values_and_grads(lambda *x: definition(*x, W, sinks, D ** -0.5), *(x.double() for x in (q, k, v)), do)
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want, strict=True):
        assert rel(a, b) <= 2e-2, (name, rel(a, b))
