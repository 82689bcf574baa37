"""SPLA models: the shared model checks on a sparse configuration, and a long cached decode (five times
the budget, with and without the residual term) whose running block statistics equal a recomputation."""

from __future__ import annotations

import pytest
import torch

from subquadratic.kernels.spla import BlockStats
from subquadratic.modeling.base import CACHE_FIELD

from ..common import ModelTester, ModelTesterMixin
from .tiny import tiny_spla


def cache_of(out):
    return getattr(out, CACHE_FIELD)


@pytest.mark.parametrize("use_rla", [True, False])
def test_prefill_then_decode_equals_full_forward(use_rla):
    model = tiny_spla(use_rla=use_rla)  # budget 4 blocks x 8 = 32 tokens; context 5x that
    x = torch.randint(1, 128, (2, 160))
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :57], use_cache=True)
        steps, cache = [out.logits], cache_of(out)
        for t in range(57, 160):
            out = model(x[:, t:t + 1], use_cache=True, **{CACHE_FIELD: cache})
            steps.append(out.logits)
    inc = torch.cat(steps, dim=1)
    assert (inc - full).abs().max() < 1e-4
    # block sums and Sbar were kept incrementally: they equal a recomputation from the cached keys
    layer = cache.layers[0]
    k = layer.state["k"]
    fresh = BlockStats.empty(2, k.shape[1], k.shape[3], "cpu").add(k.transpose(1, 2), torch.arange(160).expand(2, 160),
                                                                   8)
    assert torch.allclose(layer.state["sum_k"], fresh.sum_k, atol=1e-4)
    assert torch.allclose(layer.state["count"], fresh.count)



def grad_and_cached_decode(model, x, split: int):
    """(logits of the full forward with grad enabled and its cache, logits of a no-grad prefill of
    x[:, :split] then one-token steps to the end, that cache)."""
    with torch.enable_grad():
        out_ref = model(x, use_cache=True)
        ref, cache_ref = out_ref.logits.detach(), cache_of(out_ref)
    with torch.no_grad():
        out = model(x[:, :split], use_cache=True)
        steps, cache = [out.logits], cache_of(out)
        for t in range(split, x.shape[1]):
            out = model(x[:, t:t + 1], use_cache=True, **{CACHE_FIELD: cache})
            steps.append(out.logits)
    return ref, cache_ref, torch.cat(steps, dim=1), cache


def test_zero_gamma_skips_the_residual_term_exactly(monkeypatch):
    """A converted model (gamma = 0): inference does not compute the residual term (the
    shortcut of `SPLAAttention.forward`), yet gives the logits of the forward that computes it (grad
    enabled) and keeps the same Sbar in its cache, prefill past the budget and decode steps alike."""
    model = tiny_spla(gamma=None)
    assert not any(p.any() for n, p in model.named_parameters() if "rla_norm" in n)
    x = torch.randint(1, 128, (2, 70))
    from subquadratic.families.spla import modeling

    seen = []
    real = modeling.spla_attention
    monkeypatch.setattr(modeling, "spla_attention", lambda *a, **kw: seen.append(a[7].use_rla) or real(*a, **kw))
    ref, cache_ref, steps, cache = grad_and_cached_decode(model, x, 50)
    n = len(cache.layers)
    assert seen[:n] == [True] * n and set(seen[n:]) == {False}     # computed with grad, skipped without
    assert (steps - ref).abs().max() < 1e-4
    for a, b in zip(cache.layers, cache_ref.layers, strict=True):
        assert torch.allclose(a.state["sbar"], b.state["sbar"].detach(), atol=1e-4)


