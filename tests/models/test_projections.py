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


class _Owner(projections.PackedInputs, nn.Module):
    input_projection_names = ("a", "b", "c")

    def __init__(self, sizes, biased):
        super().__init__()
        self.config = type("C", (), {"fuse_projections": True})()
        for n, size, b in zip(self.input_projection_names, sizes, biased, strict=True):
            setattr(self, n, nn.Linear(24, size, bias=b))


def test_packed_members_with_gradients_are_the_separate_ones():
    """With gradients the members run as one matmul over the pack (their parameters views of its rows):
    the separate members' values and the gradients of x and of every parameter (fp64), none for a frozen
    member; under autocast, the separate members' under autocast (bf16 operands, float32 gradients)."""
    torch.manual_seed(0)
    owner = _Owner((5, 16, 40), (True, False, True)).double()
    owner.b.weight.requires_grad_(False)  # frozen: no gradient
    x = torch.randn(2, 7, 24, dtype=torch.float64, requires_grad=True)
    ref = {n: getattr(owner, n)(x) for n in owner.input_projection_names}
    outs = projections.input_projections(owner, x)
    pack = owner.__dict__["_input_pack"]
    assert pack.weight.shape[0] == 16 + 16 + 48
    assert owner.c.weight.untyped_storage().data_ptr() == pack.weight.untyped_storage().data_ptr()
    assert outs["a"].grad_fn is not None and "PackedLinear" in type(outs["a"].grad_fn.next_functions[0][0]).__name__
    ws = {n: torch.randn_like(r) for n, r in ref.items()}
    params = [x, owner.a.weight, owner.a.bias, owner.c.weight, owner.c.bias]
    g = torch.autograd.grad(sum((outs[n] * w).sum() for n, w in ws.items()), params)
    ref = {n: getattr(owner, n)(x) for n in owner.input_projection_names}  # again: the weights are views now
    g_ref = torch.autograd.grad(sum((ref[n] * w).sum() for n, w in ws.items()), params)
    for n in ref:
        torch.testing.assert_close(outs[n], ref[n], rtol=1e-12, atol=1e-12)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    loss = sum(o.sum() for o in projections.input_projections(owner, x).values())
    loss.backward()
    assert owner.b.weight.grad is None and owner.a.weight.grad is not None
    assert projections.packed_output(owner, x, ("a", "b")) is None  # a member left out: not packed with gradients
    owner.float()
    xf = x.detach().float().requires_grad_()
    params = [xf, owner.a.weight, owner.a.bias, owner.c.weight, owner.c.bias]
    results = []
    for fuse in (True, False):
        owner.config.fuse_projections = fuse
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = projections.input_projections(owner, xf)
            assert all(o.dtype == torch.bfloat16 for o in outs.values())
            assert ("PackedLinear" in type(outs["a"].grad_fn.next_functions[0][0]).__name__) == fuse
            loss = sum((outs[n].float() * w.float()).sum() for n, w in ws.items())
        results.append((outs, torch.autograd.grad(loss, params)))
    (packed, g), (separate, g_ref) = results
    for n in packed:
        torch.testing.assert_close(packed[n], separate[n], rtol=1e-2, atol=1e-2)
    for a, b in zip(g, g_ref, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
