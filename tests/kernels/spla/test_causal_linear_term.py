"""SPLA's causal linear term on the chunked kernels of `kernels/gla`
(`triton_parallel.causal_linear_term`) vs its definition summed serially in fp64:
o_t = phi(q_t)^T (Sbar + sum_{valid j <= t} phi(k_j) v_j^T) and the new Sbar; values and the
gradients of phi(q), phi(k), v and Sbar, GQA groups 1, 2 and 4, left and right padding, lengths
not a multiple of the chunk. Kernel outputs start as NaN. On CPU it runs under TRITON_INTERPRET=1
at small shapes; on CUDA the `gpu` tests run bf16 (and fp32 on TF32) at real shapes."""

from __future__ import annotations

import pytest
import torch

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before Triton is imported
pytest.importorskip("triton")
from subquadratic.kernels.spla.triton_parallel import causal_linear_term  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp(min=1e-30)).item()


def definition(phiq, phik, v, sbar, valid):
    """The serial sum in the inputs' dtype: phiq [B, T, HQ, D], phik, v [B, T, H, D], valid [B, T]."""
    B, T, HQ, D = phiq.shape
    H = phik.shape[2]
    S = sbar.clone()  # [B, H, D, D]
    outs = []
    for t in range(T):
        S = S + valid[:, t, None, None, None] * phik[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhgd,bhde->bhge", phiq[:, t].view(B, H, HQ // H, D), S).reshape(B, HQ, D))
    return torch.stack(outs, 1), S


def make(B, T, HQ, H, D, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    phiq = torch.softmax(torch.randn(B, T, HQ, D, generator=gen, dtype=torch.float64) * 2, -1)
    phik = torch.softmax(torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) * 2, -1)
    v = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    sbar = torch.randn(B, H, D, D, generator=gen, dtype=torch.float64) * 0.1
    valid = torch.ones(B, T, dtype=torch.bool)
    if pad > 0:
        valid[-1, :pad] = False  # left padding of the last row
    elif pad < 0:
        valid[-1, pad:] = False  # right padding
    return [phiq, phik, v, sbar], valid


def values_and_grads(fn, inputs, valid, dtype):
    xs = [x.detach().to(DEV, torch.float32 if i == 3 and dtype != torch.float64 else dtype).clone().requires_grad_()
          for i, x in enumerate(inputs)]
    o, s = fn(*xs, valid.to(DEV))
    g = torch.Generator().manual_seed(7)
    loss = sum((y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64).to(DEV)).sum() for y in (o, s))
    loss.backward()
    return [o, s] + [x.grad for x in xs]


@pytest.mark.parametrize("B,T,G,pad", [(2, 37, 1, 5), (1, 70, 2, 0), (2, 45, 4, -9), (1, 16, 2, 3)])
def test_matches_the_serial_definition(B, T, G, pad):
    H, D = 2, 16
    inputs, valid = make(B, T, H * G, H, D, pad, seed=T + G)
    want = values_and_grads(definition, inputs, valid, torch.float64)
    got = values_and_grads(lambda *a: causal_linear_term(*a, precision="ieee"), inputs, valid, torch.float32)
    for name, a, b in zip(["o", "Sbar", "d phi(q)", "d phi(k)", "dv", "d Sbar"], got, want, strict=True):
        assert torch.isfinite(a).all() and rel(a, b) <= 1e-5, (name, rel(a, b))
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    if pad:  # padded keys write nothing: their phi(k) and v get no gradient
        pads = slice(0, pad) if pad > 0 else slice(T + pad, T)
        assert torch.equal(got[3][-1, pads], torch.zeros_like(got[3][-1, pads]))
        assert torch.equal(got[4][-1, pads], torch.zeros_like(got[4][-1, pads]))


def test_fp64_inputs_run_in_fp32_and_keep_the_state_dtype():
    inputs, valid = make(1, 20, 4, 2, 16, 0, seed=1)
    o, s = causal_linear_term(*(x.to(DEV) for x in inputs), valid.to(DEV), precision="ieee")
    want_o, want_s = definition(*inputs, valid)
    assert s.dtype == torch.float64 and rel(o, want_o) <= 1e-5 and rel(s, want_s) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_shapes(G, dtype):
    """B2 T = 4096 - 21, H2 d128, right padding: bf16 operands, or fp32 on TF32 (the default), within
    1e-2 of the fp64 definition (evaluated in chunks here) on the same rounded inputs."""
    B, T, H, D = 2, 4096 - 21, 2, 128
    inputs, valid = make(B, T, H * G, H, D, -100, seed=G)
    inputs = [x.to(dtype).double() if i < 3 else x for i, x in enumerate(inputs)]
    want = values_and_grads(chunked_definition, inputs, valid, torch.float64)
    got = values_and_grads(causal_linear_term, inputs, valid, dtype)
    for name, a, b in zip(["o", "Sbar", "d phi(q)", "d phi(k)", "dv", "d Sbar"], got, want, strict=True):
        assert rel(a, b) <= 1e-2, (name, rel(a, b))


