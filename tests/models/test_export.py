"""No host synchronisation and no data-dependent shape in any family's forward: the forward of every
family exports with torch.export and compiles with torch.compile(fullgraph=True) on CPU, and the
exported / compiled programs compute what the eager model computes, with and without padding."""

from __future__ import annotations

import pytest
import torch

from .test_conventions import CASES, ids, make

pytestmark = pytest.mark.usefixtures("one_thread")

#: Every case of the conventions tests plus the SSE variants with forms of their own.
EXPORT_CASES = {**{c: {} for c in CASES}, "sse-gdn": dict(sse_base="gdn"), "sse-swa": dict(sse_sliding_window=8),
                "sse-key-topk-k2": dict(sse_key_topk=4, sse_top_k=2)}


def _model(case: str):
    if case in CASES:
        return make(case)
    return make("sse", **EXPORT_CASES[case])


def _inputs():
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :5] = 0  # left padding: positions and routing of padded tokens must not need the host
    return x, mask


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_forward_exports(case):
    model = _model(case)
    x, mask = _inputs()
    ep = torch.export.export(model, (x,), {"attention_mask": mask, "use_cache": False})
    with torch.no_grad():
        want = model(x, attention_mask=mask, use_cache=False).logits
        got = ep.module()(x, attention_mask=mask, use_cache=False).logits
        other = ids(seed=7)  # the program is not specialised to the values it was traced with
        got_other = ep.module()(other, attention_mask=torch.ones_like(other), use_cache=False).logits
        want_other = model(other, attention_mask=torch.ones_like(other), use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_other, want_other, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_forward_compiles_with_fullgraph(case):
    """fullgraph=True fails on any graph break (a host sync, a data-dependent shape); the aot_eager
    backend traces the whole graph through AOTAutograd without needing a C++ compiler."""
    torch._dynamo.reset()
    model = _model(case)
    x, mask = _inputs()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = compiled(x, attention_mask=mask, use_cache=False).logits
        want = model(x, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