def test_zero_gamma_check_follows_in_place_writes(monkeypatch):
    """The gamma = 0 shortcut is decided once per value of gamma: an in-place write (an optimizer
    step) or `load_state_dict` makes the next no-grad call read gamma again and compute the residual
    term, with the logits of the forward that always computes it."""
    model = tiny_spla(gamma=None)
    x = torch.randint(1, 128, (2, 70))
    from subquadratic.families.spla import modeling

    seen = []
    real = modeling.spla_attention
    monkeypatch.setattr(modeling, "spla_attention", lambda *a, **kw: seen.append(a[7].use_rla) or real(*a, **kw))
    layers = [m for m in model.modules() if isinstance(m, modeling.SPLAAttention)]
    with torch.no_grad():
        model(x)
        assert set(seen) == {False} and all(m.gamma_is_zero() for m in layers)
        seen.clear()
        layers[0].rla_norm.weight.add_(0.5)            # in place, as an optimizer step writes it
        out = model(x).logits
    assert seen[0] is True and set(seen[1:]) == {False}
    with torch.enable_grad():
        ref = model(x).logits.detach()
    assert (out - ref).abs().max() < 1e-5
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for n in state:
        if "rla_norm" in n:
            state[n].fill_(0.25)
    model.load_state_dict(state)
    seen.clear()
    with torch.no_grad():
        model(x)
    assert seen == [True] * len(layers)


def test_zero_gamma_shortcut_is_off_while_a_decode_step_is_recorded(monkeypatch):
    """While a captured decode step warms up and records (the plan settings its capture passes,
    `fused.captured_step`: the fused plan's `recorded`, fused chains or not), a converted model computes its
    residual term: the warm-up then compiles what the recording runs, and the graph stays right for any
    later gamma; outside, the shortcut holds."""
    from subquadratic.families.spla import modeling
    from subquadratic.modeling import fused

    model = tiny_spla(gamma=None)
    x = torch.randint(1, 128, (2, 70))
    seen = []
    real = modeling.spla_attention
    monkeypatch.setattr(modeling, "spla_attention", lambda *a, **kw: seen.append(a[7].use_rla) or real(*a, **kw))
    for fuse in (True, False):  # with the fused chains (compiled on the GPU) or not
        plan = fused.plan_fused(torch.float32, "cpu", **fused.captured_step(fuse)["fused"])
        assert plan.recorded and plan.compiled == fuse
    assert not fused.plan_fused(torch.float32, "cpu").recorded
    with torch.no_grad():
        model.model(x, plan_settings=fused.captured_step(False))  # as `decode_logits` calls it
        assert set(seen) == {True}
        seen.clear()
        model(x)
        assert set(seen) == {False}


def decode_run(model, x, split: int, eager: bool, reorder_at: int | None = None):
    """Logits per call of a no-grad prefill of x[:, :split] then one-token steps, and the cache; `eager`:
    every call updates the block sums and sbar (the deferral of `SPLALayer.update` turned off);
    `reorder_at`: the rows swapped (beam search's `reorder_cache`) before that step."""
    from subquadratic.families.spla import modeling

    real = modeling.SPLALayer.update
    patch = pytest.MonkeyPatch()
    if eager:
        patch.setattr(modeling.SPLALayer, "update", lambda self, *a, defer_within=None, **kw: real(self, *a, **kw))
    try:
        with torch.no_grad():
            out = model(x[:, :split], use_cache=True)
            steps, cache = [out.logits], cache_of(out)
            for t in range(split, x.shape[1]):
                if t == reorder_at:
                    cache.reorder_cache(torch.tensor([1, 0]))
                    x = x.flip(0)
                out = model(x[:, t:t + 1], use_cache=True, **{CACHE_FIELD: cache})
                steps.append(out.logits)
    finally:
        patch.undo()
    return steps, cache


@pytest.mark.parametrize("gamma", [None, 1.0])
def test_inside_the_budget_the_state_waits_and_later_tokens_see_the_same(gamma):
    """A growing cache inside the budget (32 tokens here) updates neither the block sums nor Sbar: the
    logits there are bitwise those of the eager updates, the deferred tokens are folded in by the first
    step past the budget, and from there the logits (gamma = 0: the residual term skipped; gamma != 0: it
    reads Sbar) and the state equal the eager run's. A reorder while deferred reorders what waits."""
    model = tiny_spla(gamma=gamma)
    x = torch.randint(1, 128, (2, 70))
    for reorder_at in (None, 25):
        lazy, cache = decode_run(model, x, 10, eager=False, reorder_at=reorder_at)
        eager, cache_eager = decode_run(model, x, 10, eager=True, reorder_at=reorder_at)
        inside = 32 - 10 + 1  # the prefill and the steps up to 32 slots
        for a, b in zip(lazy[:inside], eager[:inside], strict=True):
            assert torch.equal(a, b)
        assert (torch.cat(lazy[inside:], 1) - torch.cat(eager[inside:], 1)).abs().max() < 1e-5
        for a, b in zip(cache.layers, cache_eager.layers, strict=True):
            assert a.folded == 70 and not a.pending
            for name in ("sbar", "sum_k", "sum_k2", "count"):
                torch.testing.assert_close(a.state[name], b.state[name], rtol=1e-5, atol=1e-5)