def chunked_definition(phiq, phik, v, sbar, valid, C=256):
    """The definition by blocks of C tokens (fp64, exact up to rounding): the serial loop is too
    slow at real lengths."""
    B, T, HQ, D = phiq.shape
    H = phik.shape[2]
    phik = phik * valid[..., None, None]
    S, outs = sbar, []
    causal = torch.ones(C, C, dtype=torch.bool, device=phiq.device).tril()
    for a in range(0, T, C):
        q = phiq[:, a:a + C].reshape(B, -1, H, HQ // H, D)
        k, vv = phik[:, a:a + C], v[:, a:a + C]
        n = k.shape[1]
        inter = torch.einsum("bthgd,bhde->bthge", q, S)
        A = torch.einsum("bthgd,bshd->bhgts", q, k) * causal[:n, :n]
        outs.append((inter + torch.einsum("bhgts,bshe->bthge", A, vv)).reshape(B, n, HQ, D))
        S = S + torch.einsum("bshd,bshe->bhde", k, vv)
    return torch.cat(outs, 1), S


def test_state_increment_equals_its_sum():
    """What the new tokens add to Sbar without the residual term (`stats.state_increment`) is the sum
    over tokens of phi(k)^T v, exact in the state's dtype here (fp32 or fp64 operands, or the CPU)."""
    from subquadratic.kernels.spla.stats import state_increment

    gen = torch.Generator().manual_seed(3)
    phik = torch.softmax(torch.randn(2, 5, 3, 16, generator=gen, dtype=torch.float64), -1)  # [B, T, H, D]
    v = torch.randn(2, 5, 3, 8, generator=gen, dtype=torch.float64)
    want = sum(phik[:, t, :, :, None] * v[:, t, :, None, :] for t in range(5))
    got = state_increment(phik.transpose(1, 2), v.transpose(1, 2), torch.float64)
    assert got.dtype == torch.float64 and got.shape == (2, 3, 16, 8) and rel(got, want) <= 1e-12
    got32 = state_increment(phik.float().transpose(1, 2), v.bfloat16().transpose(1, 2), torch.float32)
    assert got32.dtype == torch.float32 and rel(got32, want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_gpu_state_increment_takes_16_bit_operands_with_fp32_sums():
    """bf16 values on CUDA: phi(k) rounded to bf16, one batched matmul with fp32 accumulation and output,
    within fp32 accumulation error of the fp64 sum of the same rounded operands (B2 T 8192 H4 d128, the
    values a transposed view as the op passes them)."""
    from subquadratic.kernels.spla.stats import state_increment

    gen = torch.Generator().manual_seed(4)
    phik = torch.softmax(torch.randn(2, 4, 8192, 128, generator=gen) * 2, -1).to(DEV)
    v = torch.randn(2, 8192, 4, 128, generator=gen).to(DEV, torch.bfloat16).transpose(1, 2)
    got = state_increment(phik, v, torch.float32)
    want = torch.einsum("bhsd,bhse->bhde", phik.bfloat16().double(), v.double())
    exact = torch.einsum("bhsd,bhse->bhde", phik.double(), v.double())
    assert got.dtype == torch.float32 and rel(got, want) <= 1e-5 and rel(got, exact) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 3])
