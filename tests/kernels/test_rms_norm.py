"""The decoder's RMSNorm kernels (`kernels.rms_norm`): values and gradients against the PyTorch form
(fp64 oracle for fp32 inputs, LlamaRMSNorm itself for 16-bit ones), the residual add's two outputs and
their gradients, rows that do not fill a program, the model's norm modules taking them."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from subquadratic.kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
    rms_norm_unsupported,
)
from subquadratic.modeling import fused

pytest.importorskip("triton")

EPS = 1e-5


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def inputs(shape, dtype, seed, wdtype=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device())
    h = torch.randn(shape, generator=g).to(dtype).to(device())
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(wdtype or dtype).to(device())
    return x, h, w


def grads(fn, tensors, outs_grad):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    outs = fn(*tensors)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, outs_grad)
    return [o.detach() for o in outs], [t.grad for t in tensors]


@pytest.mark.parametrize("shape", [(2, 7, 48), (1, 33, 96), (3, 5, 200)])
@pytest.mark.parametrize("add", [False, True])
def test_fp32_values_and_gradients_match_the_fp64_form(shape, add):
    x, h, w = inputs(shape, torch.float32, 0)
    g = torch.Generator().manual_seed(1)
    dy, ds = (torch.randn(shape, generator=g).to(device()) for _ in range(2))
    if add:
        got, dgot = grads(lambda a, b, c: add_rms_norm(a, b, c, EPS, backend="triton"), (x, h, w), (ds, dy))
        want, dwant = grads(lambda a, b, c: add_rms_norm_reference(a, b, c, EPS), [t.double() for t in (x, h, w)],
                            (ds.double(), dy.double()))
    else:
        got, dgot = grads(lambda a, c: rms_norm(a, c, EPS, backend="triton"), (x, w), (dy,))
        want, dwant = grads(lambda a, c: rms_norm_reference(a, c, EPS), [t.double() for t in (x, w)], (dy.double(),))
    for a, b in zip(got + dgot, want + dwant, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("wdtype", [None, torch.float32])
def test_bf16_gives_llamas_values(wdtype):
    x, h, w = inputs((2, 19, 64), torch.bfloat16, 2, wdtype)
    llama = LlamaRMSNorm(64, eps=EPS).to(device())
    with torch.no_grad():
        llama.weight.copy_(w)
        llama.weight.data = llama.weight.data.to(w.dtype)
        want = llama(x)
        s, y = add_rms_norm(x, h, w, EPS, backend="triton")
        want_s = x + h
        want_y = llama(want_s)
        got = rms_norm(x, w, EPS, backend="triton")
    assert got.dtype == want.dtype and y.dtype == want_y.dtype and s.dtype == torch.bfloat16
    ulp = 2.0 ** -7
    if x.is_cuda:  # the GPU rounds to nearest as PyTorch does
        assert torch.equal(s, want_s)  # the residual sum rounds once, as x + h does
        for a, b in ((got, want), (y, want_y)):  # at most one rounding step apart (the mean's and rsqrt's last bit)
            assert ((a.float() - b.float()).abs() <= ulp * b.float().abs() + 1e-6).all()
            assert (a == b).float().mean() > 0.97
    else:  # the CPU interpreter truncates its casts to bf16 (twice in the norm): up to two steps more
        for a, b in ((s, want_s), (got, want), (y, want_y)):
            assert ((a.float() - b.float()).abs() <= 3 * ulp * b.float().abs() + 1e-6).all()


def test_bf16_gradients_match_the_fp64_form():
    x, h, w = inputs((2, 24, 80), torch.bfloat16, 3)
    g = torch.Generator().manual_seed(4)
    dy, ds = (torch.randn(x.shape, generator=g).to(torch.bfloat16).to(device()) for _ in range(2))
    _, dgot = grads(lambda a, b, c: add_rms_norm(a, b, c, EPS, backend="triton"), (x, h, w), (ds, dy))
    _, dwant = grads(lambda a, b, c: add_rms_norm_reference(a, b, c, EPS), [t.double() for t in (x, h, w)],
                     (ds.double(), dy.double()))
    for a, b in zip(dgot, dwant, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b, atol=0.05, rtol=0.02)


def test_unused_outputs_get_no_gradient():
    """Only the residual sum used (the norm's output unused), or only the norm: the other's gradient is zero."""
    x, h, w = inputs((2, 5, 32), torch.float32, 5)
    for pick in (0, 1):
        a, b, c = (t.detach().clone().requires_grad_(True) for t in (x, h, w))
        out = add_rms_norm(a, b, c, EPS, backend="triton")[pick]
        out.sum().backward()
        ra, rb, rc = (t.detach().double().requires_grad_(True) for t in (x, h, w))
        add_rms_norm_reference(ra, rb, rc, EPS)[pick].sum().backward()
        for got, want in ((a.grad, ra.grad), (b.grad, rb.grad), (c.grad, rc.grad)):
            want = torch.zeros_like(got, dtype=torch.float64) if want is None else want  # w unused: no graph
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_refused_inputs():
    x = torch.zeros(2, 3, 8)
    assert rms_norm_unsupported(x.double(), torch.ones(8)) is not None
    assert rms_norm_unsupported(x, torch.ones(7)) is not None
    assert rms_norm_unsupported(x, torch.ones(8), torch.zeros(2, 3, 8, dtype=torch.float16)) is not None
    assert rms_norm_unsupported(x, torch.ones(8)) is None
    with pytest.raises(ValueError, match="rms-norm kernel does not take"):
        rms_norm(x.double(), torch.ones(8), EPS, backend="triton")
    torch.testing.assert_close(rms_norm(x.double() + 1, torch.ones(8, dtype=torch.float64), EPS, backend="auto"),
                               rms_norm_reference(x.double() + 1, torch.ones(8, dtype=torch.float64), EPS))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_the_model_norm_takes_the_kernel_where_the_plan_says(backend, monkeypatch):
    """The decoder's norm module: the kernels where the forward's plan says rms_norm="kernel" (planned here
    for CUDA under the model's kernel_backend, run on the CPU under the interpreter), LlamaRMSNorm itself
    otherwise; the same values. A residual of another dtype (autocast) takes the PyTorch form."""
    calls = []
    real = fused.add_rms_norm_kernel
    monkeypatch.setattr(fused, "add_rms_norm_kernel", lambda *a, **k: calls.append(1) or real(*a, **k))
    plan = fused.plan_fused(torch.float32, "cuda", backend=backend, hidden_size=48)
    assert plan.rms_norm == ("kernel" if backend == "auto" else "torch")
    norm = fused.RMSNorm(48, eps=EPS).to(device())
    x, h, _ = inputs((2, 9, 48), torch.float32, 6)
    s, y = norm.add_and_norm(x, h, plan)
    assert len(calls) == (backend == "auto")
    torch.testing.assert_close(y, LlamaRMSNorm.forward(norm, x + h), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(norm(x, plan), LlamaRMSNorm.forward(norm, x), atol=1e-5, rtol=1e-5)
    norm.add_and_norm(x, h.double(), plan)  # a residual of another dtype: the PyTorch form
    assert len(calls) == (backend == "auto")
    assert torch.equal(fused.RMSNorm(48, eps=EPS)(x.cpu()), LlamaRMSNorm.forward(norm.cpu(), x.cpu()))  # no config


@pytest.mark.parametrize("preset", ["tiny-h"])
def test_a_model_through_the_kernels_keeps_its_logits_and_gradients(preset, monkeypatch):
    """A model's norms through the kernels (as on CUDA; here forced, on a GPU or under the interpreter):
    the logits and every parameter's gradient of LlamaRMSNorm's form, and kernel_backend="torch" keeps it."""
    from subquadratic.kernels import triton_rms_norm

    from ..models.sse.test_modeling_sse import model as sse_model
    from .fused_models import forced_kernel_matches

    model = sse_model(preset, 0)
    gates = [lambda forced: model.set_plan("fused", **({"rms_norm": "kernel"} if forced else {}))]
    assert forced_kernel_matches(model, monkeypatch, gates, triton_rms_norm.RMSNormFn, "apply") > 0
    model.set_plan("fused")
    model.config.kernel_backend = "torch"
    with monkeypatch.context() as m:
        m.setattr(triton_rms_norm.RMSNormFn, "apply",
                  lambda *a: pytest.fail("the kernel ran with kernel_backend='torch'"))
        model(torch.randint(3, 128, (1, 9), device=model.device), use_cache=False)