def test_inside_the_budget_reading_the_state_folds_it():
    """While deferred, `state` and `nbytes` fold the waiting tokens first: Sbar and the block sums are
    those of a recomputation from the cached keys and values, and the next step goes on from there."""
    from subquadratic.kernels.spla.dense import fold_state

    model = tiny_spla(gamma=1.0)
    x = torch.randint(1, 128, (2, 20))
    with torch.no_grad():
        cache = cache_of(model(x[:, :12], use_cache=True))
        model(x[:, 12:13], use_cache=True, **{CACHE_FIELD: cache})
    layer = cache.layers[0]
    assert layer.folded == 0 and len(layer.pending) == 2
    nbytes = cache.layers[1].nbytes()
    assert cache.layers[1].folded == 13 and nbytes == cache.layers[1].nbytes()
    k, v = layer.buffers["k"].view().transpose(1, 2), layer.buffers["v"].view().transpose(1, 2)
    pos = torch.arange(13).expand(2, 13)
    state = layer.state
    assert layer.folded == 13 and not layer.pending
    torch.testing.assert_close(state["sbar"], fold_state(torch.zeros_like(state["sbar"]), k, v, pos))
    fresh = BlockStats.empty(2, k.shape[2], k.shape[3], "cpu", num_blocks=2).add_(k, pos, 8)
    torch.testing.assert_close(state["sum_k"], fresh.sum_k)
    torch.testing.assert_close(state["count"], fresh.count)


class TestSPLASparse(ModelTesterMixin):
    """Budget 3 blocks x 4 = 12 tokens (sink, most recent, one chosen by score) under 40-token inputs:
    the selection and the residual linear term both shape every check."""

    tester = ModelTester("spla-sparse", lambda seed: tiny_spla(seed, block_size=4, top_k_blocks=3, num_sink_blocks=1,
                                                               num_local_blocks=1), seq_len=40)


