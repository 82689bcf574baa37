"""The fused RoPE (`kernels.rope`) against Transformers' form: values and the gradients of q and k in
fp32, bf16 and bf16 q with fp32 cos (autocast's mix: fp32 outputs), cos shared by the batch or per
row, GQA head counts, rows over several programs; poisoned outputs (tests/kernels/conftest.py). On
CPU the kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

pytest.importorskip("triton")
from subquadratic.kernels.rope import rope, rope_reference  # noqa: E402

from .fused_models import forced_kernel_matches  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # B, T, HQ, H, D, cos rows
    (2, 5, 4, 2, 16, 1),
    (2, 7, 3, 1, 32, 2),  # one row of cos per batch row (packed positions), odd head counts
    (1, 33, 8, 2, 64, 1),  # rows over several programs
]


def make(B, T, HQ, H, D, rows, dtype, cos_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HQ, D, generator=g) * 3.0
    k = torch.randn(B, T, H, D, generator=g) * 3.0
    rot = LlamaRotaryEmbedding(LlamaConfig(head_dim=D, hidden_size=D * HQ, num_attention_heads=HQ,
                                           rope_theta=500.0))
    pos = torch.stack([torch.randperm(4 * T, generator=g)[:T].sort().values for _ in range(rows)])
    cos, sin = rot(q, pos)
    return q.to(DEV, dtype), k.to(DEV, dtype), cos.to(DEV, cos_dtype), sin.to(DEV, cos_dtype)


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


def close(a, b, exact):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.isfinite(a).all()
    if exact or a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-6 if not exact else 0, atol=1e-6 if not exact else 0)
    else:  # the interpreter's bf16 casts truncate (the GPU's round to nearest): a few steps apart
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -5, atol=2 ** -5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtypes", DTYPES)
def test_values_and_gradients_match_transformers(case, dtypes):
    q, k, cos, sin = make(*case, *dtypes, seed=sum(case))
    gen = torch.Generator().manual_seed(5)
    out_dtype = torch.promote_types(*dtypes)
    dq_out, dk_out = (torch.randn(x.shape, generator=gen).to(DEV, out_dtype) for x in (q, k))

    def run(fn):
        a, b = q.detach().requires_grad_(), k.detach().requires_grad_()
        yq, yk = fn(a, b, cos, sin)
        torch.autograd.backward((yq, yk), (dq_out, dk_out))
        return yq.detach(), yk.detach(), a.grad, b.grad

    got = run(lambda *x: rope(*x, backend="triton"))
    want = run(rope_reference)
    exact = DEV == "cuda"  # on the GPU: bit for bit
    for a, b in zip(got, want, strict=True):
        close(a, b, exact)
    assert got[0].dtype == out_dtype and got[2].dtype == dtypes[0]
    # and near the fp64 rotation
    ref = rope_reference(q.double(), k.double(), cos.double(), sin.double())
    tol = 1e-6 if out_dtype == torch.float32 else 1e-2
    for a, b in zip(got[:2], ref, strict=True):
        assert ((a.double() - b).norm() / b.norm()).item() < tol


@pytest.mark.parametrize("case", CASES)
def test_column_slices_read_in_place(case):
    """q and k as column slices of one packed projection output (tokens one stride apart, as
    `modeling.projections` gives them): read where they are (no copy), the values and gradients of
    contiguous copies; heads-first views (tokens not one stride apart) are copied first, same values."""
    from .fused_models import CopyCounter

    B, T, HQ, H, D, _ = case
    q0, k0, cos, sin = make(*case, torch.float32, torch.float32, seed=sum(case) + 3)
    packed = torch.cat([q0.flatten(2), k0.flatten(2), torch.randn(B, T, 7, device=DEV)], -1).requires_grad_()
    q, k = packed[..., :HQ * D].view(B, T, HQ, D), packed[..., HQ * D:(HQ + H) * D].view(B, T, H, D)
    with CopyCounter() as copies:
        got = rope(q, k, cos, sin, backend="triton")
    assert copies.n == 0
    qa, ka = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    want = rope_reference(qa, ka, cos, sin)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    dys = [torch.randn_like(t) for t in got]
    (g,) = torch.autograd.grad(got, packed, dys)
    dqa, dka = torch.autograd.grad(want, (qa, ka), dys)
    torch.testing.assert_close(g, torch.cat([dqa.flatten(2), dka.flatten(2), torch.zeros(B, T, 7, device=DEV)], -1),
                               rtol=1e-6, atol=1e-6)
    qh, kh = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q0, k0))  # heads-first memory
    if T > 1:
        with CopyCounter() as copies:
            got = rope(qh, kh, cos, sin, backend="triton")
        assert copies.n == (HQ > 1) + (H > 1)  # a one-head view is one stride apart still
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_dispatch():
    q, k, cos, sin = make(1, 3, 2, 1, 8, 1, torch.float64, torch.float64)
    for a, b in zip(rope(q, k, cos, sin), rope_reference(q, k, cos, sin), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="dtypes"):
        rope(q, k, cos, sin, backend="triton")
    q, k, cos, sin = make(1, 3, 2, 1, 8, 1, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="cos / sin"):
        rope(q, k, cos[:, :2], sin[:, :2], backend="triton")
    with pytest.raises(ValueError, match="backend"):
        rope(q, k, cos, sin, backend="cuda")


@pytest.mark.parametrize("preset", ["tiny-swa", "tiny-h"])
def test_models_take_the_kernel_with_the_values_and_gradients_of_transformers(preset, monkeypatch, one_thread):
    """A model's RoPE through the kernel (as on CUDA with a kernel_backend in ROPE_KERNEL_BACKENDS;
    here forced, on a GPU or under the interpreter): the logits and every parameter's gradient of
    Transformers' form, and kernel_backend="torch" keeps that form."""
    from subquadratic.kernels import triton_rope

    from ..models.sse.test_modeling_sse import model as sse_model

    model = sse_model(preset, 0)
    gates = [lambda forced: model.set_plan("fused", **({"rope": "kernel"} if forced else {}))]
    assert forced_kernel_matches(model, monkeypatch, gates, triton_rope.Rope, "apply") > 0
    model.set_plan("fused")
    model.config.kernel_backend = "torch"
    with monkeypatch.context() as m:
        m.setattr(triton_rope.Rope, "apply", lambda *a: pytest.fail("the kernel ran with kernel_backend='torch'"))
        model(torch.randint(3, 128, (1, 9), device=model.device), use_cache=False)
