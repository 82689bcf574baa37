"""SSE: varlen / masked forms against the serial recurrence, router and auxiliary loss.

Tolerances are relative to the largest entry of the reference:
float64 <= 1e-10, float32 <= 1e-4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from subquadratic.kernels.sse import (
    SSEState,
    router_topk,
    sse_attention,
    sse_aux_loss,
    sse_decode_step,
    sse_masked,
    sse_recurrent,
    sse_varlen,
)

F64, F32 = torch.float64, torch.float32
TOL = {F64: 1e-10, F32: 1e-4}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def sse_inputs(B, T, H, Dk, Dv, N, K, base, dtype=F64, seed=0):
    """Feature-mapped inputs as the model produces them, a random state, a router."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    dshape = (B, T, H, Dk) if base == "gla" else (B, T, H)
    x = {
        "q1": F.silu(r(B, T, H, Dk)), "k1": torch.softmax(r(B, T, H, Dk), -1),
        "q2": F.silu(r(B, T, H, Dk)), "k2": torch.softmax(r(B, T, H, Dk), -1),
        "v": F.silu(r(B, T, H, Dv)),
        "g1": F.logsigmoid(r(*dshape)) / 4, "g2": F.logsigmoid(r(*dshape)) / 4,
    }
    x["probs"], x["sel"] = router_topk(r(B, T, N), K)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype) if base == "gdn" else None
    kw = {"base": base, "beta": beta}
    state = SSEState(r(B, H, Dk, Dv), r(B, N, H, Dk, Dv))
    return x, kw, state


GRAD_NAMES = ["q1", "k1", "q2", "k2", "v", "g1", "g2", "probs"]


def _run(fn, x, kw, state, **extra):
    return fn(**x, state=state, **kw, **extra)


@pytest.mark.parametrize("base", ["gla", "gdn"])
@pytest.mark.parametrize("N,K", [(4, 1), (4, 2), (8, 2)])
@pytest.mark.parametrize("form", ["masked", "varlen"])
def test_sse_forms_match_recurrent(base, N, K, form):
    x, kw, state = sse_inputs(2, 37, 2, 8, 6, N, K, base, seed=N * 10 + K)
    for name in GRAD_NAMES:
        x[name] = x[name].requires_grad_()
    fn = sse_masked if form == "masked" else sse_varlen
    gen = torch.Generator().manual_seed(1)

    def loss(o, s):
        w = [torch.randn(t.shape, generator=gen, dtype=F64) for t in (o, s.shared, s.parts)]
        return (o * w[0]).sum() + (s.shared * w[1]).sum() + (s.parts * w[2]).sum()

    o_ref, s_ref = _run(sse_recurrent, x, kw, state)
    g_ref = torch.autograd.grad(loss(o_ref, s_ref), [x[n] for n in GRAD_NAMES])
    gen.manual_seed(1)
    o, s = _run(fn, x, kw, state, chunk_size=16)
    grads = torch.autograd.grad(loss(o, s), [x[n] for n in GRAD_NAMES])
    assert rel_err(o, o_ref) <= TOL[F64]
    assert rel_err(s.shared, s_ref.shared) <= TOL[F64]
    assert rel_err(s.parts, s_ref.parts) <= TOL[F64]
    for name, a, b in zip(GRAD_NAMES, grads, g_ref, strict=True):
        assert rel_err(a, b) <= TOL[F64], name


@pytest.mark.parametrize("form", ["recurrent", "decode", "masked", "varlen"])
@pytest.mark.parametrize("base", ["gla", "gdn"])
def test_unselected_partitions_unchanged(form, base):
    N, K = 4, 2
    x, kw, state = sse_inputs(2, 5, 2, 8, 6, N, K, base, seed=3)
    x["sel"][..., 0] = False          # partition 0 never selected in this window
    fn = {"recurrent": sse_recurrent, "decode": sse_decode_step, "masked": sse_masked, "varlen": sse_varlen}[form]
    for t in range(5):                # one decode-sized step at a time
        step = {n: a[:, t : t + 1] for n, a in x.items()}
        kw_t = dict(kw, beta=None if kw["beta"] is None else kw["beta"][:, t : t + 1])
        _, new = fn(**step, state=state, **kw_t)
        unsel = ~step["sel"][:, 0]    # [B, N]
        assert torch.equal(new.parts[unsel], state.parts[unsel])
        assert not torch.equal(new.parts[~unsel], state.parts[~unsel])
        state = new


@pytest.mark.parametrize("form", ["recurrent", "decode", "masked", "varlen"])
@pytest.mark.parametrize("base", ["gla", "gdn"])
def test_padding_token_leaves_state_unchanged(form, base):
    x, kw, state = sse_inputs(2, 3, 2, 8, 6, 4, 2, base, seed=4)
    x["sel"][:, 1] = False
    x["k1"][:, 1] = 0.0
    x["g1"][:, 1] = 0.0
    fn = {"recurrent": sse_recurrent, "decode": sse_decode_step, "masked": sse_masked, "varlen": sse_varlen}[form]
    pad = {n: a[:, 1:2] for n, a in x.items()}
    kw_p = dict(kw, beta=None if kw["beta"] is None else kw["beta"][:, 1:2])
    _, new = fn(**pad, state=state, **kw_p)
    assert torch.equal(new.shared, state.shared)
    assert torch.equal(new.parts, state.parts)


