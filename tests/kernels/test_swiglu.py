"""The MLP's SiLU-product kernel (`kernels.swiglu`) against its PyTorch form: on the column slices of a
packed projection's output (the form it runs on) and on contiguous tensors, fp32 and fp16, with poisoned
outputs (tests/kernels/conftest.py); the fallbacks; a model's MLPs taking it without gradients. On CPU
the kernel runs under TRITON_INTERPRET=1 (bf16 on the GPU only)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.swiglu import (  # noqa: E402
    silu_mul,
    silu_mul_packed,
    silu_mul_packed_unsupported,
    silu_mul_reference,
    silu_mul_unsupported,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def packed(B, T, W, dtype, pad=16, seed=0):
    """gate and up as column slices of one [B, T, 2 W + pad] tensor (pad: a third member after them)."""
    g = torch.Generator().manual_seed(seed)
    out = (torch.randn(B, T, 2 * W + pad, generator=g) * 3.0).to(DEV, dtype)
    return out[..., :W], out[..., W:2 * W]


@pytest.mark.parametrize("B,T,W", [(2, 5, 48), (1, 3, 1100), (3, 1, 16)])  # W over several programs
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_values_on_packed_slices_match_the_pytorch_form(B, T, W, dtype):
    gate, up = packed(B, T, W, dtype, seed=B + T + W)
    assert not gate.is_contiguous()
    got = silu_mul(gate, up, backend="triton")
    want = silu_mul_reference(gate, up)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # fp16: one rounding of the SiLU may differ in the last bit
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    c_gate, c_up = gate.contiguous(), up.contiguous()
    torch.testing.assert_close(silu_mul(c_gate, c_up, backend="triton"), want, rtol=tol, atol=tol)


def test_inputs_it_refuses():
    gate, up = packed(1, 4, 32, torch.float32)
    assert silu_mul_unsupported(gate, up) is None
    assert "alike" in silu_mul_unsupported(gate, up[..., :16])
    assert "dtypes" in silu_mul_unsupported(gate.double(), up.double())
    assert "contiguous" in silu_mul_unsupported(gate.transpose(1, 2), up.transpose(1, 2))
    w = gate.detach().clone().requires_grad_()
    assert "gradients" in silu_mul_unsupported(w, up)
    with torch.no_grad():
        assert silu_mul_unsupported(w, up) is None
    with pytest.raises(ValueError, match="silu-mul"):
        silu_mul(w, up, backend="triton")
    y = silu_mul(w, up)  # "auto" falls back to the PyTorch form, which has gradients
    y.sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_the_mlps_take_it_without_gradients(monkeypatch, one_thread):
    """In eval mode without gradients every MLP (gate and up packed) runs the kernel, forced here as on
    CUDA: the logits of the PyTorch form."""
    from subquadratic import HLAForCausalLM
    from subquadratic.families.hla.configuration import tiny_hla_config
    from subquadratic.kernels import triton_swiglu

    from .fused_models import perturb

    torch.manual_seed(0)
    model = HLAForCausalLM(tiny_hla_config()).eval()
    perturb(model)
    model.to(DEV)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        calls, real = [], triton_swiglu.silu_mul_triton
        model.set_plan("fused", silu_mul="kernel")
        monkeypatch.setattr(triton_swiglu, "silu_mul_triton", lambda *a: calls.append(a[0].is_contiguous()) or real(*a))
        forced = model(ids, use_cache=False).logits
    torch.testing.assert_close(forced, plain, rtol=1e-5, atol=1e-5)
    assert len(calls) == model.config.num_hidden_layers
    assert not any(calls)  # the packed output's slices, read in place


@pytest.mark.parametrize("cols", [(0, 48, 96), (56, 0, 112), (0, 48, 120)])  # (gate, up, C): up first, a pad
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_values_and_gradients_match_the_pytorch_form(cols, dtype):
    """`silu_mul_packed` on the kernels: the PyTorch form's values and gradient of the packed output
    (zero in columns outside the two slices), gate before or after up."""
    g0, u0, C = cols
    W = 48
    gen = torch.Generator().manual_seed(C + g0)
    y = (torch.randn(3, 5, C, generator=gen) * 3.0).to(DEV, dtype).requires_grad_()
    dout = torch.randn(3, 5, W, generator=gen).to(DEV, dtype)
    got = silu_mul_packed(y, g0, u0, W, backend="triton")
    (dy,) = torch.autograd.grad(got, y, dout)
    y2 = y.detach().clone().requires_grad_()
    want = silu_mul_reference(y2[..., g0:g0 + W], y2[..., u0:u0 + W])
    (dy_ref,) = torch.autograd.grad(want, y2, dout)
    tol = 1e-6 if dtype == torch.float32 else 2e-3  # fp16: a rounding of the SiLU may differ in the last bit
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(dy, dy_ref, rtol=tol, atol=tol)
    outside = torch.ones(C, dtype=torch.bool)
    outside[g0:g0 + W] = outside[u0:u0 + W] = False
    assert (dy[..., outside.to(DEV)] == 0).all() and outside.sum() == C - 2 * W


def test_packed_inputs_it_refuses():
    y = torch.zeros(1, 4, 96)
    assert silu_mul_packed_unsupported(y, 0, 48, 48) is None
    assert "disjoint" in silu_mul_packed_unsupported(y, 0, 40, 48)
    assert "disjoint" in silu_mul_packed_unsupported(y, 0, 60, 48)
    assert "dtype" in silu_mul_packed_unsupported(y.double(), 0, 48, 48)
    assert "contiguous" in silu_mul_packed_unsupported(torch.zeros(1, 96, 4).transpose(1, 2), 0, 2, 2)
    out = silu_mul_packed(y.double().requires_grad_(), 0, 48, 48)  # "auto": the PyTorch form
    assert out.shape == (1, 4, 48) and out.grad_fn is not None


def test_the_mlps_take_it_in_training(monkeypatch, one_thread):
    """In training every MLP runs gate and up packed and the SiLU product's kernels forward and backward
    (forced here as on CUDA): the logits and every parameter gradient of the PyTorch forms."""
    from subquadratic import HLAForCausalLM
    from subquadratic.families.hla.configuration import tiny_hla_config
    from subquadratic.kernels import triton_swiglu

    from .fused_models import forced_kernel_matches, perturb

    torch.manual_seed(0)
    model = HLAForCausalLM(tiny_hla_config()).train()
    perturb(model)
    gates = [lambda forced: model.set_plan("fused", **({"silu_mul": "kernel"} if forced else {}))]
    calls = forced_kernel_matches(model, monkeypatch, gates, triton_swiglu.SiluMulPacked, "apply")
    assert calls == model.config.num_hidden_layers


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_bf16_real_shapes_on_gpu():
    """Llama-3.2-1B's MLP (8192 wide) at 2048 tokens in bf16: the PyTorch form's values."""
    gate, up = packed(1, 2048, 8192, torch.bfloat16)
    got, want = silu_mul(gate, up), silu_mul_reference(gate, up)
    assert ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-2)).max().item() <= 1e-2
    y = gate._base.detach().requires_grad_()  # the packed output, with gradients: forward and backward kernels
    got = silu_mul_packed(y, 0, 8192, 8192)
    dout = torch.randn_like(got)
    (dy,) = torch.autograd.grad(got, y, dout)
    y2 = y.detach().clone().requires_grad_()
    want = silu_mul_reference(y2[..., :8192], y2[..., 8192:16384])
    (dy_ref,) = torch.autograd.grad(want, y2, dout)
    assert (got == want).float().mean().item() > 0.97
    assert (dy == dy_ref).float().mean().item() > 0.95
    torch.testing.assert_close(dy.float(), dy_ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_more_tokens_than_a_grid_axis_takes_on_gpu():
    """A 128k prompt's MLP: more tokens than the 65535 programs of a grid's second or third axis, forward and
    backward (the tokens ride the first axis)."""
    T, W = 70_000, 64
    y = packed(1, T, W, torch.float32, pad=0)[0]._base.detach().requires_grad_()
    got = silu_mul_packed(y, 0, W, W)
    dout = torch.randn_like(got)
    (dy,) = torch.autograd.grad(got, y, dout)
    y2 = y.detach().clone().requires_grad_()
    want = silu_mul_reference(y2[..., :W], y2[..., W:])
    (dy_ref,) = torch.autograd.grad(want, y2, dout)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dy, dy_ref, rtol=1e-5, atol=1e-5)
