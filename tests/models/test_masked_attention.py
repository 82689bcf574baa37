"""The masked softmax attention of grouped query heads without repeating the keys and values:
`kernels.decode_attention.grouped_query_attention` (several new tokens) against the definition (keys and values repeated
per query head, an additive mask), values and gradients in fp64; and a static cache's steps of a
model with a grouped softmax layer: one-token steps on `kernels.decode_attention`, a chunk of tokens
on the lower-right causal form after real tokens and on the grouped form after left padding, each giving
the full forward's logits."""

from __future__ import annotations

import pytest
import torch

from subquadratic.kernels.decode_attention import grouped_query_attention
from subquadratic.modeling import base
from subquadratic.modeling.base import CACHE_FIELD, grouped_query_packs

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(q, k, v, mask, scaling):
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    w = (q @ k.transpose(-1, -2) * scaling + mask).softmax(-1)
    return (w @ v).transpose(1, 2)  # [B, T, HQ, D]


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("HQ,H", [(4, 2), (8, 1), (6, 3)])
def test_values_and_gradients_match_the_definition(T, HQ, H):
    g = torch.Generator().manual_seed(T * 100 + HQ * 10 + H)
    B, S, D = 2, 11, 8
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    q, k, v = r(B, HQ, T, D), r(B, H, S, D), r(B, H, S, D)
    allowed = torch.rand(B, 1, T, S, generator=g) < 0.6
    allowed[..., 0] = True  # every row sees a key
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
    with torch.no_grad():
        assert grouped_query_packs(q, k)
    got, want = grouped_query_attention(q, k, v, mask, 0.3), reference(q, k, v, mask, 0.3)
    assert got.shape == want.shape == (B, T, HQ, D)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    cot = torch.randn(got.shape, generator=g, dtype=got.dtype)
    for a, b in zip(torch.autograd.grad((got * cot).sum(), (q, k, v)),
                    torch.autograd.grad((want * cot).sum(), (q, k, v)), strict=True):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_packs_only_grouped_queries_with_a_mask_smaller_than_the_repeat_without_gradients():
    k = torch.zeros(1, 2, 5, 8)
    with torch.no_grad():
        assert not grouped_query_packs(torch.zeros(1, 2, 1, 8), k)  # no groups: nothing repeated
        assert grouped_query_packs(torch.zeros(1, 4, 31, 8), k)
        assert not grouped_query_packs(torch.zeros(1, 4, 32, 8), k)  # T >= 2 H D: the mask copy would cost more
    assert not grouped_query_packs(torch.zeros(1, 4, 31, 8), k)  # training: Transformers' function


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_static_steps_of_a_softmax_layer_take_the_decode_attention_and_match_the_full_forward(kernel, monkeypatch):
    """A static cache's one-token steps of a grouped softmax layer run `decode_attention` (on its Triton
    kernels as on CUDA: here forced by the softmax plan, `decode_kernel`, under the interpreter, fp32; else
    the PyTorch form, fp64) and give the full forward's logits; a chunk of several tokens after the prefill
    of real tokens takes the lower-right causal form (every slot real: no mask)."""
    from .sse.test_modeling_sse import lively

    dev = "cuda" if kernel and torch.cuda.is_available() else "cpu"
    model = lively("tiny-h", 0).to(dev, torch.float32 if kernel else torch.float64)
    model.config.kernel_precision = "ieee"  # on CUDA: every kernel's fp32 dots exact, as the interpreter's
    assert model.config.num_attention_heads != model.config.num_key_value_heads
    steps, chunks = [], []
    real_decode, real_grouped = base.decode_attention, base.grouped_query_attention
    monkeypatch.setattr(base, "decode_attention", lambda *a, **kw: steps.append(1) or real_decode(*a, **kw))
    monkeypatch.setattr(base, "grouped_query_attention", lambda *a, **kw: chunks.append(1) or real_grouped(*a, **kw))
    on_kernel = []  # the kernels' wrapper, one call a step
    if kernel:
        pytest.importorskip("triton")
        from subquadratic.kernels import triton_decode

        real_kernel = triton_decode.decode_triton
        monkeypatch.setattr(triton_decode, "decode_triton",
                            lambda *a, **kw: on_kernel.append(1) or real_kernel(*a, **kw))
    model.set_plan("softmax", decode_kernel=kernel)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 24), generator=g).to(dev)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(max_length=40, cuda_graph=False)
        logits = [model(ids[:, :16], **{CACHE_FIELD: cache}).logits[:, -1:]]
        logits.append(model(ids[:, 16:20], **{CACHE_FIELD: cache}).logits)
        logits += [model(ids[:, t:t + 1], **{CACHE_FIELD: cache}).logits for t in range(20, 23)]
    softmax_layers = len(model.config.softmax_layers)
    assert len(steps) == 3 * softmax_layers and not chunks
    assert len(on_kernel) == (len(steps) if kernel else 0)  # each step on the kernels asked for
    torch.testing.assert_close(torch.cat(logits, 1), full[:, 15:23], atol=1e-4 if kernel else 1e-9, rtol=0)


def test_a_chunk_after_a_left_padded_prefill_takes_the_grouped_form(monkeypatch):
    """A static cache's chunk of several tokens after a left-padded prefill runs the grouped form under the
    mask (its slots are not all real) and gives the full forward's logits (fp64)."""
    from .sse.test_modeling_sse import lively

    model = lively("tiny-h", 0).double()
    chunks, real_grouped = [], base.grouped_query_attention
    monkeypatch.setattr(base, "grouped_query_attention", lambda *a, **kw: chunks.append(1) or real_grouped(*a, **kw))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0: 5 slots of left padding
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = model.new_cache(max_length=40, cuda_graph=False)
        first = model(ids[:, :16], attention_mask=mask[:, :16], **{CACHE_FIELD: cache}).logits
        chunks.clear()  # the prefill under its padding mask takes it too
        chunk = model(ids[:, 16:20], attention_mask=mask[:, :20], **{CACHE_FIELD: cache}).logits
    assert len(chunks) == len(model.config.softmax_layers)
    torch.testing.assert_close(chunk, full[:, 16:20], atol=1e-9, rtol=0)
    torch.testing.assert_close(first[1], full[1, :16], atol=1e-9, rtol=0)


def test_takes_sdpa_outputs_in_any_layout(monkeypatch):
    """SDPA on CUDA may return its output in a transposed layout: the grouped form reshapes it."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: real(*a, **kw).transpose(1, 2).contiguous().transpose(1, 2))
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8,
                                                                                                   generator=g)
    mask = torch.zeros(1, 1, 3, 5)
    torch.testing.assert_close(grouped_query_attention(q, k, v, mask, 0.3), reference(q, k, v, mask, 0.3))
