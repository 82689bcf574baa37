"""HLA's fused inputs (`kernels.hla.features`: the L2-normalised, scaled q and k, and the GQA repeat
of k and v, with the log decays logsigmoid(bias + projection) in the same kernel) against their PyTorch
form: values (fp32, bf16, GQA groups 1..4, head dims that are not powers of two, a zero row under
F.normalize's eps) and the gradients of q, k, v and the decay's bias and projection against fp64
autograd, with poisoned outputs (tests/kernels/conftest.py). On CPU the kernels run under
TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.hla.features import (  # noqa: E402
    hla_features,
    hla_features_and_decay,
    hla_features_reference,
    log_alpha_reference,
)

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
    """HLA's q / k normalisation and repeat through the kernel (as on CUDA under kernel_backend "auto" or
    "triton"; here its plans' field, on a GPU or under the interpreter): the logits and every
    parameter's gradient of the PyTorch ops, the kernel once per HLA layer and forward."""
    from subquadratic import HLAForCausalLM
    from subquadratic.families.hla.configuration import tiny_hla_config
    from subquadratic.kernels.hla import triton_features

    torch.manual_seed(0)
    model = HLAForCausalLM(tiny_hla_config(hla_sliding_window=window)).eval()
    perturb(model)
    features = lambda kernel: model.set_plan("hla", features="kernel" if kernel else "torch")  # noqa: E731
    calls = forced_kernel_matches(model, monkeypatch, [features], triton_features.HLAFeatures, "apply")
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


def make_decay(B, T, HQ, dtype, data=True, seed=0):
    """A decay bias [HQ] and projection [B, T, HQ] (None for a constant decay), logits from strongly
    negative to strongly positive (log alpha from about -9 to -1e-4)."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.linspace(-4.0, 6.0, HQ) + 0.1 * torch.randn(HQ, generator=g)
    proj = 3.0 * torch.randn(B, T, HQ, generator=g) if data else None
    return [None if t is None else t.to(DEV, dtype) for t in (bias, proj)]


@pytest.mark.parametrize("data", [True, False])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decay_values_match_the_pytorch_form(case, dtype, data):
    """log alpha from the feature kernel: fp32, the PyTorch form's values (logsigmoid of the fp32 sum) to
    fp32 rounding, the features unchanged."""
    xs = make(*case, dtype, seed=sum(case) + 2)
    bias, proj = make_decay(*case[:3], dtype, data, seed=sum(case))
    *feats, la = hla_features_and_decay(*xs, 0.7, bias, proj, backend="triton")
    want = log_alpha_reference(bias, proj, case[:3])
    assert la.dtype == want.dtype == torch.float32 and la.shape == want.shape == case[:3]
    torch.testing.assert_close(la, want, rtol=1e-5, atol=1e-7)
    exact = log_alpha_reference(bias.double(), None if proj is None else proj.double(), case[:3])
    assert rel(la, exact) < 1e-6 and (la <= 0).all()
    for a, b in zip(feats, hla_features(*xs, 0.7, backend="triton"), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("data", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_decay_gradients_match_fp64_autograd(case, data):
    """The gradients of q, k, v, the bias and the projection through features and log alpha, against fp64
    autograd of the PyTorch forms."""
    B, T, HQ, H, D, Dv = case
    xs = make(*case, torch.float32, seed=sum(case) + 3) + make_decay(B, T, HQ, torch.float32, data, seed=5)
    gen = torch.Generator().manual_seed(4)
    dys = [torch.randn(s, generator=gen).to(DEV) for s in ((B, T, HQ, D), (B, T, HQ, D), (B, T, HQ, Dv), (B, T, HQ))]

    def grads(fn, dtype):
        args = [None if t is None else t.detach().to(dtype).requires_grad_() for t in xs]
        sum((o * dy.to(dtype)).sum() for o, dy in zip(fn(*args), dys, strict=True)).backward()
        return [a.grad for a in args if a is not None]

    got = grads(lambda q, k, v, b, p: hla_features_and_decay(q, k, v, 0.7, b, p, backend="triton"), torch.float32)
    want = grads(lambda q, k, v, b, p: (*hla_features_reference(q, k, v, 0.7), log_alpha_reference(b, p, (B, T, HQ))),
                 torch.float64)
    assert len(got) == (5 if data else 4)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), i
        assert rel(a, b) < 1e-5, (i, rel(a, b))


def test_a_decay_projection_sliced_from_the_pack_is_read_in_place():
    """Without gradients the decay projection (a column slice of the packed projection's output, as the
    HLA layer's is) is read where it is: no copy, the values of a contiguous copy bit for bit."""
    B, T, HQ, H, D, Dv = 2, 9, 4, 2, 16, 8
    q, k, v = make(B, T, HQ, H, D, Dv, torch.bfloat16, seed=8)
    bias, _ = make_decay(B, T, HQ, torch.bfloat16, seed=9)
    packed = torch.randn(B, T, HQ + 37, generator=torch.Generator().manual_seed(1)).to(DEV, torch.bfloat16)
    proj = packed[..., 30:30 + HQ]
    with torch.no_grad(), CopyCounter() as copies:
        got = hla_features_and_decay(q, k, v, 0.7, bias, proj, backend="triton")[3]
    assert copies.n == 0
    assert torch.equal(got, hla_features_and_decay(q, k, v, 0.7, bias, proj.contiguous(), backend="triton")[3])


def test_decay_dispatch():
    """"auto" keeps the PyTorch forms off CUDA (and for fp64); "triton" names decay inputs it cannot take."""
    xs = make(1, 3, 2, 1, 8, 8, torch.float64)
    bias, proj = make_decay(1, 3, 2, torch.float64)
    got = hla_features_and_decay(*xs, 1.0, bias, proj)
    want = (*hla_features_reference(*xs, 1.0), log_alpha_reference(bias, proj, (1, 3, 2)))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    xs = make(1, 3, 2, 1, 8, 8, torch.float32)
    bias, proj = make_decay(1, 3, 2, torch.float32)
    with pytest.raises(ValueError, match="decay bias"):
        hla_features_and_decay(*xs, 1.0, bias[:1], proj, backend="triton")
    with pytest.raises(ValueError, match="decay projection"):
        hla_features_and_decay(*xs, 1.0, bias, proj[:, :2], backend="triton")
