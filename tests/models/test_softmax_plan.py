"""The softmax layers' plan (`base.plan_softmax`): the path of each kind of call (a table of inputs and the
path they give; where a masked query takes the decode kernels), a caller's path, and one plan per forward
for every softmax layer that plans alike (the window branches' included)."""

from __future__ import annotations

import pytest
import torch

from subquadratic.modeling import base
from subquadratic.modeling.base import plan_softmax

#: (plan_softmax's keywords over CALL, the path): CALL is a training call of causal rows, no window
CALL = dict(q_shape=(2, 4, 20, 16), k_shape=(2, 2, 20, 16), window=None, sinks=0, sink_slots=0, banded=False,
            sdpa=True, causal_rows=True, causal=True, dropout=False, grad=True, backend="auto")
PLANS = [
    ({}, "causal"),
    (dict(sdpa=False), "eager"),
    (dict(window=8), "banded"),  # a window shorter than the new tokens: O(T W), the kernels on CUDA only
    (dict(window=32), "causal"),  # a window longer than them: every causal key in view
    (dict(window=8, window_kernel=True), "window_kernel"),
    # a window ring of 8 slots and 2 sink slots before 20 new tokens
    (dict(window=8, sinks=2, sink_slots=2, banded=True, causal_rows=False, k_shape=(2, 2, 30, 16)), "banded"),
    (dict(window=8, causal_rows=False, k_shape=(2, 2, 30, 16)), "masked"),  # a ring that is not banded
    # one query: over every slot when all are real, else under a mask (no dropout)
    (dict(q_shape=(2, 4, 1, 16), causal_rows=False), "causal"),
    (dict(q_shape=(2, 4, 1, 16), causal_rows=False, causal=False), "decode"),
    (dict(q_shape=(2, 4, 1, 16), causal_rows=False, causal=False, dropout=True), "masked"),
    # a chunk over a padded cache: the grouped form without gradients where the mask copy is the smaller
    (dict(causal_rows=False, causal=False, k_shape=(2, 2, 40, 16)), "masked"),
    (dict(causal_rows=False, causal=False, k_shape=(2, 2, 40, 16), grad=False), "grouped"),
    (dict(causal_rows=False, causal=False, k_shape=(2, 4, 40, 16), grad=False), "masked"),  # no groups
    # a chunk after a cache whose slots are all real (a chunked prefill): the lower-right causal bias, no mask
    (dict(causal_rows=False, k_shape=(2, 2, 40, 16)), "causal_lower_right"),
    (dict(causal_rows=False, k_shape=(2, 2, 40, 16), window=64), "causal_lower_right"),  # every key in view
    (dict(causal_rows=False, k_shape=(2, 2, 40, 16), window=30), "masked"),  # a window: the mask
    (dict(path="eager"), "eager"),
]

#: one query under a mask (a static cache's step) as CALL's keywords
STEP = dict(q_shape=(2, 4, 1, 16), k_shape=(2, 2, 40, 16), causal_rows=False, causal=False, grad=False)
#: (plan_softmax's keywords over CALL, the path, whether the row plans for a CUDA device with Triton
#: installed): where a masked query takes the decode kernels
DECODE_PLANS = [
    (STEP, "decode", False),  # the CPU: the PyTorch form
    ({**STEP, "device": "cuda"}, "decode_kernel", True),
    ({**STEP, "device": "cuda", "dtype": torch.bfloat16}, "decode_kernel", True),
    ({**STEP, "device": "cuda", "backend": "torch"}, "decode", False),
    ({**STEP, "device": "cuda", "backend": "naive"}, "decode", False),
    ({**STEP, "device": "cuda", "dtype": torch.float64}, "decode", False),  # not a kernel dtype
    ({**STEP, "device": "cuda", "q_shape": (2, 4, 1, 512), "k_shape": (2, 2, 40, 512)}, "decode", False),  # dim
    ({**STEP, "device": "cuda", "q_shape": (1, 130, 1, 16), "k_shape": (1, 2, 40, 16)}, "decode", False),  # group
    ({**STEP, "decode_kernel": True}, "decode_kernel", False),  # a caller's, as it is (the interpreter)
    ({**STEP, "device": "cuda", "decode_kernel": False}, "decode", False),
    ({**STEP, "device": "cuda", "dropout": True, "grad": True}, "masked", False),  # no decode path with dropout
    ({**STEP, "device": "cuda", "decode_kernel": True, "causal": True}, "causal", False),  # no mask at all
]