def test_decode_inplace_and_handover():
    x, kw, state = sse_inputs(2, 20, 2, 8, 6, 4, 1, "gla", seed=5)
    o_ref, s_ref = sse_recurrent(**x, state=state, **kw)
    prefill = {n: a[:, :15] for n, a in x.items()}
    o_pre, s = sse_varlen(**prefill, state=state, **kw, chunk_size=8)
    s = SSEState(s.shared.clone(), s.parts.clone())
    outs = [o_pre]
    for t in range(15, 20):
        step = {n: a[:, t : t + 1] for n, a in x.items()}
        before = s.parts.clone()
        o_t, s2 = sse_recurrent(**step, state=s, **kw, inplace=True)
        assert s2 is s
        assert torch.equal(s.parts[~step["sel"][:, 0]], before[~step["sel"][:, 0]])
        outs.append(o_t)
    assert rel_err(torch.cat(outs, 1), o_ref) <= TOL[F64]
    assert rel_err(s.parts, s_ref.parts) <= TOL[F64]
    assert rel_err(s.shared, s_ref.shared) <= TOL[F64]


@pytest.mark.parametrize("base", ["gla", "gdn"])
@pytest.mark.parametrize("N,K", [(4, 1), (5, 2)])
@pytest.mark.parametrize("inplace", [False, True])
def test_decode_step_equals_recurrent(base, N, K, inplace):
    """`sse_decode_step` (one index_select / index_copy over the flattened partitions) equals the
    serial recurrence token by token: outputs, states and (out of place) gradients, fp64, with a
    padding token in one row and a row routed to fewer than K partitions."""
    B, T = 3, 6
    x, kw, state = sse_inputs(B, T, 2, 8, 6, N, K, base, seed=20 + N + K)
    x["sel"][1, 2] = False                      # padding: no write, no decay
    x["k1"][1, 2], x["g1"][1, 2] = 0.0, 0.0
    x["sel"][2, 4, x["sel"][2, 4].nonzero()[0]] = False  # one fewer than K selected
    s_ref, s = SSEState(state.shared.clone(), state.parts.clone()), SSEState(state.shared.clone(), state.parts.clone())
    for t in range(T):
        step = {n: a[:, t:t + 1] for n, a in x.items()}
        kw_t = dict(kw, beta=None if kw["beta"] is None else kw["beta"][:, t:t + 1])
        o_ref, s_ref = sse_recurrent(**step, state=s_ref, **kw_t, topk=K)
        before = SSEState(s.shared.clone(), s.parts.clone())
        o, s2 = sse_decode_step(**step, state=s, **kw_t, topk=K, inplace=inplace)
        assert (s2 is s) == inplace
        if not inplace:
            assert torch.equal(s.shared, before.shared) and torch.equal(s.parts, before.parts)
        s = s2
        assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
        assert rel_err(o, o_ref) <= TOL[F64]
        assert rel_err(s.shared, s_ref.shared) <= TOL[F64]
        assert rel_err(s.parts, s_ref.parts) <= TOL[F64]
        assert torch.equal(s.parts[~step["sel"][:, 0]], before.parts[~step["sel"][:, 0]])
    if inplace:
        return
    step = {n: a[:, :1].clone().requires_grad_(n in GRAD_NAMES) for n, a in x.items()}
    kw_0 = dict(kw, beta=None if kw["beta"] is None else kw["beta"][:, :1])
    gen = torch.Generator().manual_seed(2)
    outs = [sse_recurrent(**step, state=state, **kw_0, topk=K), sse_decode_step(**step, state=state, **kw_0, topk=K)]
    w = [torch.randn(t.shape, generator=gen, dtype=F64) for t in (outs[0][0], state.shared, state.parts)]
    grads = [torch.autograd.grad((o * w[0]).sum() + (s.shared * w[1]).sum() + (s.parts * w[2]).sum(),
                                 [step[n] for n in GRAD_NAMES]) for o, s in outs]
    for name, a, b in zip(GRAD_NAMES, grads[1], grads[0], strict=True):
        assert b.abs().max() > 0, name
        assert rel_err(a, b) <= TOL[F64], name


