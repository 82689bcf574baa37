"""SSE from the projections (`sse_triton_from_projections`: the feature maps computed where the merged rows
are written and their gradients where the merged rows' are gathered) against the two-step path it replaces:
`sse_gla_features` on the kernels, then `sse_triton`. Same outputs, states and gradients of every input bit
for bit in fp32 and bf16, every q2 mode, K / V at fewer heads, column slices of one packed projection, K < N
(the trailing rows), padding, a carried state; without gradients the output norm and gate in the combining
kernel as `norm_gate` gives them; values and gradients against the fp64 oracle (`sse_recurrent`
on the PyTorch features). Under TRITON_INTERPRET=1 on the CPU; the `gpu` test runs bf16 at a real layer's
shape."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels.norm_gate import norm_gate  # noqa: E402
from subquadratic.kernels.sse import SSEState, router_topk, sse_recurrent  # noqa: E402
from subquadratic.kernels.sse.features import sse_gla_features  # noqa: E402
from subquadratic.kernels.sse.triton_sse import sse_triton, sse_triton_from_projections  # noqa: E402

from ..fused_models import rel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def projections(B, T, H, HK, D, N, seed, dtype, mode, pad=0):
    """(cut, leaves, router logits, valid mask): `cut(*leaves)` gives q1, k1, q2 / k2 (as the mode reads
    them), v, z1, z2 as column slices of one packed [B, T, width] tensor, as a packed projection gives them,
    and the two decay biases; the leaves are that packed tensor and the biases."""
    g = torch.Generator().manual_seed(seed)
    widths = [H * D, HK * D, H * D, H * D, HK * D, H * D, H * D]
    packed = torch.randn(B, T, sum(widths) + 5, generator=g, dtype=torch.float64)
    packed[..., H * D:(H + HK) * D] *= 3.0  # keys spread enough that the softmax is not flat
    biases = [(torch.randn(H * D, generator=g, dtype=torch.float64) + 2.0).to(DEV, dtype) for _ in range(2)]
    logits = torch.randn(B, T, N, generator=g, dtype=torch.float64).to(DEV)
    valid = torch.ones(B, T, dtype=torch.bool, device=DEV)
    if pad:
        valid[-1, T - pad:] = False

    def cut(packed, bias1, bias2):
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
        return q1, k1, q2, k2, v, z1, z2, bias1, bias2

    return cut, (packed.to(DEV, dtype), *biases), logits, valid


def two_steps(xs, normalizer, probs, sel, state, mode, topk, chunk, valid=None):
    """The feature kernel, a padding token's features zeroed (as the model does), then `sse_triton`."""
    feats = sse_gla_features(*xs, normalizer, backend="triton", q2_mode=mode)
    if valid is not None:
        feats = [torch.where(valid[:, :, None, None], t, 0.0) for t in feats]
    return sse_triton(*feats, probs, sel, state, chunk_size=chunk, topk=topk)


def same_or_rounding(a, b, tol, what):
    """Bit for bit under the interpreter; on a GPU within `tol` (relative and absolute), where two kernels may
    sum in another order."""
    if DEV == "cpu":
        assert torch.equal(a, b), f"{what}: max diff {(a.double() - b.double()).abs().max().item():.3e}"
    else:
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=what)


