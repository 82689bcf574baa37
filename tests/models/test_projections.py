"""`modeling.projections`' concatenated members with gradients: the separate members' values and
gradients, one matmul whose weight rows (and every slot) are aligned to ALIGN."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from subquadratic.modeling import projections


class Ops(TorchDispatchMode):
    """The names of the aten ops dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


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


def test_linear_plus_is_one_gemm_with_the_sum_and_falls_back_where_the_layer_must_run():
    """`linear_plus(lin, x, addend)`: lin(x) + addend's values and gradients (x, the weight and the
    addend), as one addmm for a plain bias-free nn.Linear; the two ops for a biased layer, one with a
    hook (which must run) and an addend of another shape."""
    torch.manual_seed(0)
    lin = nn.Linear(24, 10, bias=False).double()
    x = torch.randn(2, 7, 24, dtype=torch.float64, requires_grad=True)
    add = torch.randn(2, 7, 10, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 7, 10, dtype=torch.float64)
    with Ops() as ops:
        out = projections.linear_plus(lin, x, add)
    assert ops.names.count("addmm") == 1 and "add" not in ops.names and "mm" not in ops.names
    ref = lin(x) + add
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad((out * w).sum(), (x, add, lin.weight))
    g_ref = torch.autograd.grad((ref * w).sum(), (x, add, lin.weight))
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert g[2].is_contiguous()

    biased = nn.Linear(24, 10).double()
    hooked = nn.Linear(24, 10, bias=False).double()
    calls = []
    hooked.register_forward_hook(lambda *a: calls.append(1))
    for layer, addend in ((biased, add), (hooked, add), (lin, add[:, :1])):
        with Ops() as ops:
            out = projections.linear_plus(layer, x, addend)
        assert "addmm" not in ops.names or layer is biased  # a biased F.linear may run as addmm itself
        assert "add" in ops.names
        torch.testing.assert_close(out, layer(x) + addend, rtol=1e-12, atol=1e-12)
    assert calls == [1, 1]  # the hooked layer's forward ran (in linear_plus and in the reference)


def test_stacked_linears_are_the_members_without_gradients():
    """`stacked_linears`: members of one weight shape on adjacent equal-width column slices of one tensor
    as one bmm over their stacked weights (the members' parameters views of the stack), the members'
    values; None (the caller runs each member) for inputs that are not adjacent slices,
    members of other shapes or with a hook; an in-place weight update is seen, a dtype change restacks."""
    class Owner(projections.PackedInputs, nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"fuse_projections": True})()
            self.a, self.b, self.c = (nn.Linear(8, 12, bias=False) for _ in range(3))
            self.d = nn.Linear(4, 12, bias=False)

    torch.manual_seed(0)
    m = Owner().double()
    y = torch.randn(2, 5, 30, dtype=torch.float64)  # a packed result: slots of 8 at 3, 11, 19
    xs = [y[..., 3 + 8 * i: 11 + 8 * i] for i in range(3)]
    names = ("a", "b", "c")
    with torch.no_grad():
        with Ops() as ops:
            out = projections.stacked_linears(m, names, xs)
        assert ops.names.count("bmm") == 1 and "mm" not in ops.names
        for o, n, x in zip(out, names, xs, strict=True):
            assert o.shape == (2, 5, 12)
            torch.testing.assert_close(o, getattr(m, n)(x), rtol=1e-12, atol=1e-12)
        stack = m.__dict__["_stacks"][names]
        assert m.b.weight.untyped_storage().data_ptr() == stack.weight.untyped_storage().data_ptr()
        m.b.weight.mul_(0.5)  # in place, as an optimizer step: the stack sees it
        torch.testing.assert_close(projections.stacked_linears(m, names, xs)[1], m.b(xs[1]), rtol=1e-12, atol=1e-12)
        stack = m.__dict__["_stacks"][names]
        assert projections.stacked_linears(m, names, [xs[0], xs[2], xs[1]]) is None  # not one step apart
        assert projections.stacked_linears(m, names[:2], [xs[1], xs[0]]) is None  # in reverse order
        assert m.__dict__["_stacks"][names] is stack and names[:2] not in m.__dict__["_stacks"]  # nothing rebound
        assert projections.stacked_linears(m, ("a", "d"), [xs[0], y[..., :4]]) is None  # another shape
        with torch.inference_mode():  # views of inference tensors keep no `_base`: the same storage serves
            yi = y * 1.0
            out = projections.stacked_linears(m, names, [yi[..., 3 + 8 * i: 11 + 8 * i] for i in range(3)])
            torch.testing.assert_close(out[0], m.a(yi[..., 3:11]), rtol=1e-12, atol=1e-12)
            apart = [torch.randn(2, 5, 8, dtype=torch.float64) for _ in range(3)]  # separate tensors
            assert projections.stacked_linears(m, names, apart) is None
        m.float()  # new tensors: the stacks are dropped, then rebuilt in fp32
        assert "_stacks" not in m.__dict__
        yf = y.float()
        xs = [yf[..., 3 + 8 * i: 11 + 8 * i] for i in range(3)]
        out = projections.stacked_linears(m, names, xs)
        assert m.__dict__["_stacks"][names].weight.dtype == torch.float32
        torch.testing.assert_close(out[2], m.c(xs[2]))
        m.c.register_forward_hook(lambda *a: None)
        assert projections.stacked_linears(m, names, xs) is None  # a hook must run


