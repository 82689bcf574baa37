"""`base.banded_window_attention`: sliding-window softmax attention in blocks of W queries, against the
definition (an explicit [T, S] mask over every key), values and gradients in fp64: no earlier keys, a
window ring before the new tokens (filled in ring order, or empty with left padding), GQA, lengths
that are not a multiple of W; and the layers that take it (SSE's window branch, a sliding-window
softmax layer) give what the masked form gives."""

from __future__ import annotations

import pytest
import torch

from subquadratic.modeling.base import CACHE_FIELD, banded_window_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(q, k, v, q_pos, k_pos, window, scaling, sinks=0):
    """By the definition: each query over the real keys at most `window` - 1 positions back, or among the
    first `sinks` positions (each key slot once)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    allowed = ((kp >= 0) & (kp <= qp) & ((qp - kp < window) | (kp < sinks)) | (qp < 0))[:, None]
    w = (q @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf")).softmax(-1)
    return (w @ v).transpose(1, 2)  # [B, T, HQ, D]


def inputs(B, HQ, H, T, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return r(B, HQ, T, D), r(B, H, S, D), r(B, H, S, D)


def compare(got, want, q_pos, wrt):
    real = (q_pos >= 0)[:, :, None, None]
    assert got.shape == want.shape
    assert torch.allclose(got * real, want * real, atol=1e-12, rtol=0)
    cot = torch.randn_like(got)
    g1 = torch.autograd.grad((got * real * cot).sum(), wrt)
    g2 = torch.autograd.grad((want * real * cot).sum(), wrt)
    for a, b in zip(g1, g2, strict=True):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def check(q, k, v, q_pos, k_pos, W, sinks=0):
    scaling = q.shape[-1] ** -0.5
    got = banded_window_attention(q, k, v, q_pos, k_pos, W, scaling, sinks=sinks)
    compare(got, reference(q, k, v, q_pos, k_pos, W, scaling, sinks), q_pos, (q, k, v))


@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("T", [9, 16, 17, 40])
def test_no_earlier_keys(T, sinks):
    W = 8
    q, k, v = inputs(2, 4, 2, T, T, 16, T)
    pos = torch.arange(T).expand(2, T)
    check(q, k, v, pos, pos, W, sinks)


@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("earlier", [2, 8, 21])
def test_a_window_ring_before_the_new_tokens(earlier, sinks):
    """`earlier` tokens came before: the ring holds the last W of them in slot p % W (empty slots -1),
    the sink slots copies of the first `sinks` tokens (-1 until seen, the new ones included, as
    `WindowRing` writes them); the result is the definition's over the whole history."""
    W, T, B = 8, 19, 2
    L = earlier + T
    q, k_all, v_all = inputs(B, 4, 1, T, L, 8, earlier)
    pos_all = torch.arange(L)
    ring = torch.full((W,), -1)
    for p in range(max(0, earlier - W), earlier):
        ring[p % W] = p
    sink = torch.where(torch.arange(sinks) < L, torch.arange(sinks), -1)
    slots = torch.cat([sink, ring, torch.arange(earlier, L)])
    take = slots.clamp(min=0)
    k, v = k_all[:, :, take], v_all[:, :, take]
    k_pos = slots.expand(B, -1)
    q_pos = torch.arange(earlier, L).expand(B, T)
    scaling = 8**-0.5
    got = banded_window_attention(q, k, v, q_pos, k_pos, W, scaling, sinks=sinks, sink_slots=sinks)
    want = reference(q, k_all, v_all, q_pos, pos_all.expand(B, L), W, scaling, sinks)
    compare(got, want, q_pos, (q, k_all, v_all))


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


@pytest.mark.parametrize("merge,sinks", [("norm", 0), ("sum", 0), ("sum", 3)])
def test_sse_window_layers_take_it(merge, sinks, monkeypatch):
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

    m = lively("tiny-swa", 0, sse_window_merge=merge, sse_window_sinks=sinks).double()
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    banded = run(banded_window_attention)
    assert len(calls) == 3 * m.config.num_hidden_layers
    def defined_form(q, k, v, q_pos, k_pos, W, scaling, dropout, sinks, sink_slots):
        # the definition over the distinct tokens: the sink copies stand for tokens 0..sinks-1
        if sink_slots:
            copies = k_pos[:, :sink_slots]
            rest = k_pos[:, sink_slots:]
            dup = (rest[:, :, None] == copies[:, None, :]).any(-1)  # the window's own copy of a sink token
            k_pos = torch.cat([copies, torch.where(dup, -1, rest)], dim=1)
        return reference(q, k, v, q_pos, k_pos, W, scaling, sinks)

    defined = run(defined_form)
    for a, b in zip(banded, defined, strict=True):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


