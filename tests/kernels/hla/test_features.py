"""HLA's fused inputs (`kernels.hla.features`: the L2-normalised, scaled q and k, and the GQA repeat
of k and v) against their PyTorch form: values (fp32, bf16, GQA groups 1..4, head dims that are not
powers of two, a zero row under F.normalize's eps) and the gradients of q, k and v against fp64
autograd, with poisoned outputs (tests/kernels/conftest.py). On CPU the kernels run under
TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.hla.features import hla_features, hla_features_reference  # noqa: E402

from ..fused_models import CopyCounter, forced_kernel_matches, perturb, rel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # B, T, HQ, H, D, Dv
    (2, 5, 4, 2, 16, 16),
    (1, 7, 3, 3, 24, 40),  # no grouping, dims that are not powers of two
    (1, 21, 8, 2, 32, 32),  # pairs over several programs
]


def make(B, T, HQ, H, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HQ, D, generator=g) * 2.0
    k = torch.randn(B, T, H, D, generator=g) * 2.0
    v = torch.randn(B, T, H, Dv, generator=g)
    q[0, 1, 0] = 0.0  # a zero row: the norm under eps
    k[0, 2, 0] = 0.0
    return [t.to(DEV, dtype) for t in (q, k, v)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_match_the_pytorch_form(case, dtype):
    xs = make(*case, dtype, seed=sum(case))
    got = hla_features(*xs, 0.7, backend="triton")
    want = hla_features_reference(*xs, 0.7)
    exact = hla_features_reference(*(t.double() for t in xs), 0.7)
    for a, b, e in zip(got, want, exact, strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        assert torch.isfinite(a).all()
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:  # rounded once here, three times there (and the interpreter's bf16 casts truncate)
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -5, atol=2 ** -6)
        assert rel(a, e) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_fp64_autograd(case):
    xs = make(*case, torch.float32, seed=sum(case) + 1)
    gen = torch.Generator().manual_seed(3)
    B, T, HQ, H, D, Dv = case
    dys = [torch.randn(s, generator=gen).to(DEV) for s in ((B, T, HQ, D), (B, T, HQ, D), (B, T, HQ, Dv))]

    def grads(fn, dtype):
        args = [t.detach().to(dtype).requires_grad_() for t in xs]
        sum((o * dy.to(dtype)).sum() for o, dy in zip(fn(*args), dys, strict=True)).backward()
        return [a.grad for a in args]

    got = grads(lambda *a: hla_features(*a, 0.7, backend="triton"), torch.float32)
    want = grads(lambda *a: hla_features_reference(*a, 0.7), torch.float64)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        assert rel(a, b) < 1e-5


def test_dispatch():
    xs = make(1, 3, 2, 1, 8, 8, torch.float64)
    for a, b in zip(hla_features(*xs, 1.0), hla_features_reference(*xs, 1.0), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="dtypes"):
        hla_features(*xs, 1.0, backend="triton")
    xs = make(1, 3, 3, 2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="shapes"):
        hla_features(*xs, 1.0, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        hla_features(*xs, 1.0, backend="cuda")


@pytest.mark.parametrize("window", [0, 8])
def test_the_mixer_takes_the_kernel_with_the_values_and_gradients_of_its_pytorch_form(window, monkeypatch,
                                                                                      one_thread):
    """HLA's q / k normalisation and repeat through the kernel (as on CUDA with a kernel_backend in
    FEATURE_KERNEL_BACKENDS; here forced, on a GPU or under the interpreter): the logits and every
    parameter's gradient of the PyTorch ops, the kernel once per HLA layer and forward."""
    from subquadratic import HLAForCausalLM
    from subquadratic.families.hla import modeling as hla_modeling
    from subquadratic.families.hla.configuration import tiny_hla_config
    from subquadratic.kernels.hla import features, triton_features

    torch.manual_seed(0)
    model = HLAForCausalLM(tiny_hla_config(hla_sliding_window=window)).eval()
    perturb(model)
    gates = [(hla_modeling, "hla_features_takes_kernel", lambda *xs: features.hla_features_unsupported(*xs) is None),
             (hla_modeling, "FEATURE_KERNEL_BACKENDS", ("auto", "triton"))]
    calls = forced_kernel_matches(model, monkeypatch, gates, triton_features.HLAFeatures, "apply")
    assert calls == model.config.mixer_types.count("hla") > 0


@pytest.mark.parametrize("B,T", [(2, 5), (1, 7), (3, 1)])
def test_strided_inputs_without_gradients(B, T):
    """Without gradients the kernel reads q, k, v where they are when they are column slices of one
    packed projection output (`modeling.projections`: tokens one stride apart): no copy, the values
    of the PyTorch form on contiguous copies; a transposed view is copied first, same values."""
    HQ, H, D, Dv = 4, 2, 16, 8
    g = torch.Generator().manual_seed(B * 10 + T)
    packed = torch.randn(B, T, HQ * D + H * D + H * Dv + 5, generator=g).to(DEV)
    q, k, v = packed[..., :HQ * D], packed[..., HQ * D:(HQ + H) * D], packed[..., (HQ + H) * D:-5]
    q, k, v = q.view(B, T, HQ, D), k.view(B, T, H, D), v.view(B, T, H, Dv)
    with torch.no_grad(), CopyCounter() as copies:
        got = hla_features(q, k, v, 0.7, backend="triton")
    assert copies.n == 0
    want = hla_features_reference(q.contiguous(), k.contiguous(), v.contiguous(), 0.7)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if T > 1 and B > 1:
        xs = [t.transpose(0, 1) for t in (q, k, v)]
        with torch.no_grad(), CopyCounter() as copies:
            got = hla_features(*xs, 0.7, backend="triton")
        assert copies.n == 3
        for a, b in zip(got, hla_features_reference(*(t.contiguous() for t in xs), 0.7), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
