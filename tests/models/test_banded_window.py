"""`base.banded_window_attention`: sliding-window softmax attention in blocks of W queries, against the
definition (an explicit [T, S] mask over every key), values and gradients in fp64: no earlier keys, a
window ring before the new tokens (filled in ring order, or empty with left padding), GQA, lengths
that are not a multiple of W; and the layers that take it (SSE's window branch, a sliding-window
softmax layer) give what the masked form gives."""

from __future__ import annotations

import pytest
import torch

from subquadratic.kernels.utils import allowed_keys
from subquadratic.modeling.base import CACHE_FIELD, banded_window_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(q, k, v, q_pos, k_pos, window, scaling):
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    allowed = allowed_keys(q_pos, k_pos, window)[:, None]
    w = (q @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf")).softmax(-1)
    return (w @ v).transpose(1, 2)  # [B, T, HQ, D]


def inputs(B, HQ, H, T, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return r(B, HQ, T, D), r(B, H, S, D), r(B, H, S, D)


def check(q, k, v, q_pos, k_pos, W):
    scaling = q.shape[-1] ** -0.5
    got = banded_window_attention(q, k, v, q_pos, k_pos, W, scaling)
    want = reference(q, k, v, q_pos, k_pos, W, scaling)
    real = (q_pos >= 0)[:, :, None, None]
    assert got.shape == want.shape
    assert torch.allclose(got * real, want * real, atol=1e-12, rtol=0)
    cot = torch.randn_like(got)
    g1 = torch.autograd.grad((got * real * cot).sum(), (q, k, v))
    g2 = torch.autograd.grad((want * real * cot).sum(), (q, k, v))
    for a, b in zip(g1, g2, strict=True):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("T", [9, 16, 17, 40])
def test_no_earlier_keys(T):
    W = 8
    q, k, v = inputs(2, 4, 2, T, T, 16, T)
    pos = torch.arange(T).expand(2, T)
    check(q, k, v, pos, pos, W)


@pytest.mark.parametrize("earlier", [3, 8, 21])
def test_a_window_ring_before_the_new_tokens(earlier):
    """The ring holds the last W of `earlier` tokens in slot p % W (empty slots -1)."""
    W, T, B = 8, 19, 2
    q, k, v = inputs(B, 4, 1, T, W + T, 8, earlier)
    ring = torch.full((W,), -1)
    for p in range(max(0, earlier - W), earlier):
        ring[p % W] = p
    k_pos = torch.cat([ring, torch.arange(earlier, earlier + T)]).expand(B, -1)
    q_pos = torch.arange(earlier, earlier + T).expand(B, T)
    check(q, k, v, q_pos, k_pos, W)


def test_left_padding_with_an_empty_ring():
    W, T = 8, 21
    q, k, v = inputs(2, 2, 2, T, W + T, 8, 5)
    q_pos = torch.stack([torch.arange(T), torch.cat([torch.full((6,), -1), torch.arange(T - 6)])])
    k_pos = torch.cat([torch.full((2, W), -1), q_pos], dim=1)
    check(q, k, v, q_pos, k_pos, W)


def test_wrong_layout_is_refused():
    q, k, v = inputs(1, 2, 2, 10, 12, 8, 0)
    with pytest.raises(ValueError, match="keys for 10 queries"):
        banded_window_attention(q, k, v, torch.arange(10)[None], torch.arange(12)[None], 4, 1.0)


@pytest.mark.parametrize("merge", ["norm", "sum"])
def test_sse_window_layers_take_it(merge, monkeypatch):
    """A whole SSE model whose window (8) is shorter than its input: the no-cache forward, a prefill
    into an empty ring and a second prefill into a filled ring all take the banded form, and give the
    logits of the same model with the definition (`reference`) in its place."""
    from subquadratic.modeling import base

    from .sse.test_modeling_sse import lively

    calls = []

    def run(fn):
        monkeypatch.setattr(base, "banded_window_attention", lambda *a, **kw: calls.append(1) or fn(*a, **kw))
        with torch.no_grad():
            full = m(ids).logits
            first = m(ids[:, :17], use_cache=True)
            second = m(ids[:, 17:], **{CACHE_FIELD: getattr(first, CACHE_FIELD)}, use_cache=True).logits
        return full, torch.cat([first.logits, second], 1)

    m = lively("tiny-swa", 0, sse_window_merge=merge).double()
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    banded = run(banded_window_attention)
    assert len(calls) == 3 * m.config.num_hidden_layers
    defined = run(lambda q, k, v, q_pos, k_pos, W, scaling, dropout: reference(q, k, v, q_pos, k_pos, W, scaling))
    for a, b in zip(banded, defined, strict=True):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)