def test_real_tokens_on_an_accelerator_are_known_once_per_call():
    """Whether a mask holds padding is read from an accelerator tensor only where asked (`sync`: calls
    of several tokens), never for one-token steps; on the CPU and without a mask it is always known."""
    from subquadratic.modeling.cache import all_real

    on_meta = torch.ones(2, 5, dtype=torch.bool, device="meta")
    assert all_real(None) and all_real(torch.ones(2, 5, dtype=torch.bool), sync=False)
    assert not all_real(torch.tensor([[True, False]]))
    assert not all_real(on_meta) and not all_real(on_meta, sync=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_prefill_with_a_mask_of_real_tokens_on_the_gpu_takes_it(monkeypatch):
    """generate() and training collators pass an attention mask; on the GPU whether it holds padding is
    read once per call of several tokens, so a prefill (into the cache or without one) of real tokens
    takes an O(T W) form (on the GPU the window kernels) and the softmax layers' causal SDPA, not a
    [T, T] mask."""
    from subquadratic.modeling import base

    from .sse.test_modeling_sse import lively

    calls = []
    for name in ("banded_window_attention", "window_attention"):
        real = getattr(base, name)
        monkeypatch.setattr(base, name, lambda *a, _real=real, **kw: calls.append(1) or _real(*a, **kw))
    m = lively("tiny-swa", 0, sse_window_merge="sum", sse_window_sinks=2).cuda()
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(3)).cuda()
    mask = torch.ones_like(ids)
    with torch.no_grad():
        cached = m(ids, attention_mask=mask, use_cache=True)
        assert getattr(cached, CACHE_FIELD).all_real and len(calls) == m.config.num_hidden_layers
        plain = m(ids, attention_mask=mask).logits
        assert len(calls) == 2 * m.config.num_hidden_layers
        padded = mask.clone()
        padded[0, :3] = 0  # padding: the masked form, same logits on the real tokens' rows
        m(ids, attention_mask=padded, use_cache=True)
        assert len(calls) == 2 * m.config.num_hidden_layers
    torch.testing.assert_close(cached.logits, plain, rtol=1e-5, atol=1e-5)


def test_the_window_kernels_give_the_banded_forms_values_in_a_model(monkeypatch):
    """The window branch of causal rows on the Triton kernels (`kernels.window_attention`: on CUDA by
    default, here also in the CPU interpreter) against the banded PyTorch form, fp32 with exact dots: a
    training forward and backward without a cache, and a prefill into a cache followed by decode steps."""
    pytest.importorskip("triton")
    from subquadratic.modeling import base

    from .sse.test_modeling_sse import lively

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = lively("tiny-swa", 0, sse_window_merge="sum", sse_window_sinks=3).float().to(dev)
    m.config.kernel_precision = "ieee"  # exact fp32 dots on CUDA too
    W = m.model.layers[0].self_attn.window
    ids = torch.randint(3, 128, (2, 3 * W + 5), generator=torch.Generator().manual_seed(7)).to(dev)
    calls = []
    real = base.window_attention
    monkeypatch.setattr(base, "window_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def run(kernel: bool):  # the kernels where the window's path is taken (on the CPU too: the interpreter), or not
        m.set_plan("softmax", window_kernel=kernel)
        m.zero_grad()
        logits = m(ids, labels=ids)
        logits.loss.backward()
        grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
        with torch.no_grad():
            out = m(ids[:, : 2 * W + 1], use_cache=True)
            steps = [out.logits]
            for t in range(2 * W + 1, ids.shape[1]):
                out = m(ids[:, t : t + 1], **{CACHE_FIELD: getattr(out, CACHE_FIELD)})
                steps.append(out.logits)
        return logits.logits.detach(), grads, torch.cat(steps, 1)

    got = run(True)
    assert len(calls) == 2 * sum(1 for layer in m.model.layers if getattr(layer.self_attn, "window", 0))
    want = run(False)
    assert len(calls) == 2 * sum(1 for layer in m.model.layers if getattr(layer.self_attn, "window", 0))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
    assert len(got[1]) == len(want[1]) > 0
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_window_kernels_are_chosen_by_the_kernel_backend():
    """The window takes its path by `kernel_backend` as every op decides (`resolve_backend`, in the softmax
    layer's plan): on the CPU "auto", "torch" and "naive" run the banded form, an explicit "triton" says in
    one line what it needs; attention dropout is a reason the kernels do not apply; a caller's
    `window_kernel` is taken as it is."""
    from subquadratic.kernels.utils import triton_available
    from subquadratic.modeling.base import plan_softmax

    def plan(device="cpu", dtype=torch.float32, **kw):  # causal rows of 20 tokens, a window of 8 and 2 sinks
        kw = {**dict(window=8, sinks=2, sink_slots=0, banded=False, sdpa=True, causal_rows=True, causal=True,
                     dropout=False, grad=True, backend="auto"), **kw}
        return plan_softmax((1, 4, 20, 16), (1, 2, 20, 16), dtype, device, **kw)

    for backend in ("auto", "torch", "naive"):
        assert plan(backend=backend) == "banded"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        plan(backend="triton")
    assert plan(window_kernel=True) == "window_kernel" and plan(device="cuda", window_kernel=False) == "banded"
    if triton_available():  # the plans of a CUDA device, on any machine
        assert plan(device="cuda") == "window_kernel"
        assert plan(device="cuda", dropout=True) == "banded"
        assert plan(device="cuda", dtype=torch.float64) == "banded"
        with pytest.raises(ValueError, match="attention dropout"):
            plan(device="cuda", backend="triton", dropout=True)