def test_residual_term_is_the_difference_with_dropped_rows_zero(dtype, G):
    """`residual_term` (one Triton pass each way): o_lin - otilde, exactly 0 on dropped (token, KV head)
    rows, rounded once to the output dtype; its gradients are g (o_lin) and -g (otilde), 0 on dropped
    rows, against the PyTorch form; outputs start as NaN."""
    from subquadratic.kernels import utils
    from subquadratic.kernels.spla.triton_parallel import residual_term, residual_term_reference

    g = torch.Generator().manual_seed(G)
    B, T, H, D = 2, 7, 2, 16
    a, b = (torch.randn(B, T, H * G, D, generator=g).to(DEV).requires_grad_() for _ in range(2))
    drop = (torch.rand(B, T, H, generator=g) < 0.4).to(DEV)
    drop[0, 0, 0], drop[1, 1, 1] = True, False
    w = torch.randn(B, T, H * G, D, generator=g).to(DEV)
    with utils.poisoned_outputs():
        got = residual_term(a, b, drop, dtype)
    want = residual_term_reference(a, b, drop, dtype)
    assert got.dtype == dtype and torch.isfinite(got).all()
    rows = drop.repeat_interleave(G, dim=2)  # [B, T, HQ]
    assert (got[rows] == 0).all() and (got[~rows] != 0).all()
    tol = 0.0 if dtype == torch.float32 else 2.0 ** -7  # the interpreter may round bf16 another way
    assert ((got.float() - want.float()).abs() <= tol * want.float().abs()).all()
    ga = torch.autograd.grad((got.float() * w).sum(), (a, b))
    gw = torch.autograd.grad((want.float() * w).sum(), (a, b))
    for x, y in zip(ga, gw, strict=True):
        assert x.dtype == torch.float32 and torch.equal(x, y)
    assert torch.equal(ga[0], -ga[1]) and (ga[0][rows] == 0).all()


def test_row_dots_are_fp32_sums_of_products():
    """The block-major backward's Delta = rowsum(dO * O) in one pass from 16-bit and fp32 rows."""
    from subquadratic.kernels.spla.triton_blocks_bwd import row_dots

    g = torch.Generator().manual_seed(5)
    a = torch.randn(3, 37, 4, 32, generator=g).to(DEV)
    b = torch.randn(3, 37, 4, 32, generator=g).to(DEV)
    for x, y in ((a, b), (a.bfloat16(), b), (a.bfloat16(), b.bfloat16())):
        want = (x.double() * y.double()).sum(-1)
        got = row_dots(x, y)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert rel(got, want) <= 1e-6
    assert row_dots(a[:0], b[:0]).shape == (0, 37, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_feature_rows_are_the_softmax_feature_map(dtype):
    """`feature_rows` (one Triton pass each way, strided input): softmax over D in fp32 cast to the output
    dtype, and its gradient, against `feature_map` in PyTorch."""
    from subquadratic.kernels.spla.stats import feature_map
    from subquadratic.kernels.spla.triton_parallel import feature_rows

    g = torch.Generator().manual_seed(2)
    base = (3 * torch.randn(2, 3, 9, 16, generator=g)).to(DEV, dtype)  # [B, H, T, D]
    x = base.transpose(1, 2).requires_grad_()  # a strided view [B, T, H, D]
    w = torch.randn(2, 9, 3, 16, generator=g).to(DEV)
    got = feature_rows(x, dtype)
    want = feature_map(x).to(dtype)
    assert got.dtype == dtype and got.is_contiguous() and got.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 2.0 ** -7
    assert ((got.float() - want.float()).abs() <= tol * want.float().abs() + 1e-30).all()
    (gx,) = torch.autograd.grad((got.float() * w).sum(), x)
    (wx,) = torch.autograd.grad((want.float() * w).sum(), x)
    assert gx.dtype == dtype and rel(gx, wx) <= (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("K", [1, 3, 5])
def test_dropped_rows_match_the_definition(K):
    """`dropped_rows` (one Triton launch): the (token, KV head) rows whose selection holds every causal
    key of their token, or whose token is padding, against the PyTorch form, on selections built to
    hit both cases (the first tokens' blocks all selected, repeated and -1 slots, blocks after the
    token, padded queries)."""
    from subquadratic.kernels.spla.triton_parallel import dropped_rows, dropped_rows_reference

    g = torch.Generator().manual_seed(K)
    B, T, H, bs = 2, 37, 3, 4
    pos = torch.arange(T).repeat(B, 1)
    pos[1, :5] = -1  # left padding
    pos[1, 5:] -= 5
    idx = torch.randint(-1, T // bs + 1, (B, T, H, K), generator=g)
    first = pos[..., None, None].clamp(min=0) // bs - torch.arange(K)  # the token's block and those before
    full = torch.rand(B, T, H, 1, generator=g) < 0.5
    idx = torch.where(full, torch.where(first >= 0, first, -1), idx).to(torch.int32)
    want = dropped_rows_reference(idx, pos, bs)
    got = dropped_rows(idx.to(DEV), pos.to(DEV), bs).cpu()
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert want.any() and (~want).any() and want[1, :5].all()
