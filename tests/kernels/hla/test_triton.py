"""HLA Triton kernels vs the fp64 PyTorch oracle, through the dispatch (`hla_triton`; `hla_attention`
with backend "triton" on CUDA): values and gradients of the chunked kernels (q, k, v, log_alpha, the
initial state, and gradients flowing into the final state), hla2 and ahla, plain and normalised, T
not a multiple of the chunk, several K / V blocks; the fused recurrent (decode) kernel against
`hla_recurrent`; which inputs the dispatch sends where. Kernel outputs start as NaN, so anything
left unwritten fails. On CPU it runs under TRITON_INTERPRET=1 at small shapes; on CUDA the `gpu`
tests run bf16 at real shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before Triton is imported
pytest.importorskip("triton")
from subquadratic.kernels.gla import triton_chunk as gla_triton_chunk  # noqa: E402
from subquadratic.kernels.hla import (  # noqa: E402
    HLAState,
    hla_attention,
    hla_chunked,
    hla_recurrent,
    hla_triton,
    triton_chunk,
    triton_fused_recurrent,
    triton_unsupported,
)
from tests.conftest import count_calls  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernel_calls(monkeypatch):
    """Count the calls of the chunked and the fused recurrent kernels' entry points."""
    return count_calls(monkeypatch, {"chunked": (triton_chunk, "hla_chunked_triton"),
                                     "recurrent": (triton_fused_recurrent, "hla_recurrent_triton")})


def triton_path(*args, **kw):
    """The Triton forms as the model reaches them: the dispatch on CUDA (exact fp32 dots: the
    comparisons are at fp32 tolerances, and the default on CUDA is TF32), `hla_triton` elsewhere."""
    if DEV == "cuda":
        return hla_attention(*args, backend="triton", precision="ieee", **kw)
    return hla_triton(*args, **kw)


def make(B, T, H, D, Dv, *, variant, normalize, with_state, seed=0, positive=False):
    """Fresh random fp64 inputs (on CPU) and initial state (or None). positive=True keeps q, k and
    the state >= 0 so that the normalised forms' denominators stay away from 0."""
    g = torch.Generator().manual_seed(seed)
    f = (lambda x: x.abs()) if positive else (lambda x: x)
    q = f(torch.randn(B, T, H, D, generator=g, dtype=torch.float64))
    k = f(torch.randn(B, T, H, D, generator=g, dtype=torch.float64)) / D**0.5
    v = torch.randn(B, T, H, Dv, generator=g, dtype=torch.float64)
    la = Fn.logsigmoid(torch.randn(B, T, H, generator=g, dtype=torch.float64) + 2)
    st = None
    if with_state:
        Sd = (D, D) if variant == "hla2" else (D, Dv)
        S = f(torch.randn(B, H, *Sd, generator=g, dtype=torch.float64))  # not symmetric on purpose
        F = torch.randn(B, H, D, Dv, generator=g, dtype=torch.float64)
        eta = torch.rand(B, H, D, generator=g, dtype=torch.float64) if normalize else None
        z = torch.rand(B, H, D, generator=g, dtype=torch.float64) if normalize and variant == "ahla" else None
        st = HLAState(S, F, eta, z)
    return (q, k, v, la), st