def test_dispatch_takes_the_decode_step(monkeypatch):
    """The torch path runs `sse_decode_step` for one token and the varlen form for more."""
    import subquadratic.kernels.sse as sse

    calls = []
    real = sse.sse_decode_step
    monkeypatch.setattr(sse, "sse_decode_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, kw, state = sse_inputs(1, 3, 2, 8, 6, 4, 1, "gla", seed=9)
    sse_attention(**{n: a[:, :1] for n, a in x.items()}, state=state, **kw, backend="torch", topk=1)
    assert calls == [1]
    sse_attention(**x, state=state, **kw, backend="torch", topk=1)
    assert calls == [1]


def test_sse_fp32_forms_agree():
    x, kw, state = sse_inputs(2, 100, 2, 16, 8, 4, 2, "gla", dtype=F32, seed=6)
    state = SSEState(state.shared.float(), state.parts.float())
    o_ref, s_ref = sse_recurrent(**x, state=state, **kw)
    for fn in (sse_masked, sse_varlen):
        o, s = fn(**x, state=state, **kw)
        assert o.dtype == F32 and s.parts.dtype == F32
        assert rel_err(o, o_ref) <= TOL[F32] and rel_err(s.parts, s_ref.parts) <= TOL[F32]


@pytest.mark.parametrize("inplace", [False, True])
def test_bf16_inputs_give_bf16_outputs_fp32_states(inplace):
    x, kw, state = sse_inputs(1, 5, 2, 8, 8, 4, 1, "gla", dtype=F32, seed=7)
    x = {k: t.to(torch.bfloat16) if t.is_floating_point() and k != "probs" else t for k, t in x.items()}
    state = SSEState(state.shared.float(), state.parts.float())
    fresh = SSEState(state.shared.clone(), state.parts.clone())  # inplace=True writes into its state
    outs = [sse_recurrent(**x, state=fresh, inplace=inplace, **kw), sse_masked(**x, state=state, **kw),
            sse_varlen(**x, state=state, **kw)]
    for o, s in outs:
        assert o.dtype == torch.bfloat16 and s.shared.dtype == F32 and s.parts.dtype == F32
    assert rel_err(outs[1][0].float(), outs[0][0].float()) <= 1e-2


def test_bad_base_and_missing_beta():
    x, _, state = sse_inputs(1, 3, 1, 4, 4, 4, 1, "gdn", seed=8)
    with pytest.raises(ValueError, match="supported: gla, gdn"):
        sse_recurrent(**x, state=state, base="mamba")
    with pytest.raises(ValueError, match="needs beta"):
        sse_masked(**x, state=state, base="gdn")


# --------------------------------------------------------------------------- router and aux loss


def test_router_topk():
    gen = torch.Generator().manual_seed(11)
    # distinct values (exact in bf16): a tie at the K-th place would make the top-k set ambiguous
    logits = (torch.stack([torch.randperm(8, generator=gen) for _ in range(18)]).view(2, 9, 8) * 0.25).bfloat16()
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :3] = False
    probs, sel = router_topk(logits, 2, valid)
    assert probs.dtype == F32 and sel.dtype == torch.bool
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 9))
    assert (sel.sum(-1) == 2 * valid).all()
    top = probs.topk(2, -1).values[..., -1:]
    assert ((probs >= top) == sel)[valid].all()


def aux_loss_by_definition(probs, sel, valid):
    """(N / max(K, 1)) sum_i mean_t(p^i_t) mean_t(1[i in T_t]) over the valid tokens, term by term."""
    N = probs.shape[-1]
    p, s = probs[valid], sel[valid].to(probs.dtype)
    if p.shape[0] == 0:
        return probs.sum() * 0.0
    K = s.sum(-1).mean()
    return N / K.clamp(min=1) * (p.mean(0) * s.mean(0)).sum()


@pytest.mark.parametrize("seed", range(3))
def test_aux_loss_values_and_gradients_by_definition(seed):
    """On random routings (padding, tokens with fewer selections than K, a batch without valid tokens):
    the definition's value and probability gradients, fp64."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(3, 7, 5, generator=g, dtype=torch.float64), -1).requires_grad_()
    sel = torch.rand(3, 7, 5, generator=g) < 0.4
    valid = torch.rand(3, 7, generator=g) < 0.7
    for v in (valid, torch.zeros_like(valid)):
        got = sse_aux_loss(probs, sel, v)
        want = aux_loss_by_definition(probs, sel, v)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        ga, = torch.autograd.grad(got, probs)
        gb, = torch.autograd.grad(want, probs)
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12)


def test_aux_loss_by_hand():
    # N = 2, K = 1, three valid tokens and one padding token (ignored)
    probs = torch.tensor([[[0.7, 0.3], [0.6, 0.4], [0.4, 0.6], [0.1, 0.9]]])
    sel = torch.tensor([[[True, False], [True, False], [False, True], [False, False]]])
    valid = torch.tensor([[True, True, True, False]])
    # mean p = (1.7/3, 1.3/3), fraction selected = (2/3, 1/3)
    expected = 2 / 1 * (1.7 / 3 * 2 / 3 + 1.3 / 3 * 1 / 3)
    assert sse_aux_loss(probs, sel, valid).item() == pytest.approx(expected, rel=1e-6)
    assert sse_aux_loss(probs, sel).item() == pytest.approx(expected, rel=1e-6)  # default: sel.any
    # uniform routing gives 1; N = 4, K = 2 by the definition
    p = torch.full((1, 4, 4), 0.25)
    s = torch.tensor([[[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 1, 0], [0, 1, 0, 1]]], dtype=torch.bool)
    assert sse_aux_loss(p, s).item() == pytest.approx(1.0)
