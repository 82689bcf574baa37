"""SSE's fused feature maps and decays (`kernels.sse.features`) against their PyTorch form: values
(fp32 and bf16, head dims that are not powers of two, rows over several programs, decay inputs far
into both tails of the logsigmoid) and the gradients of every input against fp64 autograd, with
poisoned outputs (tests/kernels/conftest.py). On CPU the kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.sse.features import sse_gla_features, sse_gla_features_reference  # noqa: E402

from ..fused_models import CopyCounter, forced_kernel_matches, perturb, rel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q1", "k1", "q2", "k2", "v", "g1", "g2"]

CASES = [  # B, T, H, D
    (2, 5, 3, 32),
    (1, 7, 4, 24),  # D not a power of two
    (1, 19, 2, 64),  # rows over several programs, a partial last one
]


def make(B, T, H, D, dtype, seed=0, z_scale=3.0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, T, H, D, generator=g) * 2.0 for _ in range(5)]
    zs = [torch.randn(B, T, H * D, generator=g) * z_scale for _ in range(2)]
    bs = [torch.randn(H * D, generator=g) * 2.0 for _ in range(2)]
    return [t.to(DEV, dtype) for t in (*xs, *zs)] + [b.to(DEV, torch.float32) for b in bs]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_match_the_pytorch_form(case, dtype):
    xs = make(*case, dtype, seed=sum(case))
    got = sse_gla_features(*xs, 16.0, backend="triton")
    want = sse_gla_features_reference(*xs, 16.0)
    exact = sse_gla_features_reference(*(t.double() for t in xs), 16.0)
    for name, a, b, e in zip(NAMES, got, want, exact, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape == case, name
        assert a.dtype == (torch.float32 if name[0] == "g" else dtype), name
        assert torch.isfinite(a).all(), name
        if dtype == torch.float32 or name[0] == "g":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        else:  # one rounding each, as the PyTorch form's (the interpreter's bf16 casts may round differently)
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-3, msg=name)
        assert rel(a, e) < (1e-6 if a.dtype == torch.float32 else 1e-2), name
    assert (got[5] <= 0).all() and (got[6] <= 0).all()


def test_decays_far_into_the_tails():
    """logsigmoid(z) / n for z from -60 to 60: the large-z side (-exp(-z), tiny) to a few parts in a
    million, where log(1 + exp(-z)) alone would round to 0 or to a step of 6e-8 (the GPU's fast exp
    loses precision in proportion to |z|: 3.2e-6 at |z| near 60 on an H200)."""
    xs = make(1, 4, 2, 32, torch.float32)
    z = torch.linspace(-60, 60, 4 * 2 * 32).view(1, 4, 64).to(DEV)
    xs[5], xs[6] = z, -z
    xs[7], xs[8] = torch.zeros_like(xs[7]), torch.full_like(xs[8], 0.5)
    got = sse_gla_features(*xs, 4.0, backend="triton")[5:]
    exact = sse_gla_features_reference(*(t.double() for t in xs), 4.0)[5:]
    for a, e in zip(got, exact, strict=True):
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_fp64_autograd(case):
    xs = make(*case, torch.float32, seed=sum(case) + 1)
    gen = torch.Generator().manual_seed(7)
    dys = [torch.randn(case, generator=gen).to(DEV) for _ in NAMES]

    def grads(fn, dtype):
        args = [t.detach().to(dtype).requires_grad_() for t in xs]
        outs = fn(*args)
        sum((o * dy.to(o.dtype)).sum() for o, dy in zip(outs, dys, strict=True)).backward()
        return [a.grad for a in args]

    got = grads(lambda *a: sse_gla_features(*a, 16.0, backend="triton"), torch.float32)
    want = grads(lambda *a: sse_gla_features_reference(*a, 16.0), torch.float64)
    for name, a, b in zip([*NAMES[:5], "z1", "z2", "bias1", "bias2"], got, want, strict=True):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < 1e-5, name


def packed_inputs(B, T, H, HK, D, mode, seed):
    """q1, k1, q2, k2, v, z1, z2 as column slices of one packed projection output (tokens one stride
    apart, as `modeling.projections` gives them; q2 / k2 None for "same"), fp32 leaves of it, and the
    fp32 biases."""
    g = torch.Generator().manual_seed(seed)
    widths = [H * D, HK * D, *([H * D] * 2 if mode != "same" else []), HK * D, H * D, H * D]
    packed = (torch.randn(B, T, sum(widths) + 5, generator=g) * 2.0).to(DEV).requires_grad_()
    cols = packed.split([*widths, 5], -1)[:-1]
    heads = [H, HK, *([H] * 2 if mode != "same" else []), HK]
    xs = [c.view(B, T, n, D) for c, n in zip(cols, heads, strict=False)] + list(cols[len(heads):])
    if mode == "same":
        xs[2:2] = [None, None]
    bs = [(torch.randn(H * D, generator=g) * 2.0).to(DEV).requires_grad_() for _ in range(2)]
    return packed, xs + bs


@pytest.mark.parametrize("mode", ["full", "offset", "same"])
@pytest.mark.parametrize("B,T,H,HK,D", [(2, 5, 4, 2, 16), (1, 9, 6, 2, 24), (1, 4, 3, 3, 32), (1, 6, 4, 1, 16)])
def test_kv_heads_and_second_branch_modes(B, T, H, HK, D, mode):
    """K / V at HK heads (each serving H / HK query heads) read in place of their repeat, and q2 / k2 as
    q2_mode says (the pre-activations, low-rank offsets added inside the kernel, or q1 / k1 themselves):
    the values of the PyTorch form and the gradients of fp64 autograd, with every input a column slice
    of one packed projection output read where it is, forward and backward (no copy of an input)."""
    packed, xs = packed_inputs(B, T, H, HK, D, mode, seed=B + T + H + HK)
    with CopyCounter() as copies:
        got = sse_gla_features(*xs, 16.0, backend="triton", q2_mode=mode)
    assert copies.n == 0
    exact = sse_gla_features_reference(*(None if t is None else t.double() for t in xs), 16.0, q2_mode=mode)
    for name, a, e in zip(NAMES, got, exact, strict=True):
        assert a.shape == (B, T, H, D), name
        assert rel(a, e) < 1e-6, name
    gen = torch.Generator().manual_seed(5)
    dys = [torch.randn(B, T, H, D, generator=gen).to(DEV) for _ in NAMES]
    leaves = [packed, *xs[-2:]]
    loss = sum((o * dy).sum() for o, dy in zip(got, dys, strict=True))
    g = torch.autograd.grad(loss, leaves)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    widths = [t.shape[-1] * (t.shape[-2] if t.dim() == 4 else 1) for t in xs[:7] if t is not None]
    cols = ref[0].split([*widths, 5], -1)[:-1]
    heads = [t.shape[2] for t in xs[:7] if t is not None and t.dim() == 4]
    rx = [c.view(B, T, n, D) for c, n in zip(cols, heads, strict=False)] + list(cols[len(heads):])
    if mode == "same":
        rx[2:2] = [None, None]
    routs = sse_gla_features_reference(*rx, *ref[1:], 16.0, q2_mode=mode)
    g_ref = torch.autograd.grad(sum((o * dy.double()).sum() for o, dy in zip(routs, dys, strict=True)), ref)
    for name, a, b in zip(["packed", "bias1", "bias2"], g, g_ref, strict=True):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < 1e-5, name


def test_bf16_gradients_and_unused_outputs():
    """bf16 inputs (fp32 biases): gradients in each input's dtype, near the fp64 ones; outputs that
    take no part in the loss give zero gradients."""
    xs = make(1, 9, 2, 32, torch.bfloat16, seed=3)
    args = [t.detach().requires_grad_() for t in xs]
    outs = sse_gla_features(*args, 16.0, backend="triton")
    (outs[1].float().square().sum() + outs[5].sum()).backward()
    ref = [t.detach().double().requires_grad_() for t in xs]
    routs = sse_gla_features_reference(*ref, 16.0)
    (routs[1].square().sum() + routs[5].sum()).backward()
    for i, (a, b) in enumerate(zip(args, ref, strict=True)):
        assert a.grad.dtype == a.dtype
        if i in (1, 5, 7):
            assert rel(a.grad, b.grad) < 2e-2, i
        else:
            assert (a.grad == 0).all(), i


def test_dispatch():
    """"auto" keeps the PyTorch form off CUDA (and for fp64); "triton" refuses what the kernel cannot take."""
    xs = make(1, 3, 2, 16, torch.float64)
    for a, b in zip(sse_gla_features(*xs, 8.0), sse_gla_features_reference(*xs, 8.0), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="dtypes"):
        sse_gla_features(*xs, 8.0, backend="triton")
    xs = make(1, 3, 2, 16, torch.float32)
    xs[5] = xs[5][..., :-1]
    with pytest.raises(ValueError, match="decay shapes"):
        sse_gla_features(*xs, 8.0, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        sse_gla_features(*xs, 8.0, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_real_shapes_on_gpu():
    """Llama-3.2-1B's heads (32 x 64) at 4k tokens in bf16: the PyTorch form's values (nearly every
    value equal, each within a bf16 step: the fp32 sigmoid and exp may move the last bit), the
    fp64 gradients."""
    xs = make(1, 4096, 32, 64, torch.bfloat16)
    xs[5], xs[6] = xs[5].to(torch.bfloat16), xs[6].to(torch.bfloat16)
    got = sse_gla_features(*xs, 16.0)
    want = sse_gla_features_reference(*xs, 16.0)
    for name, a, b in zip(NAMES, got, want, strict=True):
        if a.dtype == torch.bfloat16:
            assert (a == b).float().mean() > 0.99, name
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-3, msg=name)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    dys = [torch.randn_like(o) for o in got]
    args = [t.detach().requires_grad_() for t in xs]
    sum((o * dy).sum() for o, dy in zip(sse_gla_features(*args, 16.0), dys, strict=True)).backward()
    ref = [t.detach().double().requires_grad_() for t in xs]
    sum((o * dy.double()).sum() for o, dy in zip(sse_gla_features_reference(*ref, 16.0), dys, strict=True)).backward()
    for a, b in zip(args, ref, strict=True):
        assert rel(a.grad, b.grad) < 2e-2


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa"])
def test_the_mixer_takes_the_kernel_with_the_values_and_gradients_of_its_pytorch_form(preset, monkeypatch,
                                                                                      one_thread):
    """SSE's feature maps and decays through the kernel (its plans' choice, on a GPU or under the
    interpreter): the logits and every parameter's gradient of the PyTorch ops, the kernel once per
    SSE layer and forward, and `sse_key_topk` keeps the PyTorch ops where the plans are CUDA's."""
    from subquadratic.kernels.sse import triton_features

    from ...models.sse.test_modeling_sse import model as sse_model

    model = sse_model(preset, 0)
    perturb(model)

    def features(kernel: bool) -> None:  # the feature kernel itself, not its copy inside the SSE kernels
        model.set_plan("sse", features="kernel" if kernel else "torch", fused=False)

    calls = forced_kernel_matches(model, monkeypatch, [features], triton_features.SSEFeatures, "apply")
    assert calls == model.config.mixer_types.count("sse") > 0
    assert any("g1_bias" in n for n, p in model.named_parameters() if p.grad is not None)
    model.config.sse_key_topk = 4
    model.set_plan("sse", device="cuda", path="torch", fused=False, router="torch", norm_gate="torch")
    with monkeypatch.context() as m:
        m.setattr(triton_features.SSEFeatures, "apply", lambda *a: pytest.fail("the kernel ran with sse_key_topk"))
        model(torch.randint(3, 128, (1, 9), device=model.device), use_cache=False)


