"""The window branch's lean decode steps: the steady step (`window.WindowBranch.steady_window_step`:
once W + sinks real tokens are cached, a one-token step writes its ring slot in place and attends over
the sinks and the whole ring without a mask) and a static cache's step (`static_window_step`: the
positions on the device, as a captured step runs). Each must give the masked path's values (fp64) and
the full forward's logits, and leave the ring as the masked path leaves it."""

from __future__ import annotations

import pytest
import torch

from subquadratic.modeling import window as window_module
from subquadratic.modeling.base import CACHE_FIELD

from .hla.test_modeling_hla import hla_window
from .sse.test_modeling_sse import lively


def sse_window(sinks: int):
    return lively("tiny-swa", 0, sse_window_merge="sum", sse_window_sinks=sinks).double().eval()


def sse_window_shared(sinks: int):
    """The window branch on the SSE layer's own q / k / v (`sse_window_qkv="shared"`)."""
    return lively("tiny-swa", 0, sse_window_merge="sum", sse_window_sinks=sinks, sse_kv_heads="source",
                  sse_window_qkv="shared").double().eval()


def hla_window_sinks(sinks: int):
    m = hla_window(0).double().eval()
    for layer in m.model.layers:
        layer.self_attn.swa.sinks = sinks
    return m


def on_kernel_device(m):
    """m in fp32 where a forced Triton kernel runs: the GPU where there is one (its dots in full fp32), else the
    CPU (the interpreter)."""
    m = m.float().to("cuda" if torch.cuda.is_available() else "cpu")
    m.config.kernel_precision = "ieee"
    return m


#: (model maker, sinks) of the step tests: SSE's window with and without sinks, on its own projections and
#: on the layer's (shared), and HLA's
STEP_CASES = [(sse_window, 0), (sse_window, 3), (sse_window_shared, 3), (hla_window_sinks, 2)]


def decode(m, ids, prefill: int, mask=None, cache=None):
    """Prefill `prefill` tokens, then one token a step: the logits of every position and the cache
    (a growing one unless `cache` is given)."""
    with torch.no_grad():
        out = m(ids[:, :prefill], attention_mask=None if mask is None else mask[:, :prefill], use_cache=True,
                **({} if cache is None else {CACHE_FIELD: cache}))
        cache, logits = getattr(out, CACHE_FIELD), [out.logits]
        for t in range(prefill, ids.shape[1]):
            step = m(ids[:, t : t + 1], attention_mask=None if mask is None else mask[:, : t + 1],
                     **{CACHE_FIELD: cache})
            logits.append(step.logits)
    return torch.cat(logits, 1), cache


@pytest.mark.parametrize("make, sinks", STEP_CASES)
def test_steady_steps_equal_the_masked_path_and_the_forward(make, sinks, monkeypatch):
    m = make(sinks)
    W = m.model.layers[0].self_attn.window
    ids = torch.randint(3, 128, (2, W + sinks + 14), generator=torch.Generator().manual_seed(5))
    steps = []
    real = window_module.WindowBranch.steady_window_step
    monkeypatch.setattr(window_module.WindowBranch, "steady_window_step",
                        lambda self, *a: steps.append(a[2]) or real(self, *a))
    fast, fast_cache = decode(m, ids, prefill=5)
    window_layers = sum(1 for layer in m.model.layers if getattr(layer.self_attn, "window", 0))
    # the steps at positions W + sinks .. end take it (each window layer), the earlier ones do not
    assert sorted(set(steps)) == list(range(W + sinks, ids.shape[1]))
    assert len(steps) == window_layers * (ids.shape[1] - W - sinks)
    m.set_plan("window", path="ring")  # the masked path at every call
    masked, masked_cache = decode(m, ids, prefill=5)
    torch.testing.assert_close(fast, masked, rtol=0, atol=1e-12)
    with torch.no_grad():
        full = m(ids).logits
    torch.testing.assert_close(fast, full, rtol=0, atol=1e-10)
    for a, b in zip(fast_cache.layers, masked_cache.layers, strict=True):  # the same ring and sinks
        for name in window_module.WINDOW_FIELDS:
            if name in b.tensors:
                assert torch.equal(a.tensors[name], b.tensors[name]), name