def outputs_and_grads(fn, cut, leaves, logits, valid, state, topk):
    """fn's (o, shared, parts) on the projections `cut(*leaves)` and the gradients of a fixed random loss of
    them with respect to the leaves (the packed projections, the biases), the router logits and the state."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    lg = logits.detach().clone().requires_grad_()
    st = None if state is None else SSEState(*(t.detach().clone().requires_grad_() for t in (state.shared,
                                                                                                state.parts)))
    probs, sel = router_topk(lg, topk, valid)
    o, new = fn(cut(*leaves), probs, sel, st)
    outs = [o, new.shared, new.parts]
    g = torch.Generator().manual_seed(123)
    sum((y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device)).sum()
        for y in outs).backward()
    return outs, [t.grad for t in leaves + [lg] + ([] if st is None else [st.shared, st.parts])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,H,HK,N,topk,pad,chunk,carried", [
    ("offset", 4, 2, 3, 1, 0, 16, False), ("same", 2, 2, 4, 2, 3, 16, True), ("full", 4, 1, 2, 1, 5, 32, True),
    ("offset", 2, 2, 4, 4, 0, 16, True)])
def test_equals_features_then_sse_triton(dtype, mode, H, HK, N, topk, pad, chunk, carried):
    B, T, D = 2, 25, 16
    cut, leaves, logits, valid = projections(B, T, H, HK, D, N, seed=H * 10 + N, dtype=dtype, mode=mode, pad=pad)
    g = torch.Generator().manual_seed(7)
    state = None
    if carried:
        state = SSEState(torch.randn(B, H, D, D, generator=g).to(DEV), torch.randn(B, N, H, D, D, generator=g).to(DEV))
    logits = logits.to(dtype)
    mask = valid if pad else None  # padding: its features zeroed on both paths
    want, want_g = outputs_and_grads(lambda x, p, s, st: two_steps(x, 16.0, p, s, st, mode, topk, chunk, mask),
                                     cut, leaves, logits, valid, state, topk)
    got, got_g = outputs_and_grads(lambda x, p, s, st: sse_triton_from_projections(
        *x, 16.0, p, s, st, q2_mode=mode, chunk_size=chunk, topk=topk, valid=mask), cut, leaves, logits, valid,
        state, topk)
    assert got[0].dtype == dtype and got[0].shape == (B, T, H, D)
    assert torch.isfinite(got[0]).all()
    for name, a, b in zip(("o", "shared", "parts"), got, want, strict=True):
        assert torch.equal(a, b), f"{name}: max diff {(a.double() - b.double()).abs().max().item():.3e}"
    assert len(got_g) == len(want_g)
    for i, (a, b) in enumerate(zip(got_g, want_g, strict=True)):
        assert a is not None and a.dtype == b.dtype and a.shape == b.shape, i
        # on a GPU the backward's row sums may be ordered otherwise than the feature kernel's
        same_or_rounding(a, b, 1e-5 if dtype == torch.float32 else 2e-2, f"gradient {i}")
    with torch.no_grad():  # without gradients: the same values, nothing kept for a backward
        o, new = sse_triton_from_projections(*cut(*leaves), 16.0, *router_topk(logits, topk, valid), state,
                                             q2_mode=mode, chunk_size=chunk, topk=topk, valid=mask)
    assert torch.equal(o, want[0]) and torch.equal(new.parts, want[2])
    # the output norm and gate in the combining kernel: `norm_gate` of that output, bit for bit, with a
    # weight per head dim and one per head
    gate = torch.randn(B, T, H, D, generator=g).to(DEV, dtype)
    for weight in (torch.rand(D, generator=g) + 0.5, torch.rand(H, D, generator=g) + 0.5):
        weight = weight.to(DEV)
        with torch.no_grad():
            o, new = sse_triton_from_projections(*cut(*leaves), 16.0, *router_topk(logits, topk, valid), state,
                                                 q2_mode=mode, chunk_size=chunk, topk=topk, valid=mask,
                                                 norm_gate=(weight, gate, 1e-5))
        # on a GPU the two kernels' tiles (other row counts) may sum a row's squares in another order: the norm's
        # 1 / rms an ulp apart, which can move a rounding of the output
        same_or_rounding(o, norm_gate(want[0], weight, gate, 1e-5, backend="triton"),
                         1e-6 if dtype == torch.float32 else 1e-2, "norm and gate")
        assert torch.equal(new.parts, want[2])
    with pytest.raises(ValueError, match="takes no gradients"):
        x = [t.detach().clone().requires_grad_() for t in leaves]
        sse_triton_from_projections(*cut(*x), 16.0, *router_topk(logits, topk, valid), state, q2_mode=mode,
                                    chunk_size=chunk, topk=topk, valid=mask, norm_gate=(weight, gate, 1e-5))


def saved_bytes(fn):
    """(fn()'s result, bytes of the distinct storages autograd saved for the backward while it ran)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("dtype,carried", [(torch.float32, True), (torch.bfloat16, False)])
def test_recomputed_rows_keep_less_and_give_the_kept_rows_values_and_gradients(dtype, carried):
    """`recompute` (the default): the backward writes the merged rows again instead of keeping them. The
    same outputs, states and gradients of every input (the carried state's too) as with the rows kept,
    while autograd keeps at least the merged rows' bytes less: (T + R) rows of q, k, v and fp32 decays."""
    B, T, H, HK, D, N, topk, mode = 2, 40, 4, 2, 16, 4, 2, "offset"
    cut, leaves, logits, valid = projections(B, T, H, HK, D, N, seed=5, dtype=dtype, mode=mode, pad=3)
    g = torch.Generator().manual_seed(11)
    state = None
    if carried:
        state = SSEState(torch.randn(B, H, D, D, generator=g).to(DEV), torch.randn(B, N, H, D, D, generator=g).to(DEV))
    logits = logits.to(dtype)
    runs = {}
    for recompute in (False, True):
        def call(x, p, s, st, recompute=recompute):
            return sse_triton_from_projections(*x, 16.0, p, s, st, q2_mode=mode, chunk_size=16, topk=topk,
                                               valid=valid, recompute=recompute)
        runs[recompute] = saved_bytes(lambda call=call: outputs_and_grads(call, cut, leaves, logits, valid, state,
                                                                          topk))
    (want, want_g), kept = runs[False]
    (got, got_g), recomputed = runs[True]
    for name, a, b in zip(("o", "shared", "parts"), got, want, strict=True):
        assert torch.equal(a, b), f"{name}: max diff {(a.double() - b.double()).abs().max().item():.3e}"
    assert len(got_g) == len(want_g) == len(leaves) + 1 + 2 * carried
    for i, (a, b) in enumerate(zip(got_g, want_g, strict=True)):
        assert a is not None and b is not None, i
        same_or_rounding(a, b, 1e-6 if dtype == torch.float32 else 1e-2, f"gradient {i}")
    rows = B * T + B * T * topk  # merged rows: a token's shared one and its K partitions'
    merged = rows * H * D * (3 * dtype.itemsize + 4)  # q, k, v in the inputs' dtype, decays fp32
    assert kept - recomputed >= merged, (kept, recomputed, merged)


def test_values_and_gradients_against_the_fp64_recurrence():
    """The composition's meaning: fp32 from the projections against the fp64 recurrence on the PyTorch
    features (a check that does not go through the kernels it replaces), every token real as in the model's
    calls that take this path, values and every gradient."""
    from subquadratic.kernels.sse.features import sse_gla_features_reference

    B, T, H, HK, D, N, topk = 2, 29, 4, 2, 16, 3, 2
    cut, leaves, logits, valid = projections(B, T, H, HK, D, N, seed=3, dtype=torch.float32, mode="offset")
    g = torch.Generator().manual_seed(5)
    state = SSEState(torch.randn(B, H, D, D, generator=g).to(DEV), torch.randn(B, N, H, D, D, generator=g).to(DEV))
    got, got_g = outputs_and_grads(lambda x, p, s, st: sse_triton_from_projections(
        *x, 8.0, p, s, st, q2_mode="offset", chunk_size=16, topk=topk), cut, leaves, logits.float(), valid, state,
        topk)

    def oracle(x, p, s, st):
        feats = sse_gla_features_reference(*(t.double() for t in x), 8.0, "offset")
        return sse_recurrent(*feats, p.double(), s, SSEState(st.shared.double(), st.parts.double()), topk=topk)

    want, want_g = outputs_and_grads(oracle, cut, leaves, logits.float(), valid, state, topk)
    for i, (a, b) in enumerate(zip(got + got_g, want + want_g, strict=True)):
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
        assert err <= 1e-4, (i, err)


def test_refuses_bad_input():
    cut, leaves, logits, valid = projections(1, 8, 2, 2, 16, 2, seed=1, dtype=torch.float32, mode="offset")
    xs = cut(*leaves)
    probs, sel = router_topk(logits.float(), 1, valid)
    with pytest.raises(ValueError, match="q2_mode"):
        sse_triton_from_projections(*xs, 16.0, probs, sel, q2_mode="half", topk=1)
    with pytest.raises(ValueError, match="topk"):
        sse_triton_from_projections(*xs, 16.0, probs, sel, q2_mode="offset", topk=3)
    with pytest.raises(ValueError, match="state"):
        bad = SSEState(torch.zeros(1, 2, 16, 16), torch.zeros(1, 3, 2, 16, 16))
        sse_triton_from_projections(*xs, 16.0, probs, sel, bad, q2_mode="offset", topk=1)
    with pytest.raises(ValueError, match="valid"):
        sse_triton_from_projections(*xs, 16.0, probs, sel, q2_mode="offset", topk=1, valid=valid.int())


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_gpu_bf16_layer_shape():
    """A real layer's shape in bf16: the prefill bit for bit, the gradients within bf16 rounding of the two
    steps'."""
    B, T, H, HK, D, N = 1, 4096, 16, 8, 128, 4
    cut, leaves, logits, valid = projections(B, T, H, HK, D, N, seed=11, dtype=torch.bfloat16, mode="offset")
    xs = cut(*leaves)
    probs, sel = router_topk(logits.bfloat16(), 1, valid)
    with torch.no_grad():
        want = two_steps(xs, 16.0, probs, sel, None, "offset", 1, 64)
        got = sse_triton_from_projections(*xs, 16.0, probs, sel, q2_mode="offset", chunk_size=64, topk=1)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].shared, want[1].shared) and torch.equal(got[1].parts, want[1].parts)
    want, want_g = outputs_and_grads(lambda x, p, s, st: two_steps(x, 16.0, p, s, st, "offset", 1, 64),
                                     cut, leaves, logits.bfloat16(), valid, None, 1)
    got, got_g = outputs_and_grads(lambda x, p, s, st: sse_triton_from_projections(
        *x, 16.0, p, s, st, q2_mode="offset", chunk_size=64, topk=1), cut, leaves, logits.bfloat16(), valid, None, 1)
    for i, (a, b) in enumerate(zip(got_g, want_g, strict=True)):
        assert rel(a, b) < 1e-2, (i, rel(a, b))