def test_stacked_linears_with_gradients_are_the_members():
    """With gradients `stacked_linears` is one bmm forward and two backward (`_StackedLinear`), with the
    members' values and the gradients of the packed input and of every member's weight (an unused output
    gives its member none, as the members' graph does); under autocast the members' dtype and values."""
    class Owner(projections.PackedInputs, nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"fuse_projections": True})()
            self.a, self.b, self.c = (nn.Linear(8, 12, bias=False) for _ in range(3))

    torch.manual_seed(1)
    m, ref = Owner().double(), Owner().double()
    ref.load_state_dict(m.state_dict())
    names = ("a", "b", "c")
    y0 = torch.randn(2, 5, 30, dtype=torch.float64)
    dys = [torch.randn(2, 5, 12, dtype=torch.float64) for _ in names]
    for used in ((0, 1, 2), (0, 2)):
        y, yr = y0.clone().requires_grad_(), y0.clone().requires_grad_()
        with Ops() as ops:
            out = projections.stacked_linears(m, names, [y[..., 3 + 8 * i: 11 + 8 * i] for i in range(3)])
            sum((out[i] * dys[i]).sum() for i in used).backward()
        assert ops.names.count("bmm") == 3 and "mm" not in ops.names and "addmm" not in ops.names
        want = [getattr(ref, n)(yr[..., 3 + 8 * i: 11 + 8 * i]) for i, n in enumerate(names)]
        sum((want[i] * dys[i]).sum() for i in used).backward()
        for o, w in zip(out, want, strict=True):
            torch.testing.assert_close(o, w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(y.grad, yr.grad, rtol=1e-12, atol=1e-12)
        for n in names:
            got, want = getattr(m, n).weight.grad, getattr(ref, n).weight.grad
            assert (got is None) == (want is None) == (n == "b" and len(used) == 2), n
            if want is not None:
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        m.zero_grad()
        ref.zero_grad()
    m.float()
    ref.float()
    y = y0.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = projections.stacked_linears(m, names, [y[..., 3 + 8 * i: 11 + 8 * i] for i in range(3)])
        want = [getattr(ref, n)(y[..., 3 + 8 * i: 11 + 8 * i]) for i, n in enumerate(names)]
    for o, w in zip(out, want, strict=True):
        assert o.dtype == w.dtype == torch.bfloat16
        torch.testing.assert_close(o, w)
    sum(o.float().sum() for o in out).backward()
    assert m.a.weight.grad.dtype == torch.float32 and y.grad.dtype == torch.float32
