"""HLA Triton kernels vs the fp64 PyTorch oracle: values and gradients of the chunked kernels (q, k,
v, log_alpha, the initial state, and gradients flowing into the final state), hla2 and ahla, plain
and normalised, T not a multiple of the chunk, several K / V blocks; the fused recurrent (decode)
kernel against `hla_recurrent`. Kernel outputs start as NaN, so anything left unwritten fails.
On CPU it runs under TRITON_INTERPRET=1 at small shapes; on CUDA the `gpu` tests run bf16 at
real shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before Triton is imported
pytest.importorskip("triton")
from subquadratic.kernels.hla import (  # noqa: E402
    HLAState,
    hla_chunked,
    hla_recurrent,
    triton_chunk,  # noqa: E402
)
from subquadratic.kernels.hla.triton_chunk import hla_chunked_triton  # noqa: E402
from subquadratic.kernels.hla.triton_fused_recurrent import hla_recurrent_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every kernel output starts as NaN: anything left unwritten fails the test."""
    monkeypatch.setattr(triton_chunk, "POISON_OUTPUTS", True)


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
def test_chunked_values_and_grads(monkeypatch, variant, normalize, with_state, D, Dv, small):
    if small:  # several K and V blocks per head in every kernel
        for name in ("BK_H", "BV_H", "BV_O", "BV_DQKV"):
            monkeypatch.setattr(triton_chunk, name, 16)
    inputs, st = make(2, 40, 2, D, Dv, variant=variant, normalize=normalize, with_state=with_state,
                      positive=normalize, seed=D + 3 * normalize + 7 * (variant == "ahla"))
    kw = {"chunk_size": 16, "variant": variant, "normalize": normalize}
    ref_o, ref_g = run(hla_chunked, inputs, st, torch.float64, **kw)
    got_o, got_g = run(hla_chunked_triton, inputs, st, torch.float32, **kw)
    for i, (a, b) in enumerate(zip(got_o, ref_o, strict=True)):
        assert rel(a, b) <= 1e-4, f"output {i}: {rel(a, b):.2e}"
    for i, (a, b) in enumerate(zip(got_g, ref_g, strict=True)):
        assert rel(a, b) <= 1e-4, f"grad {i}: {rel(a, b):.2e}"


@pytest.mark.parametrize("variant", ["hla2", "ahla"])
@pytest.mark.parametrize("normalize", [False, True])
def test_decode_matches_recurrence(variant, normalize):
    D, Dv = 16, 48  # two value-column blocks
    (q, k, v, la), st = make(2, 3, 2, D, Dv, variant=variant, normalize=normalize, with_state=True,
                             positive=True, seed=7)
    ref_o, ref_st = hla_recurrent(q, k, v, la, st, normalize=normalize, variant=variant)
    st32 = HLAState(*[None if x is None else x.float().to(DEV) for x in (st.S, st.F, st.eta, st.z)])
    xs = [x.float().to(DEV) for x in (q, k, v, la)]
    outs = []
    for t in range(3):  # token by token, as generate() calls it
        o, st32 = hla_recurrent_triton(*[x[:, t:t + 1] for x in xs], st32, normalize=normalize, variant=variant)
        outs.append(o)
    o3, st3 = hla_recurrent_triton(*xs, HLAState(*[None if x is None else x.float().to(DEV)
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
    got_o, got_g = run(hla_chunked_triton, inputs, st, torch.bfloat16, **kw)
    for i, (a, b) in enumerate(zip(got_o, ref_o, strict=True)):
        assert rel(a, b) <= 1e-2, f"output {i}: {rel(a, b):.2e}"
    for i, (a, b) in enumerate(zip(got_g, ref_g, strict=True)):
        assert rel(a, b) <= 1e-2, f"grad {i}: {rel(a, b):.2e}"