@pytest.mark.gpu
def test_zero_gamma_shortcut_on_gpu_equals_the_residual_forward():
    """On CUDA (the Triton prefill and decode kernels), a converted model's no-grad forward skips the
    residual term and gives the logits of the forward that computes it (grad enabled), prefill past
    the budget and decode steps alike, with the same Sbar in the cache."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = tiny_spla(gamma=None, block_size=16, top_k_blocks=3, num_sink_blocks=1, num_local_blocks=1,
                      kernel_precision="ieee").cuda()  # exact fp32 dots: the same selection on every path
    x = torch.randint(1, 128, (2, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ref, cache_ref, steps, cache = grad_and_cached_decode(model, x, 160)
    assert all(m.gamma_is_zero() for m in model.modules() if hasattr(m, "gamma_is_zero"))
    assert (steps - ref).abs().max() < 1e-3
    for a, b in zip(cache.layers, cache_ref.layers, strict=True):
        torch.testing.assert_close(a.state["sbar"], b.state["sbar"].detach(), rtol=1e-4, atol=1e-4)


def test_zero_gamma_params_follow_a_config_change(monkeypatch):
    """The layer keeps its hyper-parameters without the residual term between calls; a changed
    config (here the budget) reaches the next call, with the residual term still skipped."""
    model = tiny_spla(gamma=None)
    x = torch.randint(1, 128, (2, 70))
    from subquadratic.families.spla import modeling

    seen = []
    real = modeling.spla_attention
    monkeypatch.setattr(modeling, "spla_attention", lambda *a, **kw: seen.append(a[7]) or real(*a, **kw))
    with torch.no_grad():
        model(x)
        first = {p.top_k_blocks for p in seen}
        seen.clear()
        model.config.top_k_blocks += 1                 # the config every layer reads
        model(x)
    assert len(first) == 1 and {p.top_k_blocks for p in seen} == {first.pop() + 1}
    assert not any(p.use_rla for p in seen)


def test_an_adapted_model_adds_its_residual_term_in_the_kernels_combine(monkeypatch):
    """Without gradients an adapted model (gamma != 0) on the block-major kernels gets o + RMSNorm_gamma(o_rla)
    from the sparse kernels' combine by default (`SPLAPlan.fuse_norm`, `RLAEpilogue`: the op returns o_rla None,
    no norm-add after), with the PyTorch form's logits; with `fuse_norm=False`, or with gradients, the op
    returns o_rla and the mixer adds the norm. The kernels run on the GPU where there is one (exact fp32 dots),
    else in the interpreter."""
    pytest.importorskip("triton")
    import subquadratic.kernels.spla.triton_parallel as tp

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_spla(block_size=16, top_k_blocks=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      kernel_precision="ieee")
    gen = torch.Generator().manual_seed(5)
    for m in model.modules():
        if hasattr(m, "rla_norm"):
            m.rla_norm.weight.data = 0.5 + torch.rand(m.rla_norm.weight.shape, generator=gen)
    x = torch.randint(1, 128, (2, 80), generator=gen).to(dev)
    model.to(dev)
    returned = []
    real_kernel = tp.spla_parallel_triton

    def kernel(*a, **kw):
        out = real_kernel(*a, **kw)
        returned.append(out[1] is None)
        return out

    monkeypatch.setattr(tp, "spla_parallel_triton", kernel)
    with torch.no_grad():
        model.set_plan("spla", path="torch")
        want = model(x).logits  # the PyTorch form
        model.set_plan("spla", device="cuda", form="blocks", fuse_norm=False)
        unfused = model(x).logits
        assert returned == [False] * model.config.num_hidden_layers
        returned.clear()
        model.set_plan("spla", device="cuda", form="blocks")
        got = model(x).logits
    assert returned == [True] * model.config.num_hidden_layers
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    torch.testing.assert_close(got, unfused, atol=2e-4, rtol=0)
    returned.clear()
    loss = model(x).logits.float().square().mean()
    loss.backward()
    assert returned == [False] * model.config.num_hidden_layers
    assert all(m.rla_norm.weight.grad is not None for m in model.modules() if hasattr(m, "rla_norm"))


def test_set_plan_spla_takes_the_caller_fields(monkeypatch):
    """`set_plan("spla", ...)` plans SPLA's calls with the caller's fields, once per forward for the layers
    that plan alike: device="cuda" takes the Triton kernels on this machine (the interpreter on a CPU) with
    the PyTorch form's logits, path="torch" the PyTorch form; no fields: the model plans itself again. An
    unknown field is refused by the planner."""
    pytest.importorskip("triton")
    import subquadratic.kernels.spla.plan as spla_plan
    import subquadratic.kernels.spla.triton_parallel as tp

    model = tiny_spla(block_size=16, top_k_blocks=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    x = torch.randint(1, 128, (2, 80), generator=torch.Generator().manual_seed(3))
    plans, kernels = [], []
    real_plan, real_kernel = spla_plan.plan_spla, tp.spla_parallel_triton
    monkeypatch.setattr("subquadratic.families.spla.modeling.plan_spla",
                        lambda *a, **kw: plans.append(kw) or real_plan(*a, **kw))
    monkeypatch.setattr(tp, "spla_parallel_triton", lambda *a, **kw: kernels.append(1) or real_kernel(*a, **kw))
    with torch.no_grad():
        want = model(x).logits  # CPU: the PyTorch form, no settings: nothing planned by the model
        assert plans == [] and kernels == []
        model.set_plan("spla", device="cuda")
        got = model(x).logits
        assert len(plans) == 1 and plans[0]["device"] == "cuda"  # one plan for both layers
        assert len(kernels) == model.config.num_hidden_layers
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
        model.set_plan("spla", path="torch")
        assert torch.equal(model(x).logits, want) and len(kernels) == model.config.num_hidden_layers
        model.set_plan("spla")
        assert torch.equal(model(x).logits, want) and len(plans) == 2
        model.set_plan("spla", form="wide")
        with pytest.raises(ValueError, match="form"):
            model(x)