def test_padding_or_gradients_keep_the_masked_path(monkeypatch):
    """A left-padded batch (positions differ per row, not known on the host) and a step with gradients
    (no in-place writes into tensors autograd may hold) run the masked path."""
    m = sse_window(2)
    W = m.model.layers[0].self_attn.window
    ids = torch.randint(3, 128, (2, W + 12), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    calls = []
    monkeypatch.setattr(window_module.WindowBranch, "steady_window_step", lambda *a: calls.append(1))
    decode(m, ids, prefill=W + 4, mask=mask)
    assert not calls
    out = m(ids[:, : W + 4], use_cache=True)
    m(ids[:, W + 4 : W + 5], **{CACHE_FIELD: getattr(out, CACHE_FIELD)})  # gradients on: no in-place step
    assert not calls


@pytest.mark.parametrize("make, sinks", [(sse_window, 3), (sse_window_shared, 2), (hla_window_sinks, 2)])
@pytest.mark.parametrize("prefill", [lambda W: 2, lambda W: W - 1, lambda W: W, lambda W: W + 5, lambda W: 2 * W + 3],
                         ids=["2", "W-1", "W", "W+5", "2W+3"])
@pytest.mark.parametrize("fill", ["torch", "triton"])
def test_a_fresh_prefill_fills_the_ring_as_the_masked_path_does(make, sinks, prefill, fill, monkeypatch):
    """A first call of real tokens attends over them as causal rows and fills the ring and the sinks
    (`FreshRing`, `kernels.window_attention.fresh_ring`: its PyTorch ops in fp64, and its Triton kernel,
    as CUDA runs it, in fp32): the same logits, before and after decode steps, and the same ring and
    sinks as the masked path (`WindowRing`), for prompts shorter than the sinks, around the window and
    past it."""
    m = make(sinks)
    if fill == "triton":
        pytest.importorskip("triton")
        m = on_kernel_device(m)
        real_fill = window_module.fresh_ring
        monkeypatch.setattr(window_module, "fresh_ring", lambda k, v, w, s, backend: real_fill(k, v, w, s, "triton"))
    W = m.model.layers[0].self_attn.window
    n = prefill(W)
    ids = torch.randint(3, 128, (2, n + 4), generator=torch.Generator().manual_seed(n)).to(m.device)
    fills = []
    real = window_module.FreshRing.update
    monkeypatch.setattr(window_module.FreshRing, "update", lambda self, *a: fills.append(1) or real(self, *a))
    fresh, fresh_cache = decode(m, ids, prefill=n)
    assert len(fills) == sum(1 for layer in m.model.layers if getattr(layer.self_attn, "window", 0))
    m.set_plan("window", path="ring")  # the masked path at every call
    masked, masked_cache = decode(m, ids, prefill=n)
    torch.testing.assert_close(fresh, masked, rtol=0, atol=1e-12 if fill == "torch" else 1e-4)
    for a, b in zip(fresh_cache.layers, masked_cache.layers, strict=True):
        for name in window_module.WINDOW_FIELDS:
            assert (name in a.tensors) == (name in b.tensors), name
            if name in b.tensors and fill == "torch":
                assert torch.equal(a.tensors[name], b.tensors[name]), name
            elif name in b.tensors:  # fp32: the two paths' hidden states differ by rounding after the first layer
                torch.testing.assert_close(a.tensors[name], b.tensors[name], rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("make, sinks", STEP_CASES)
@pytest.mark.parametrize("prefill", [1, 2, 6, 13], ids=["1", "2", "6", "13"])
def test_static_steps_equal_the_masked_path(make, sinks, prefill, monkeypatch):
    """A static cache's one-token steps take `static_window_step` (every window layer, every step) and
    give the masked path's logits, ring and sinks, on a left-padded batch whose rows start shorter than
    the sinks (the steps write the sinks), inside the window and past it."""
    m = make(sinks)
    W = m.model.layers[0].self_attn.window
    T = prefill + W + sinks + 6
    ids = torch.randint(3, 128, (2, T), generator=torch.Generator().manual_seed(prefill))
    mask = torch.ones_like(ids)
    mask[1, :1] = 0  # row 1 starts one token later
    steps = []
    real = window_module.WindowBranch.static_window_step
    monkeypatch.setattr(window_module.WindowBranch, "static_window_step",
                        lambda self, *a, **kw: steps.append(1) or real(self, *a, **kw))
    fast, fast_cache = decode(m, ids, prefill, mask, cache=m.new_cache(max_length=T))
    window_layers = sum(1 for layer in m.model.layers if getattr(layer.self_attn, "window", 0))
    assert len(steps) == window_layers * (T - prefill)
    m.set_plan("window", path="ring")  # the masked path at every call
    masked, masked_cache = decode(m, ids, prefill, mask, cache=m.new_cache(max_length=T))
    real_rows = mask[:, :, None].bool()
    torch.testing.assert_close(fast * real_rows, masked * real_rows, rtol=0, atol=1e-12)
    growing, _ = decode(m, ids, prefill, mask)
    torch.testing.assert_close(fast * real_rows, growing * real_rows, rtol=0, atol=1e-10)
    for a, b in zip(fast_cache.layers, masked_cache.layers, strict=True):
        for name in window_module.WINDOW_FIELDS:
            assert (name in a.tensors) == (name in b.tensors), name
            if name in b.tensors:
                assert torch.equal(a.tensors[name], b.tensors[name]), name


@pytest.mark.parametrize("make, sinks", [(sse_window, 3), (hla_window_sinks, 2)])
def test_static_steps_on_the_kernel_equal_the_masked_path(make, sinks, monkeypatch):
    """The same steps with the window step on its Triton kernel (as on CUDA; here forced by the window's
    plan, `step_kernel`, on a GPU or under the interpreter), fp32: the masked path's logits, ring and sinks,
    one launch a layer a step."""
    pytest.importorskip("triton")
    from subquadratic.kernels import triton_window

    m = on_kernel_device(make(sinks))
    W = m.model.layers[0].self_attn.window
    T = 2 + W + sinks + 6
    ids = torch.randint(3, 128, (2, T), generator=torch.Generator().manual_seed(1)).to(m.device)
    mask = torch.ones_like(ids)
    mask[1, :1] = 0
    launches = []
    real = triton_window.window_step_triton
    monkeypatch.setattr(triton_window, "window_step_triton", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    m.set_plan("window", step_kernel=True)
    # eager steps: on a GPU a captured step would replay its launches without calling the wrapper again
    fast, fast_cache = decode(m, ids, 2, mask, cache=m.new_cache(max_length=T, cuda_graph=False))
    window_layers = sum(1 for layer in m.model.layers if getattr(layer.self_attn, "window", 0))
    assert len(launches) == window_layers * (T - 2)
    m.set_plan("window", path="ring")  # the masked path at every call
    masked, masked_cache = decode(m, ids, 2, mask, cache=m.new_cache(max_length=T, cuda_graph=False))
    real_rows = mask[:, :, None].bool()
    torch.testing.assert_close(fast * real_rows, masked * real_rows, rtol=0, atol=2e-5)
    for a, b in zip(fast_cache.layers, masked_cache.layers, strict=True):  # a later layer's keys: rounding apart
        for name in window_module.WINDOW_FIELDS:
            if name in b.tensors:
                torch.testing.assert_close(a.tensors[name], b.tensors[name], rtol=0, atol=2e-5, msg=name)


#: (plan_window's keywords over STEP, the path): STEP is a steady one-token step past the window and sinks,
#: 4 query heads over 2 key / value heads of dim 16, fp32 on the CPU
STEP = dict(T=1, cached=True, whole=False, length=20, causal=True, weights=False, grad=False, sdpa=True, window=8,
            sinks=2, ring=True, sink_ring=True, heads=(4, 2, 16), dtype=torch.float32, device="cpu", backend="auto")
WINDOW_PLANS = [
    ({}, "steady"),
    (dict(cached=False, T=7), "rows"),
    (dict(length=10), "ring"),  # not past W + sinks: some slot may be out of view
    (dict(length=None, causal=False), "ring"),  # a padded batch: the count is not known on the host
    (dict(length=None, causal=False, whole=True), "static"),
    (dict(length=10, whole=True), "static"),
    (dict(grad=True), "ring"),
    (dict(weights=True), "ring"),
    (dict(sdpa=False), "ring"),
    (dict(sink_ring=False), "ring"),
    (dict(sinks=0, sink_ring=False), "steady"),
    (dict(T=5, length=5, ring=False, sink_ring=False), "fresh"),  # a first call of real tokens
    (dict(T=5, length=5), "ring"),  # the ring made already
    (dict(T=5, length=None, causal=False, ring=False, sink_ring=False), "ring"),
    (dict(path="ring"), "ring"),  # a caller's path
]


@pytest.mark.parametrize("given,want", WINDOW_PLANS)
def test_the_window_path_of_each_call(given, want):
    kw = {**STEP, **given}
    assert window_module.plan_window(kw.pop("T"), **kw).path == want


#: a static cache's one-token step (the positions on the device) and a first call of real tokens
STATIC = dict(length=None, causal=False, whole=True)
FRESH = dict(T=5, length=5, ring=False, sink_ring=False)
#: (plan_window's keywords over STEP, (path, step_kernel, ring_kernel), whether the row plans for a CUDA
#: device with Triton installed): where the step and the ring fill take their Triton kernels
WINDOW_KERNELS = [
    (STATIC, ("static", False, False), False),  # the CPU: the PyTorch forms
    ({**STATIC, "device": "cuda"}, ("static", True, False), True),
    ({**STATIC, "device": "cuda", "dtype": torch.bfloat16}, ("static", True, False), True),
    ({**STATIC, "device": "cuda", "backend": "torch"}, ("static", False, False), False),
    ({**STATIC, "device": "cuda", "backend": "naive"}, ("static", False, False), False),
    ({**STATIC, "device": "cuda", "dtype": torch.float64}, ("static", False, False), False),  # not a kernel dtype
    ({**STATIC, "device": "cuda", "heads": (4, 3, 16)}, ("static", False, False), False),  # 3 KV heads for 4
    ({**STATIC, "device": "cuda", "heads": (4, 2, 512)}, ("static", False, False), False),  # head dim over 256
    ({**STATIC, "device": "cuda", "sinks": 65}, ("static", False, False), False),  # sinks over one key tile
    ({**STATIC, "step_kernel": True}, ("static", True, False), False),  # a caller's, as it is (the interpreter)
    ({**STATIC, "device": "cuda", "step_kernel": False}, ("static", False, False), False),
    ({"device": "cuda"}, ("steady", False, False), False),  # the steady step has no kernel
    ({"step_kernel": True, "ring_kernel": True}, ("steady", False, False), False),  # taken on their path only
    (FRESH, ("fresh", False, False), False),
    ({**FRESH, "device": "cuda"}, ("fresh", False, True), True),
    ({**FRESH, "device": "cuda", "backend": "triton"}, ("fresh", False, True), True),
    ({**FRESH, "device": "cuda", "backend": "torch"}, ("fresh", False, False), False),
    ({**FRESH, "device": "cuda", "dtype": torch.float64}, ("fresh", False, False), False),
    ({**FRESH, "ring_kernel": True}, ("fresh", False, True), False),
    ({**FRESH, "device": "cuda", "path": "ring"}, ("ring", False, False), False),  # a caller's path
]


@pytest.mark.parametrize("given,want,needs_triton", WINDOW_KERNELS)
def test_the_window_kernels_of_each_call(given, want, needs_triton):
    from subquadratic.kernels.utils import triton_available

    if needs_triton and not triton_available():
        pytest.skip("plans the Triton kernels only where Triton is installed")
    kw = {**STEP, **given}
    plan = window_module.plan_window(kw.pop("T"), **kw)
    assert (plan.path, plan.step_kernel, plan.ring_kernel) == want


def test_a_bad_window_plan_is_refused():
    with pytest.raises(ValueError, match="window path"):
        window_module.plan_window(**{**STEP, "path": "fast"})
    with pytest.raises(ValueError, match="window path"):
        window_module.WindowPlan("fast")
    with pytest.raises(ValueError, match="step_kernel is a 'static' path's"):
        window_module.WindowPlan("steady", step_kernel=True)
    with pytest.raises(ValueError, match="ring_kernel"):
        window_module.WindowPlan("static", ring_kernel=True)
    kw = {**STEP, **STATIC, "backend": "triton"}  # the kernel asked for on the CPU: one line saying what it needs
    with pytest.raises(ValueError, match="needs a CUDA device"):
        window_module.plan_window(kw.pop("T"), **kw)


def test_the_window_plans_once_per_forward(monkeypatch):
    """Every window branch of a forward takes one plan, made once (each call of a decode loop plans anew)."""
    m = sse_window(2)
    made, real = [], window_module.plan_window
    monkeypatch.setattr(window_module, "plan_window", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    window_layers = sum(1 for layer in m.model.layers if getattr(layer.self_attn, "window", 0))
    assert window_layers >= 2
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    decode(m, ids, prefill=20)
    assert [plan.path for plan in made] == ["fresh"] + ["steady"] * 10
