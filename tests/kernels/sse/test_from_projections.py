"""SSE from the projections (`sse_triton_from_projections`: the feature maps computed where the merged rows
are written) against the two-step path it replaces without gradients: `sse_gla_features` on the kernels,
then `sse_triton`. Same outputs and states bit for bit in fp32 and bf16, every q2 mode, K / V at fewer
heads, column slices of one packed projection, K < N (the trailing rows), padding, a carried state; the
oracle's values through the composition (fp64 `sse_recurrent` on the PyTorch features). Under
TRITON_INTERPRET=1 on the CPU; the `gpu` test runs bf16 at a real layer's shape."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.sse import SSEState, router_topk, sse_recurrent  # noqa: E402
from subquadratic.kernels.sse.features import sse_gla_features, sse_gla_features_reference  # noqa: E402
from subquadratic.kernels.sse.triton_sse import sse_triton, sse_triton_from_projections  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def projections(B, T, H, HK, D, N, seed, dtype, mode, pad=0):
    """Column slices of one packed [B, T, width] tensor, as a packed projection gives them: q1, k1, q2 / k2 (as
    the mode reads them), v, z1, z2; biases, router logits and the valid mask."""
    g = torch.Generator().manual_seed(seed)
    widths = [H * D, HK * D, H * D, H * D, HK * D, H * D, H * D]
    packed = torch.randn(B, T, sum(widths) + 5, generator=g, dtype=torch.float64)
    packed[..., H * D:(H + HK) * D] *= 3.0  # keys spread enough that the softmax is not flat
    packed = packed.to(DEV, dtype)
    cols, start = [], 0
    for w in widths:
        cols.append(packed[..., start:start + w])
        start += w
    q1, k1, q2, k2, v, z1, z2 = cols
    q1, q2, k2 = (t.view(B, T, H, D) for t in (q1, q2, k2))
    k1, v = (t.view(B, T, HK, D) for t in (k1, v))
    if mode == "offset":
        q2, k2 = q2 * 0.3, k2 * 0.3  # low-rank offsets: small beside q1 / k1
    if mode == "same":
        q2 = k2 = None
    biases = [(torch.randn(H * D, generator=g, dtype=torch.float64) + 2.0).to(DEV, dtype) for _ in range(2)]
    logits = torch.randn(B, T, N, generator=g, dtype=torch.float64).to(DEV)
    valid = torch.ones(B, T, dtype=torch.bool, device=DEV)
    if pad:
        valid[-1, T - pad:] = False
    return (q1, k1, q2, k2, v, z1, z2, *biases), logits, valid


def two_steps(xs, normalizer, probs, sel, state, mode, topk, chunk):
    feats = sse_gla_features(*xs, normalizer, backend="triton", q2_mode=mode)
    return sse_triton(*feats, probs, sel, state, chunk_size=chunk, topk=topk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,H,HK,N,topk,pad,chunk,carried", [
    ("offset", 4, 2, 3, 1, 0, 16, False), ("same", 2, 2, 4, 2, 3, 16, True), ("full", 4, 1, 2, 1, 5, 32, True),
    ("offset", 2, 2, 4, 4, 0, 16, True)])
def test_equals_features_then_sse_triton(dtype, mode, H, HK, N, topk, pad, chunk, carried):
    B, T, D = 2, 37, 16
    xs, logits, valid = projections(B, T, H, HK, D, N, seed=H * 10 + N, dtype=dtype, mode=mode, pad=pad)
    probs, sel = router_topk(logits.to(dtype), topk, valid)
    g = torch.Generator().manual_seed(7)
    state = None
    if carried:
        state = SSEState(torch.randn(B, H, D, D, generator=g).to(DEV), torch.randn(B, N, H, D, D, generator=g).to(DEV))
    with torch.no_grad():
        want_o, want_s = two_steps(xs, 16.0, probs, sel, state, mode, topk, chunk)
        got_o, got_s = sse_triton_from_projections(*xs, 16.0, probs, sel, state, q2_mode=mode, chunk_size=chunk,
                                                   topk=topk)
    assert got_o.dtype == dtype and got_o.shape == (B, T, H, D)
    assert torch.isfinite(got_o).all()
    for name, a, b in (("o", got_o, want_o), ("shared", got_s.shared, want_s.shared), ("parts", got_s.parts,
                                                                                           want_s.parts)):
        assert torch.equal(a, b), f"{name}: max diff {(a.double() - b.double()).abs().max().item():.3e}"


def test_values_against_the_fp64_recurrence():
    """The composition's meaning: fp32 from the projections against the fp64 recurrence on the PyTorch
    features (a check that does not go through the kernels it replaces), every token real as in the model's
    prefill that takes this path."""
    B, T, H, HK, D, N, topk = 2, 29, 4, 2, 16, 3, 2
    xs, logits, valid = projections(B, T, H, HK, D, N, seed=3, dtype=torch.float32, mode="offset")
    probs, sel = router_topk(logits.float(), topk, valid)
    g = torch.Generator().manual_seed(5)
    state = SSEState(torch.randn(B, H, D, D, generator=g).to(DEV), torch.randn(B, N, H, D, D, generator=g).to(DEV))
    with torch.no_grad():
        got_o, got_s = sse_triton_from_projections(*xs, 8.0, probs, sel, state, q2_mode="offset", chunk_size=16,
                                                   topk=topk)
        feats = sse_gla_features_reference(*(t.double() for t in xs), 8.0, "offset")
        want_o, want_s = sse_recurrent(*feats, probs.double(), sel, SSEState(state.shared.double(),
                                                                             state.parts.double()), topk=topk)
    for a, b in ((got_o, want_o), (got_s.shared, want_s.shared), (got_s.parts, want_s.parts)):
        err = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert err <= 1e-4, err


def test_refuses_gradients_and_bad_input():
    xs, logits, valid = projections(1, 8, 2, 2, 16, 2, seed=1, dtype=torch.float32, mode="offset")
    probs, sel = router_topk(logits.float(), 1, valid)
    q1 = xs[0].detach().requires_grad_()
    with pytest.raises(ValueError, match="no gradients"):
        sse_triton_from_projections(q1, *xs[1:], 16.0, probs, sel, q2_mode="offset", topk=1)
    with torch.no_grad():
        with pytest.raises(ValueError, match="q2_mode"):
            sse_triton_from_projections(*xs, 16.0, probs, sel, q2_mode="half", topk=1)
        with pytest.raises(ValueError, match="topk"):
            sse_triton_from_projections(*xs, 16.0, probs, sel, q2_mode="offset", topk=3)
        with pytest.raises(ValueError, match="state"):
            bad = SSEState(torch.zeros(1, 2, 16, 16), torch.zeros(1, 3, 2, 16, 16))
            sse_triton_from_projections(*xs, 16.0, probs, sel, bad, q2_mode="offset", topk=1)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_gpu_bf16_layer_shape():
    B, T, H, HK, D, N = 1, 4096, 16, 8, 128, 4
    xs, logits, valid = projections(B, T, H, HK, D, N, seed=11, dtype=torch.bfloat16, mode="offset")
    probs, sel = router_topk(logits.bfloat16(), 1, valid)
    with torch.no_grad():
        want = two_steps(xs, 16.0, probs, sel, None, "offset", 1, 64)
        got = sse_triton_from_projections(*xs, 16.0, probs, sel, q2_mode="offset", chunk_size=64, topk=1)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].shared, want[1].shared) and torch.equal(got[1].parts, want[1].parts)


@pytest.mark.parametrize("preset,kv_heads", [("tiny-h", "source"), ("tiny-swa", "query")])
def test_the_model_prefill_takes_it_with_the_two_step_values(preset, kv_heads, monkeypatch, one_thread):
    """A prefill without gradients, every token real (as on CUDA; here the kernels forced under the
    interpreter): the SSE layers take `sse_from_projections`, the logits and the cached states equal the
    two-step kernels' (the feature kernel, then `sse_triton`) bit for bit, and the greedy continuation from
    that cache is the same; a call with gradients and one with padding keep the two-step path."""
    from subquadratic.families.sse import modeling as sse_modeling
    from subquadratic.kernels import sse as sse_kernels
    from subquadratic.kernels.sse import features

    from ...models.common import GEN
    from ...models.sse.test_modeling_sse import lively

    real_attention, real_from = sse_modeling.sse_attention, sse_modeling.sse_from_projections

    def two_step(q1, k1, q2, k2, v, g1, g2, probs, sel, state, **kw):  # the SSE kernels for a chunk, as on CUDA
        if q1.shape[1] == 1:
            return real_attention(q1, k1, q2, k2, v, g1, g2, probs, sel, state, **kw)
        return sse_triton(q1, k1, q2, k2, v, g1, g2, probs, sel, state, chunk_size=kw["chunk_size"], topk=kw["topk"])

    def takes(q1, v, chunk_size, backend):
        return q1.shape[1] > 1 and not torch.is_grad_enabled() and sse_kernels.triton_unsupported(
            q1, v, "gla", chunk_size) is None

    calls = []
    monkeypatch.setattr(sse_modeling, "sse_gla_features_takes_kernel",
                        lambda *xs, **kw: features.sse_gla_features_unsupported(*xs, **kw) is None)
    monkeypatch.setattr(sse_modeling, "sse_attention", two_step)
    monkeypatch.setattr(sse_modeling, "sse_from_projections", lambda *a, **kw: calls.append(1) or real_from(*a, **kw))
    m = lively(preset, 0, sse_kv_heads=kv_heads).to(DEV)
    n_sse = m.config.mixer_types.count("sse")
    ids = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(1)).to(DEV)
    results = []
    for fused in (True, False):
        monkeypatch.setattr(sse_modeling, "sse_from_projections_takes", takes if fused else lambda *a: False)
        with torch.no_grad():
            out = m(ids, use_cache=True)
        states = [layer.tensors[k].clone() for layer in out.past_key_values.layers if "shared" in layer.tensors
                  for k in ("shared", "parts")]
        gen = m.generate(ids, max_new_tokens=4, do_sample=False, **GEN)
        results.append((out.logits, states, gen))
    assert len(calls) == 2 * n_sse > 0  # the forward's prefill and generate()'s, none of its one-token steps
    (a_logits, a_states, a_gen), (b_logits, b_states, b_gen) = results
    assert torch.equal(a_logits, b_logits)
    assert len(a_states) == 2 * n_sse and all(torch.equal(x, y) for x, y in zip(a_states, b_states, strict=True))
    assert torch.equal(a_gen, b_gen)
    monkeypatch.setattr(sse_modeling, "sse_from_projections_takes", takes)
    monkeypatch.setattr(sse_modeling, "sse_from_projections", lambda *a, **kw: pytest.fail("taken"))
    m(ids, labels=ids, use_cache=False).loss.backward()  # with gradients
    with torch.no_grad():
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        m(ids, attention_mask=mask, use_cache=True)  # padding
