"""A first call's window ring and sinks on the Triton kernel (`kernels.window_attention.fresh_ring`, one
launch) against the PyTorch ops (`fresh_ring_reference`) exactly, and both against the layout's
definition (position p in ring slot p % W for the last W tokens, token j in sink slot j, -1 and zeros in
slots no token took): prompts shorter than the sinks, shorter than the window, of exactly the window,
past it by a remainder and by whole windows, keys read through strides (a transposed projection's view),
head dims that are not powers of two, windows over several slot blocks. On CPU the kernel runs under
TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.window_attention import (  # noqa: E402
    fresh_ring,
    fresh_ring_reference,
    fresh_ring_shapes_unsupported,
    fresh_ring_unsupported,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # B, H, T, D, window, sinks
    (2, 2, 3, 16, 8, 4),     # shorter than the sinks
    (1, 3, 6, 24, 8, 2),     # shorter than the window
    (2, 1, 8, 16, 8, 0),     # exactly the window, no sinks
    (2, 2, 13, 16, 8, 4),    # past the window by a remainder
    (1, 2, 24, 32, 8, 3),    # past it by whole windows
    (1, 1, 300, 16, 200, 1),  # a window over several slot blocks (8192 // BD of them a block)
]


def definition(k: torch.Tensor, window: int, sinks: int):
    """The ring, its positions and the sinks, slot by slot."""
    B, H, T, D = k.shape
    ring, pos = k.new_zeros(B, H, window, D), torch.full((B, window), -1, dtype=torch.long)
    for p in range(max(0, T - window), T):
        ring[:, :, p % window], pos[:, p % window] = k[:, :, p], p
    sink, sink_pos = k.new_zeros(B, H, sinks, D), torch.full((B, sinks), -1, dtype=torch.long)
    for j in range(min(sinks, T)):
        sink[:, :, j], sink_pos[:, j] = k[:, :, j], j
    return ring, pos, sink, sink_pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,T,D,window,sinks", CASES)
def test_fresh_ring_kernel_equals_the_pytorch_ops(B, H, T, D, window, sinks, dtype):
    g = torch.Generator().manual_seed(T * 100 + window)
    # k, v as the attention hands them: [B, H, T, D] views of a [B, T, H, D] projection
    k = torch.randn(B, T, H, D, generator=g).to(dtype).to(DEV).transpose(1, 2)
    v = torch.randn(B, T, H, D, generator=g).to(dtype).to(DEV).transpose(1, 2)
    got = fresh_ring(k, v, window, sinks, backend="triton")
    want = fresh_ring_reference(k, v, window, sinks)
    names = ("ring_k", "ring_v", "ring_pos", "sink_k", "sink_v", "sink_pos")
    for name, a, b in zip(names, got, want, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
        assert torch.equal(a, b), name
    ring, pos, sink, sink_pos = definition(k.cpu(), window, sinks)
    assert torch.equal(got[0].cpu(), ring) and torch.equal(got[2].cpu(), pos)
    assert torch.equal(definition(v.cpu(), window, sinks)[0], got[1].cpu())
    if sinks:
        assert torch.equal(got[3].cpu(), sink) and torch.equal(got[5].cpu(), sink_pos)


def test_fresh_ring_refuses_what_the_kernel_does_not_take():
    k = torch.randn(1, 2, 4, 16)
    assert fresh_ring_unsupported(k, k, 8, 2) is None
    assert "dtypes" in fresh_ring_unsupported(k.double(), k.double(), 8, 2)
    assert "sinks" in fresh_ring_unsupported(k, k, 8, 65)
    strided = torch.randn(1, 2, 16, 4).transpose(2, 3)  # [1, 2, 4, 16], stride 4 along D
    assert "unit stride" in fresh_ring_unsupported(strided, strided, 8, 2)
    # the window plan's question (`plan_window`'s ring_kernel), on shapes alone
    assert fresh_ring_shapes_unsupported(tuple(k.shape), k.dtype, 8, 2) is None
    assert "dtype" in fresh_ring_shapes_unsupported(tuple(k.shape), torch.float64, 8, 2)
    assert "head dim at most" in fresh_ring_shapes_unsupported((1, 2, 4, 512), k.dtype, 8, 2)
    assert "sinks 65" in fresh_ring_shapes_unsupported(tuple(k.shape), k.dtype, 8, 65)
    with pytest.raises(ValueError, match="window ring fill kernel does not take"):
        fresh_ring(k.double(), k.double(), 8, 2, backend="triton")
    # "auto" off CUDA and "torch" take the PyTorch ops
    for backend in ("auto", "torch"):
        assert all(torch.equal(a, b) for a, b in zip(fresh_ring(k, k, 8, 2, backend), fresh_ring_reference(k, k, 8, 2),
                                                      strict=True))