def rel(x, ref):
    return ((x.double().cpu() - ref.double().cpu()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def state_tensors(st):
    return [] if st is None else [x for x in (st.S, st.F, st.eta, st.z) if x is not None]


def run(fn, inputs, st, dtype, **kw):
    """Values and gradients of loss = <o, w_o> + <S, w_S> + <F, w_F> + ... for inputs cast to
    `dtype` on DEV."""
    xs = [x.detach().to(DEV, dtype).clone().requires_grad_() for x in inputs]
    sts = [x.detach().to(DEV, torch.float64 if dtype == torch.float64 else torch.float32).clone().requires_grad_()
           for x in state_tensors(st)]
    st_in = None if st is None else HLAState(*sts, *[None] * (4 - len(sts)))
    o, out = fn(*xs, st_in, **kw)
    g = torch.Generator().manual_seed(123)
    outs = [o] + state_tensors(out)
    loss = sum((y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64).to(DEV)).sum() for y in outs)
    loss.backward()
    return outs, [x.grad for x in xs + sts]


CASES = [  # variant, normalize, with_state, D, Dv, small blocks
    ("hla2", False, False, 16, 16, False),
    ("hla2", False, True, 32, 16, True),
    ("hla2", True, True, 16, 16, True),
    ("ahla", False, True, 16, 16, False),
    ("ahla", True, True, 16, 16, True),
]


@pytest.mark.parametrize("variant,normalize,with_state,D,Dv,small", CASES)
def test_chunked_values_and_grads(monkeypatch, kernel_calls, variant, normalize, with_state, D, Dv, small):
    if small:  # several K and V blocks per head in every kernel
        for name in ("BK_H", "BV_H", "BV_O", "BV_DQK"):
            monkeypatch.setattr(gla_triton_chunk, name, 16)
    inputs, st = make(2, 40, 2, D, Dv, variant=variant, normalize=normalize, with_state=with_state,
                      positive=normalize, seed=D + 3 * normalize + 7 * (variant == "ahla"))
    kw = {"chunk_size": 16, "variant": variant, "normalize": normalize}
    ref_o, ref_g = run(hla_chunked, inputs, st, torch.float64, **kw)
    got_o, got_g = run(triton_path, inputs, st, torch.float32, **kw)
    assert kernel_calls == {"chunked": 1, "recurrent": 0}
    for i, (a, b) in enumerate(zip(got_o, ref_o, strict=True)):
        assert rel(a, b) <= 1e-4, f"output {i}: {rel(a, b):.2e}"
    for i, (a, b) in enumerate(zip(got_g, ref_g, strict=True)):
        assert rel(a, b) <= 1e-4, f"grad {i}: {rel(a, b):.2e}"


@pytest.mark.parametrize("variant", ["hla2", "ahla"])
@pytest.mark.parametrize("normalize", [False, True])
def test_decode_matches_recurrence(variant, normalize, kernel_calls):
    D, Dv = 16, 48  # two value-column blocks
    (q, k, v, la), st = make(2, 3, 2, D, Dv, variant=variant, normalize=normalize, with_state=True,
                             positive=True, seed=7)
    ref_o, ref_st = hla_recurrent(q, k, v, la, st, normalize=normalize, variant=variant)
    st32 = HLAState(*[None if x is None else x.float().to(DEV) for x in (st.S, st.F, st.eta, st.z)])
    xs = [x.float().to(DEV) for x in (q, k, v, la)]
    outs = []
    for t in range(3):  # token by token, as generate() calls it: the fused recurrent kernel
        with torch.no_grad():
            o, st32 = triton_path(*[x[:, t:t + 1] for x in xs], st32, normalize=normalize, variant=variant)
        outs.append(o)
    assert kernel_calls == {"chunked": 0, "recurrent": 3}
    o3, st3 = triton_fused_recurrent.hla_recurrent_triton(*xs, HLAState(*[None if x is None else x.float().to(DEV)
                                                  for x in (st.S, st.F, st.eta, st.z)]),
                                   normalize=normalize, variant=variant)
    assert rel(torch.cat(outs, 1), ref_o) <= 1e-5
    assert rel(o3, ref_o) <= 1e-5
    for a, b, c in zip(state_tensors(st32), state_tensors(st3), state_tensors(ref_st), strict=True):
        assert rel(a, c) <= 1e-5 and rel(b, c) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("variant,normalize", [("hla2", False), ("hla2", True), ("ahla", False)])
def test_gpu_bf16_real_shapes(D, variant, normalize):
    """bf16 at T = 4096 against the fp32 PyTorch chunked form on the same (bf16-rounded) inputs,
    q and k L2-normalised as the model does; values and gradients within 1e-2."""
    B, T, H = 1, 4096, 4
    (q, k, v, la), st = make(B, T, H, D, D, variant=variant, normalize=normalize, with_state=True,
                             positive=normalize, seed=D)
    q, k = Fn.normalize(q, dim=-1), Fn.normalize(k, dim=-1)
    if st is not None and variant == "hla2":
        st.S = st.S @ st.S.transpose(-1, -2) / D
    inputs = [x.to(torch.bfloat16) for x in (q, k, v, la)]
    kw = {"chunk_size": 64, "variant": variant, "normalize": normalize}
    ref_o, ref_g = run(hla_chunked, [x.float() for x in inputs], st, torch.float32, **kw)
    got_o, got_g = run(triton_path, inputs, st, torch.bfloat16, **kw)
    for i, (a, b) in enumerate(zip(got_o, ref_o, strict=True)):
        assert rel(a, b) <= 1e-2, f"output {i}: {rel(a, b):.2e}"
    for i, (a, b) in enumerate(zip(got_g, ref_g, strict=True)):
        assert rel(a, b) <= 1e-2, f"grad {i}: {rel(a, b):.2e}"


def test_dispatch_sends_unsupported_inputs_to_the_pytorch_forms(kernel_calls):
    """fp64 inputs and chunk sizes the chunked kernels do not take: "auto" takes the PyTorch forms,
    "triton" and the Triton forms raise; one token with gradients takes the chunked kernels."""
    (q, k, v, la), _ = make(1, 20, 2, 16, 16, variant="hla2", normalize=False, with_state=False)
    assert "dtype" in triton_unsupported(q, 64, False)
    assert "chunk_size" in triton_unsupported(q.float(), 24, False)
    assert triton_unsupported(q.float(), 24, True) is None  # the fused recurrent kernel has no chunks
    assert triton_unsupported(q.float(), 16, False) is None
    want, _ = hla_chunked(q, k, v, la, chunk_size=64)
    got, _ = hla_attention(q, k, v, la, chunk_size=64, backend="auto")  # fp64: the PyTorch form
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="dtype"):
        hla_triton(q, k, v, la)
    x32 = [x.float().to(DEV) for x in (q, k, v, la)]
    with pytest.raises(ValueError, match="chunk_size"):
        hla_triton(*x32, chunk_size=24)
    with pytest.raises(ValueError):  # off CUDA, or the chunk size on CUDA
        hla_attention(*x32, chunk_size=24, backend="triton")
    if DEV == "cuda":
        got, _ = hla_attention(*x32, chunk_size=24, backend="auto")
        want, _ = hla_chunked(*x32, chunk_size=24)
        assert torch.equal(got, want)
    xs = [x[:, :1].clone().requires_grad_() for x in x32]
    o, _ = triton_path(*xs, chunk_size=16)
    o.sum().backward()
    assert kernel_calls == {"chunked": 1, "recurrent": 0}
    assert all(torch.isfinite(x.grad).all() for x in xs)
    with pytest.raises(ValueError, match="forward only"):
        triton_fused_recurrent.hla_recurrent_triton(*xs)
