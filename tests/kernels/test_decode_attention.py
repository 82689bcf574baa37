"""One query token per row over a key cache under a mask on the Triton kernels
(`kernels.decode_attention`), against the definition in fp64 (keys and values repeated per query head,
softmax over the allowed keys): GQA groups 1..8, head dims that are not powers of two, caches of one
key, of one span and of several (spans with no allowed key among them), strided q / k / v as the
model passes them, poisoned outputs. On CPU the kernels run under TRITON_INTERPRET=1; the `gpu` test
runs bf16 at real shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels import triton_decode  # noqa: E402
from subquadratic.kernels.decode_attention import (  # noqa: E402
    decode_attention,
    decode_attention_reference,
    decode_shapes_unsupported,
    decode_unsupported,
    exact_decode_dots,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # B, HQ, H, S, D, allowed: "random" or "first" (only the first 10 keys)
    (2, 4, 2, 100, 16, "random"),
    (1, 8, 1, 700, 24, "random"),   # several spans, G = 8
    (2, 3, 3, 700, 16, "first"),    # spans with no allowed key
    (1, 4, 2, 1, 32, "random"),     # one key
    (2, 6, 2, 300, 64, "random"),
]


def definition(q, k, v, allowed, scale):
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ kk.transpose(-1, -2)) * scale  # [B, HQ, 1, S]
    w = s.masked_fill(~allowed[:, None, None], float("-inf")).softmax(-1)
    return w @ vv


def make(B, HQ, H, S, D, kind, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, HQ, D, generator=g, dtype=torch.float64).transpose(1, 2)  # a view, as projected
    cache = torch.randn(2, B, S + 5, H, D, generator=g, dtype=torch.float64).transpose(2, 3)[:, :, :, :S]
    if kind == "first":
        allowed = torch.arange(S)[None].expand(B, S) < 10
    else:
        allowed = torch.rand(B, S, generator=g) < 0.7
        allowed[:, -1] = True
    return [x.to(DEV, dtype) for x in (q, cache[0], cache[1])] + [allowed.to(DEV)]


@pytest.mark.parametrize("case", CASES)
def test_values_match_the_definition(case):
    q, k, v, allowed = make(*case, seed=sum(case[:5]))
    scale = q.shape[-1] ** -0.5
    got = triton_decode.decode_triton(q, k, v, allowed.view(torch.uint8), scale, ieee=True)
    want = definition(q.double(), k.double(), v.double(), allowed, scale)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(decode_attention_reference(q, k, v, allowed, scale).double(), want, atol=1e-5, rtol=0)


def test_spans_cover_the_keys_in_whole_tiles():
    for S in (1, 255, 256, 4097, 131072):
        for rows in (1, 8, 64, 4096):
            span = triton_decode.spans_for(S, rows, 132)
            assert span % triton_decode.BN == 0 and span >= 4 * triton_decode.BN
            assert -(-S // span) <= max(1, -(-2 * 132 // rows))  # about two programs per multiprocessor, at most


def test_the_kernels_are_taken_as_asked_and_check_their_inputs(monkeypatch):
    """`kernel` (the softmax plan's "decode_kernel" path) picks the kernels or the PyTorch form, which agree;
    the kernels refuse inputs they do not take in one line; the plan's shape check agrees with the tensors'."""
    q, k, v, allowed = make(1, 4, 2, 20, 16, "random", 0)
    assert decode_unsupported(q, k, v, allowed) is None
    assert decode_shapes_unsupported(tuple(q.shape), tuple(k.shape), q.dtype) is None
    assert "dtype" in decode_shapes_unsupported(tuple(q.shape), tuple(k.shape), torch.float64)
    assert "head dim" in decode_shapes_unsupported((1, 4, 1, 512), (1, 2, 20, 512), q.dtype)
    assert "query heads a KV head" in decode_shapes_unsupported((1, 130, 1, 16), (1, 2, 20, 16), q.dtype)
    assert "shapes" in decode_shapes_unsupported((1, 4, 2, 16), (1, 2, 20, 16), q.dtype)
    assert "shapes" in decode_unsupported(q.expand(1, 4, 2, 16), k, v, allowed)
    assert "dtypes" in decode_unsupported(q.double(), k, v, allowed)
    assert "allowed" in decode_unsupported(q, k, v, allowed.long())
    assert "allowed" in decode_unsupported(q, k, v, allowed[:, :-1])
    assert exact_decode_dots(torch.float32, "auto") and not exact_decode_dots(torch.float32, "tf32")
    assert not exact_decode_dots(torch.bfloat16, "ieee")
    with pytest.raises(ValueError, match="kernel_precision"):
        exact_decode_dots(torch.float32, "fast")
    with pytest.raises(ValueError, match="decode attention kernels do not take these inputs: dtypes"):
        decode_attention(q.double(), k, v, allowed, 0.25, kernel=True)
    calls, real = [], triton_decode.decode_triton
    monkeypatch.setattr(triton_decode, "decode_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = decode_attention(q, k, v, allowed, 0.25, kernel=True, precision="ieee")
    assert len(calls) == 1
    ref = decode_attention(q, k, v, allowed, 0.25)  # kernel=False: the PyTorch form
    assert len(calls) == 1
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref, decode_attention_reference(q, k, v, allowed, 0.25), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_at_real_shapes():
    q, k, v, allowed = make(2, 32, 8, 40000, 64, "random", 1, torch.bfloat16)
    got = decode_attention(q, k, v, allowed, 0.125, kernel=True)
    want = definition(q.double(), k.double(), v.double(), allowed, 0.125)
    assert (got.double() - want).abs().max() < 2e-2