#: SSE-H's layout (K / V at the source's heads, a window branch on the SSE layer's q / k / v, a softmax layer)
#: in three layers; and a window branch of its own q / k / v with K / V at the query heads
MODELS = [("tiny-swa", dict(sse_kv_heads="source", sse_window_qkv="shared", sse_window_sinks=2, num_hidden_layers=3,
                            mixer_types=["sse", "full_attention", "sse"]), True),
          ("tiny-swa", dict(sse_kv_heads="query"), False)]


@pytest.mark.parametrize("preset,overrides,full", MODELS)
def test_the_model_takes_it_with_the_two_step_values(preset, overrides, full, monkeypatch, one_thread):
    """Every token real (the plans as on CUDA; on the CPU the kernels under the interpreter): the SSE layers take
    `sse_from_projections`, and a prefill's logits and cached states, the greedy continuation from that
    cache, a left-padded prefill's logits, and a training step's loss and every parameter's gradient, of a
    plain batch and a packed one (documents one per right-padded row inside the layer), equal the two-step
    kernels' (the feature kernel, then `sse_triton`) bit for bit (on a GPU: within rounding without gradients,
    where the norm and gate run in the combining kernel) (the second case, a
    window branch with K / V at the query heads: the plain prefill and training step only)."""
    from subquadratic.families.sse import modeling as sse_modeling

    from ...models.common import GEN
    from ...models.sse.test_modeling_sse import lively

    real_from = sse_modeling.sse_from_projections
    calls = []  # a spy: the path is the plan's
    monkeypatch.setattr(sse_modeling, "sse_from_projections", lambda *a, **kw: calls.append(1) or real_from(*a, **kw))
    from subquadratic.kernels.sse import triton_sse

    gated, real_gated = [], triton_sse.combine_rows_gated

    def spy(*a):  # the calls with a norm and gate (CombineRows' forward calls it without)
        gated.extend([1] if len(a) > 4 and a[4] is not None else [])
        return real_gated(*a)

    monkeypatch.setattr(triton_sse, "combine_rows_gated", spy)
    m = lively(preset, 0, **overrides).to(DEV)
    n_sse = m.config.mixer_types.count("sse")
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(1)).to(DEV)
    # two documents packed into one row, position ids restarting at each (DataCollatorWithFlattening's layout)
    packed = {"input_ids": torch.cat([ids[0, :11], ids[1, :15]])[None],
              "position_ids": torch.cat([torch.arange(11), torch.arange(15)])[None].to(DEV)}
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    padded = {"input_ids": ids, "attention_mask": mask}
    results = []
    # the CUDA plans (the features, the norm and gate on their kernels; the SSE kernels for a chunk); on the CPU
    # the router's PyTorch form and exact dots, as there; the two-step run: the fused path left out
    cuda = {} if DEV == "cuda" else {"device": "cuda", "router": "torch", "precision": "ieee"}
    for fused in (True, False):
        m.set_plan("sse", **cuda, **({} if fused else {"fused": False}))
        with torch.no_grad():
            out = m(ids, use_cache=True)
            padded_logits = m(**padded, use_cache=True).logits if full else None
        states = [layer.tensors[k].clone() for layer in out.past_key_values.layers if "shared" in layer.tensors
                  for k in ("shared", "parts")]
        gen = m.generate(ids, max_new_tokens=2, do_sample=False, **GEN) if full else None
        trained = []
        for batch in ({"input_ids": ids}, packed)[:2 if full else 1]:
            m.zero_grad()
            loss = m(**batch, labels=batch["input_ids"], use_cache=False).loss
            loss.backward()
            trained.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
        results.append((out.logits, padded_logits, states, gen, trained))
    # the two prefills, generate()'s prefill (none of its steps), the two training calls
    assert len(calls) == (5 if full else 2) * n_sse > 0
    assert len(gated) == (3 if full else 1) * n_sse  # without gradients: the norm and gate in the combining kernel
    (a_logits, a_padded, a_states, a_gen, a_trained), (b_logits, b_padded, b_states, b_gen, b_trained) = results
    # without gradients the norm and gate of the combining kernel: on a GPU within rounding of the norm-gate
    # kernel's (its sum of squares may run in another order), which the TF32 dots of the layers above carry on
    close = torch.equal if DEV == "cpu" else lambda x, y: rel(x, y) < 1e-3
    assert close(a_logits, b_logits)
    assert len(a_states) == 2 * n_sse and all(close(x, y) for x, y in zip(a_states, b_states, strict=True))
    if full:
        assert close(a_padded, b_padded) and torch.equal(a_gen, b_gen)
    names = ("plain", "packed")[:len(a_trained)]
    for batch, (a_loss, a_grads), (b_loss, b_grads) in zip(names, a_trained, b_trained, strict=True):
        assert torch.equal(a_loss, b_loss), batch
        assert a_grads.keys() == b_grads.keys() and any("g1_bias" in n for n in a_grads)
        for n, g in a_grads.items():
            # a packed batch's decay biases sum their tokens' gradients in the documents' layout here, in the
            # packed one there; on a GPU the backward's row sums may be ordered otherwise than the feature kernel's,
            # and the TF32 dots of the layers below carry that rounding on
            if DEV == "cpu" and not (batch == "packed" and n.endswith("_bias")):
                assert torch.equal(g, b_grads[n]), (batch, n)
            elif DEV == "cpu":
                torch.testing.assert_close(g, b_grads[n], rtol=1e-4, atol=1e-6, msg=f"{batch} {n}")
            else:
                assert rel(g, b_grads[n]) < 1e-3, (batch, n, rel(g, b_grads[n]))