@pytest.mark.parametrize("B,T", [(2, 5), (1, 7), (3, 1)])
def test_strided_inputs_without_gradients(B, T):
    """Without gradients the kernel reads q1, k1, v, z1, z2 where they are when they are column slices of
    one packed projection output (`modeling.projections`: tokens one stride apart), as it reads
    contiguous ones: same values as the PyTorch form on contiguous copies; a slice whose tokens are not
    one stride apart (a transposed view) is copied first and gives the same values too."""
    from subquadratic.kernels.triton_utils import token_stride

    H, D = 3, 16
    g = torch.Generator().manual_seed(B * 10 + T)
    packed = torch.randn(B, T, 5 * H * D + 7, generator=g).to(DEV) * 2.0  # q1 | k1 | v | z1 | z2 | other
    q1, k1, v, z1, z2 = (packed[..., i * H * D:(i + 1) * H * D] for i in range(5))
    q1, k1, v = (t.view(B, T, H, D) for t in (q1, k1, v))
    q2, k2 = (torch.randn(B, T, H, D, generator=g).to(DEV) for _ in range(2))
    bs = [torch.randn(H * D, generator=g).to(DEV) for _ in range(2)]
    assert token_stride(q1) == 5 * H * D + 7 and token_stride(z2) == 5 * H * D + 7
    xs = [q1, k1, q2, k2, v, z1, z2, *bs]
    with torch.no_grad(), CopyCounter() as copies:
        got = sse_gla_features(*xs, 16.0, backend="triton")
    assert copies.n == 0  # read where they are
    want = sse_gla_features_reference(*(t.contiguous() for t in xs), 16.0)
    for name, a, b in zip(NAMES, got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    if T > 1 and B > 1:
        bad = q1.transpose(0, 1)  # [T, B, H, D]: its rows are not one stride apart
        assert token_stride(bad) is None
        xs2 = [bad, *(t.transpose(0, 1) for t in xs[1:7]), *bs]
        with torch.no_grad(), CopyCounter() as copies:
            got = sse_gla_features(*xs2, 16.0, backend="triton")
        assert copies.n >= 5  # copied first
        want = sse_gla_features_reference(*(t.contiguous() for t in xs2), 16.0)
        for name, a, b in zip(NAMES, got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kv_heads", ["query", "source"])
def test_generation_through_the_kernel_equals_the_full_forward(kv_heads, monkeypatch, one_thread):
    """SSE-H with the feature and RoPE kernels taken (forced, as on CUDA): generate() with the static
    cache and with the default one give the same tokens, the greedy tokens of the full forward over the
    generated sequence (prefill with left padding, then one-token steps reading the cache), whose logits
    are the PyTorch forms', with K / V at the query heads or at the source's (the kernel reading each
    query head's KV head)."""
    from subquadratic.families.sse import modeling as sse_modeling

    from ...models.common import GEN, left_pad
    from ...models.sse.test_modeling_sse import lively

    calls, real = [], sse_modeling.sse_gla_features

    def spy(*xs, **kw):
        calls.append(kw.get("q2_mode"))
        return real(*xs, **kw)

    monkeypatch.setattr(sse_modeling, "sse_gla_features", spy)
    m = lively("tiny-h", 0, sse_kv_heads=kv_heads).to(DEV)
    m.set_plan("fused", rope="kernel")
    m.set_plan("sse", features="kernel", fused=False)
    g = torch.Generator().manual_seed(0)
    ids, mask = left_pad([torch.randint(3, 128, (n,), generator=g) for n in (30, 17)])
    ids, mask = ids.to(DEV), mask.to(DEV)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, **GEN)
    out = m.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(out, m.generate(ids, **kw))
    assert calls and set(calls) == {"offset"}  # the kernel's path: q2 / k2 as offsets
    full_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype, device=DEV)], 1)
    with torch.no_grad():
        logits = m(out[:, :-1], attention_mask=full_mask).logits
    assert torch.equal(logits[:, ids.shape[1] - 1:].argmax(-1), out[:, ids.shape[1]:])
    monkeypatch.undo()  # the PyTorch forms: the same logits
    m.set_plan("sse", features="torch", fused=False)
    m.set_plan("fused", rope="torch")
    with torch.no_grad():
        torch.testing.assert_close(m(out[:, :-1], attention_mask=full_mask).logits, logits, rtol=1e-4, atol=1e-4)