@pytest.mark.parametrize("given,want", PLANS)
def test_the_softmax_path_of_each_call(given, want):
    kw = {**CALL, **given}
    assert plan_softmax(kw.pop("q_shape"), kw.pop("k_shape"), torch.float32, "cpu", **kw) == want


@pytest.mark.parametrize("given,want,needs_triton", DECODE_PLANS)
def test_the_decode_kernels_of_each_step(given, want, needs_triton):
    from subquadratic.kernels.utils import triton_available

    if needs_triton and not triton_available():
        pytest.skip("plans the Triton kernels only where Triton is installed")
    kw = {**CALL, "dtype": torch.float32, "device": "cpu", **given}
    assert plan_softmax(kw.pop("q_shape"), kw.pop("k_shape"), kw.pop("dtype"), kw.pop("device"), **kw) == want


def test_a_bad_softmax_path_is_refused():
    with pytest.raises(ValueError, match="softmax path"):
        plan_softmax(**{**CALL, "dtype": torch.float32, "device": "cpu", "path": "fast"})
    kw = {**CALL, **STEP, "backend": "triton"}  # the kernels asked for on the CPU: one line saying what they need
    with pytest.raises(ValueError, match="needs a CUDA device"):
        plan_softmax(kw.pop("q_shape"), kw.pop("k_shape"), torch.float32, "cpu", **kw)


def test_the_softmax_layers_plan_once_per_forward(monkeypatch):
    """The window branches of every layer share one plan per forward; a caller's path reaches them all
    (the eager function: the same logits)."""
    from .sse.test_modeling_sse import lively

    m = lively("tiny-swa", 0, sse_window_merge="sum").float()
    window_layers = sum(1 for layer in m.model.layers if getattr(layer.self_attn, "window", 0))
    assert window_layers >= 2
    made, real = [], base.plan_softmax
    monkeypatch.setattr(base, "plan_softmax", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m(ids, use_cache=False).logits
        assert made == ["banded"]
        m.set_plan("softmax", path="eager")
        got = m(ids, use_cache=False).logits
    assert made == ["banded", "eager"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_chunk_after_real_cached_slots_takes_the_lower_right_causal_bias(monkeypatch):
    """A chunk of new tokens after a cache whose slots are all real (a chunked prefill's second chunk) runs SDPA
    with the lower-right causal bias, no [B, T, S] mask: the logits and gradients of the masked path."""
    from .sse.test_modeling_sse import lively

    m = lively("tiny-h", 0).float()
    made, real = [], base.plan_softmax
    monkeypatch.setattr(base, "plan_softmax", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (2, 30), generator=g)
    weight = torch.randn(2, 12, m.config.vocab_size, generator=g)

    def chunk():
        with torch.no_grad():
            past = getattr(m(ids[:, :18], use_cache=True), base.CACHE_FIELD)
        made.clear()
        emb = m.get_input_embeddings()(ids[:, 18:]).detach().requires_grad_()
        logits = m(inputs_embeds=emb, use_cache=True, **{base.CACHE_FIELD: past}).logits
        grads = torch.autograd.grad((logits * weight).sum(), [emb, *m.parameters()], allow_unused=True)
        return logits, [x for x in grads if x is not None]

    got, got_grads = chunk()
    assert made == ["causal_lower_right"]
    m.set_plan("softmax", path="masked")
    want, want_grads = chunk()
    assert made == ["masked"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(got_grads) == len(want_grads) > 2
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
