"""The MLP's SiLU-product kernel (`kernels.swiglu`) against its PyTorch form: on the column slices of a
packed projection's output (the form it runs on) and on contiguous tensors, fp32 and fp16, with poisoned
outputs (tests/kernels/conftest.py); the fallbacks; a model's MLPs taking it without gradients. On CPU
the kernel runs under TRITON_INTERPRET=1 (bf16 on the GPU only)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.swiglu import silu_mul, silu_mul_reference, silu_mul_unsupported  # noqa: E402

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
    from subquadratic.modeling import fused

    from .fused_models import perturb

    torch.manual_seed(0)
    model = HLAForCausalLM(tiny_hla_config()).eval()
    perturb(model)
    model.to(DEV)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        calls, real = [], triton_swiglu.silu_mul_triton
        monkeypatch.setattr(fused, "silu_mul_takes_kernel", lambda g, u: silu_mul_unsupported(g, u) is None)
        monkeypatch.setattr(triton_swiglu, "silu_mul_triton", lambda *a: calls.append(a[0].is_contiguous()) or real(*a))
        forced = model(ids, use_cache=False).logits
    torch.testing.assert_close(forced, plain, rtol=1e-5, atol=1e-5)
    assert len(calls) == model.config.num_hidden_layers
    assert not any(calls)  # the packed output's slices, read in place


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_bf16_real_shapes_on_gpu():
    """Llama-3.2-1B's MLP (8192 wide) at 2048 tokens in bf16: the PyTorch form's values."""
    gate, up = packed(1, 2048, 8192, torch.bfloat16)
    got, want = silu_mul(gate, up), silu_mul_reference(gate, up)
    assert ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-2)).max().item() <= 1e-2
