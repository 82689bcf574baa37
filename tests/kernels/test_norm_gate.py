"""The fused output norm and gate (`kernels.norm_gate`) against its PyTorch form: values (fp32 and
bf16, per-head and shared weights, head dims that are not powers of two) and the gradients of x,
weight and gate against fp64 autograd, with poisoned outputs (tests/kernels/conftest.py). On CPU
the kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.norm_gate import add_norm, add_norm_reference, norm_gate, norm_gate_reference  # noqa: E402

from .fused_models import forced_kernel_matches, perturb  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # B, T, H, D, per-head weight
    (2, 5, 3, 32, True),
    (1, 7, 4, 24, False),  # D not a power of two, one weight for every head
    (1, 33, 2, 64, True),  # rows spanning several programs, a partial last one
]


def make(B, T, H, D, per_head, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, D, generator=g) * 2.0
    gate = torch.randn(B, T, H, D, generator=g) * 3.0
    w = 1.0 + 0.5 * torch.randn(*((H, D) if per_head else (D,)), generator=g)
    return [t.to(DEV, dtype) for t in (x, w, gate)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_match_the_pytorch_form(case, dtype):
    x, w, gate = make(*case, dtype, seed=sum(case[:4]))
    assert_values_match(lambda *a: norm_gate(*a, 1e-6, backend="triton"), lambda *a: norm_gate_reference(*a, 1e-6),
                        (x, w, gate), dtype)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gate_sliced_from_a_packed_projection_is_read_in_place(case, dtype):
    """Without gradients a gate whose tokens are rows of one stride (a column slice of a packed projection's
    output, as HLA's is) is read where it is: the values of its contiguous copy, bit for bit."""
    B, T, H, D, per_head = case
    x, w, _ = make(*case, dtype, seed=sum(case[:4]) + 2)
    packed = torch.randn(B, T, 3 * H * D + 5, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    gate = packed[..., H * D + 5:2 * H * D + 5].view(B, T, H, D)
    assert not gate.is_contiguous()
    with torch.no_grad():
        got = norm_gate(x, w, gate, 1e-6, backend="triton")
    want = norm_gate(x, w, gate.contiguous(), 1e-6, backend="triton")
    assert torch.equal(got, want)
    assert_values_match(lambda *a: norm_gate(*a, 1e-6, backend="triton"), lambda *a: norm_gate_reference(*a, 1e-6),
                        (x, w, gate), dtype)


def assert_values_match(fn, reference, inputs, dtype):
    """fn's values against reference's on the same inputs (the same roundings) and in fp64."""
    got, want = fn(*inputs), reference(*inputs)
    assert got.dtype == want.dtype == dtype and got.shape == inputs[0].shape
    assert torch.isfinite(got).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # the same roundings (the interpreter's bf16 casts may round differently from the GPU's)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -5, atol=2 ** -5)
        if DEV == "cuda":  # the fp32 rsqrt and sigmoid may move the last bit
            assert (got == want).float().mean() > 0.9
    exact = reference(*(t.double() for t in inputs))
    assert ((got.double() - exact).norm() / exact.norm()).item() < (1e-6 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_fp64_autograd(case):
    x, w, gate = make(*case, torch.float32, seed=sum(case[:4]) + 1)
    assert_fp64_gradients(lambda *a: norm_gate(*a, 1e-6, backend="triton"), lambda *a: norm_gate_reference(*a, 1e-6),
                          (x, w, gate), ["out", "dx", "dweight", "dgate"], seed=7)


def assert_fp64_gradients(fn, reference, inputs, names, seed):
    """fn's output and input gradients (fp32) against reference's in fp64 autograd, for a random dy."""
    dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(seed)).to(DEV)

    def grads(f, dtype):
        args = [t.detach().to(dtype).requires_grad_() for t in inputs]
        out = f(*args)
        (out * dy.to(dtype)).sum().backward()
        return [out.detach(), *(a.grad for a in args)]

    for name, a, b in zip(names, grads(fn, torch.float32), grads(reference, torch.float64), strict=True):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert torch.isfinite(a).all(), name
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-5, name


def test_dispatch():
    """"auto" keeps the PyTorch form off CUDA (and for fp64); "triton" refuses what the kernel cannot take."""
    x, w, gate = make(1, 3, 2, 16, True, torch.float64)
    assert torch.equal(norm_gate(x, w, gate, 1e-6), norm_gate_reference(x, w, gate, 1e-6))
    with pytest.raises(ValueError, match="dtypes"):
        norm_gate(x, w, gate, 1e-6, backend="triton")
    x, w, gate = make(1, 3, 2, 16, True, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        norm_gate(x, w[:1], gate, 1e-6, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        norm_gate(x, w, gate, 1e-6, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_real_shapes_on_gpu():
    """Llama-3.2-1B's heads at 4k tokens in bf16: the PyTorch form's values, the fp64 gradients. The
    fp32 rsqrt and sigmoid may move the last bit of a rounded factor, and then the product's by two
    (on an H200: 1 of the 8,388,608 values, 0.031 apart at 2.45): nearly every value equal, each
    within two bf16 steps."""
    x, w, gate = make(1, 4096, 32, 64, True, torch.bfloat16)
    got = norm_gate(x, w, gate, 1e-5)
    want = norm_gate_reference(x, w, gate, 1e-5)
    assert (got == want).float().mean() > 0.999
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-2)
    dy = torch.randn_like(x)
    args = [t.detach().requires_grad_() for t in (x, w, gate)]
    (norm_gate(*args, 1e-5) * dy).sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (x, w, gate)]
    (norm_gate_reference(*ref, 1e-5) * dy.double()).sum().backward()
    for a, b in zip(args, ref, strict=True):
        assert ((a.grad.double() - b.grad).norm() / b.grad.norm()).item() < 2e-2


@pytest.mark.parametrize("family", ["hla", "sse"])
def test_mixers_take_the_kernel_with_the_values_and_gradients_of_their_pytorch_form(family, monkeypatch, one_thread):
    """HLA's and SSE's output norm and gate through the kernel (as on CUDA for several tokens; here
    forced by their plans' field, on a GPU or under the interpreter): the logits and gradients of the
    PyTorch form, and the kernel runs once per layer and forward."""
    from subquadratic import HLAForCausalLM
    from subquadratic.families.hla.configuration import tiny_hla_config
    from subquadratic.kernels import triton_norm_gate as tng

    from ..models.sse.test_modeling_sse import model as sse_model

    torch.manual_seed(0)
    model = HLAForCausalLM(tiny_hla_config()).eval() if family == "hla" else sse_model("tiny", 0)
    gate = lambda kernel: model.set_plan(family, norm_gate="kernel" if kernel else "torch")  # noqa: E731
    perturb(model)
    assert forced_kernel_matches(model, monkeypatch, [gate], tng.NormGate, "apply") == model.config.num_hidden_layers


# --- add_norm: o + RMSNorm_w(x), SPLA's residual norm ---------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_values_match_the_pytorch_form(case, dtype):
    x, w, o = make(*case, dtype, seed=sum(case[:4]) + 2)
    assert_values_match(lambda *a: add_norm(*a, 1e-6, backend="triton"), lambda *a: add_norm_reference(*a, 1e-6),
                        (o, x, w), dtype)


@pytest.mark.parametrize("case", CASES)
def test_add_norm_gradients_match_fp64_autograd(case):
    x, w, o = make(*case, torch.float32, seed=sum(case[:4]) + 3)
    assert_fp64_gradients(lambda *a: add_norm(*a, 1e-6, backend="triton"), lambda *a: add_norm_reference(*a, 1e-6),
                          (o, x, w), ["out", "do", "dx", "dweight"], seed=8)


def test_add_norm_dispatch():
    x, w, o = make(1, 3, 2, 16, True, torch.float64)
    assert torch.equal(add_norm(o, x, w, 1e-6), add_norm_reference(o, x, w, 1e-6))
    with pytest.raises(ValueError, match="dtypes"):
        add_norm(o, x, w, 1e-6, backend="triton")
    x, w, o = make(1, 3, 2, 16, True, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        add_norm(o, x, w[:1], 1e-6, backend="triton")


def test_spla_takes_the_add_norm_kernel_with_the_values_and_gradients_of_its_pytorch_form(monkeypatch, one_thread):
    """SPLA's o + RMSNorm_gamma(o_rla) through the kernel (as on CUDA; here forced, on a GPU or under the
    interpreter), past the budget so that the residual term counts: the logits and gradients of the
    PyTorch form, the kernel once per layer and forward."""
    from subquadratic.kernels import triton_norm_gate as tng

    from ..models.spla.tiny import tiny_spla

    model = tiny_spla(block_size=4, top_k_blocks=2, num_sink_blocks=1, num_local_blocks=1)
    perturb(model)
    def gate(forced: bool) -> None:
        model.set_plan("fused", **({"add_norm": "kernel"} if forced else {}))

    assert forced_kernel_matches(model, monkeypatch, [gate], tng.AddNorm, "apply") == model.config.num_hidden_layers
