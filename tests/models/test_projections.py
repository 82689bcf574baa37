"""`modeling.projections`' concatenated members with gradients: the separate members' values and
gradients, one matmul whose weight rows (and every slot) are aligned to ALIGN."""

import torch
import torch.nn.functional as F
from torch import nn

from subquadratic.modeling import projections


def test_concatenated_members_are_the_separate_ones(monkeypatch):
    torch.manual_seed(0)
    sizes, biased = (5, 16, 3, 40), (True, False, False, True)
    linears = [nn.Linear(24, n, bias=b).double() for n, b in zip(sizes, biased, strict=True)]
    x = torch.randn(2, 7, 24, dtype=torch.float64, requires_grad=True)
    seen = []
    linear = F.linear

    def spy(inp, w, b=None):
        seen.append(w.shape[0])
        return linear(inp, w, b)

    monkeypatch.setattr(projections.F, "linear", spy)
    outs = projections._concat_outputs(linears, x)
    assert seen == [16 + 16 + 16 + 48]  # one matmul, each slot rounded up to ALIGN rows
    monkeypatch.setattr(projections.F, "linear", linear)
    ref = [lin(x) for lin in linears]
    assert [o.shape[-1] for o in outs] == list(sizes)
    for o, r in zip(outs, ref, strict=True):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    ws = [torch.randn_like(r) for r in ref]
    params = [x, *[p for lin in linears for p in lin.parameters()]]
    g = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, ws, strict=True)), params)
    g_ref = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, ws, strict=True)), params)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
