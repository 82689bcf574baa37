"""The cheaper launch path (`kernels.triton_launch`): which calls reuse a compiled kernel (the same
specialisation Triton would pick) and which go through Triton's own path, the values the launcher gets
(Triton's binder's: every parameter in order, defaults filled), the autotuner's cached choice under the
installed Triton's own key; on CUDA, a real kernel's results through both paths."""

from __future__ import annotations

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from subquadratic.kernels import triton_launch as L  # noqa: E402


def body(x, n, s, BLOCK: tl.constexpr, flag=True, y=None, MODE: tl.constexpr = "a"):
    pass


class Compiled:
    """A compiled kernel's launch interface: records what its launcher gets."""

    function, packed_metadata = "fn-handle", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, *a):
        self.launches.append(a)


class Kernel:
    """What FastRun reads of a JITFunction, with Triton's path recorded."""

    def __init__(self):
        self.signature = inspect.signature(body)
        self.arg_names = list(self.signature.parameters)
        self.constexprs = [i for i, n in enumerate(self.arg_names) if n in ("BLOCK", "MODE")]
        self.slow_calls = []
        self.compiled = []

    def run(self, *args, grid, warmup, **kwargs):
        self.slow_calls.append((args, grid, warmup, kwargs))
        self.compiled.append(Compiled())
        return self.compiled[-1]


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(L, "_device", lambda: 0)
    monkeypatch.setattr(L, "_stream", lambda dev: 1234 + dev)
    k = Kernel()
    k.run = L.FastRun(k)
    with L.fast_launch(True):  # off under the interpreter
        yield k


def bound(*args, **kwargs) -> tuple:
    """The values Triton's binder hands the launcher: every parameter in order, defaults applied."""
    b = inspect.signature(body).bind(*args, **{k: v for k, v in kwargs.items() if k != "num_warps"})
    b.apply_defaults()
    return tuple(b.arguments.values())


def test_same_signature_launches_the_kept_kernel_with_the_binders_values(kernel):
    x, y = torch.zeros(64), torch.zeros(32, dtype=torch.float64)
    first = kernel.run(x, 7, 0.5, 64, grid=(3,), warmup=False, num_warps=4)
    assert len(kernel.slow_calls) == 1 and first is kernel.compiled[0]
    x2 = torch.ones(64)
    again = kernel.run(x2, 9, 2.5, 64, grid=(5, 2), warmup=False, num_warps=4)  # same specialisation
    assert again is first and len(kernel.slow_calls) == 1
    assert first.launches == [(5, 2, 1, 1234, "fn-handle", "metadata", None, None, None, *bound(x2, 9, 2.5, 64))]
    kernel.run(x2, 9, 2.5, 64, y=y, flag=False, grid=(1, 1, 8), warmup=False, num_warps=4)  # new kwargs: new key
    assert len(kernel.slow_calls) == 2
    kernel.run(x, 3, 1.5, 64, y=y, flag=True, grid=(2, 1, 8), warmup=False, num_warps=4)
    assert len(kernel.slow_calls) == 2
    assert kernel.compiled[1].launches[-1][:9] == (2, 1, 8, 1234, "fn-handle", "metadata", None, None, None)
    assert kernel.compiled[1].launches[-1][9:] == bound(x, 3, 1.5, 64, y=y, flag=True)


@pytest.mark.parametrize("change", ["dtype", "misaligned", "int_one", "int_16", "int_64bit", "constexpr",
                                    "constexpr_type", "option", "constexpr_kwarg", "device"])
def test_a_new_specialisation_goes_through_triton(kernel, change, monkeypatch):
    base = torch.zeros(64)
    args, kw = [base, 7, 0.5, 64], dict(num_warps=4)
    kernel.run(*args, grid=(1,), warmup=False, **kw)
    if change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "misaligned":
        args[0] = base[1:]  # 4 bytes past an aligned address
    elif change == "int_one":
        args[1] = 1
    elif change == "int_16":
        args[1] = 32
    elif change == "int_64bit":
        args[1] = 2 ** 40 + 7
    elif change == "constexpr":
        args[3] = 128
    elif change == "constexpr_type":
        args[3] = 64.0
    elif change == "option":
        kw["num_warps"] = 8
    elif change == "constexpr_kwarg":
        kw["MODE"] = "b"
    else:
        monkeypatch.setattr(L, "_device", lambda: 1)
    kernel.run(*args, grid=(1,), warmup=False, **kw)
    assert len(kernel.slow_calls) == 2 and kernel.compiled[0].launches == []
    kernel.run(*args, grid=(1,), warmup=False, **kw)  # and that one is kept in turn
    assert len(kernel.slow_calls) == 2 and len(kernel.compiled[1].launches) == 1


def test_calls_the_key_does_not_model_go_through_triton(kernel, monkeypatch):
    x = torch.zeros(64)
    for _ in range(2):
        kernel.run(x, (1, 2), 0.5, 64, grid=(1,), warmup=False)  # a tuple argument
        kernel.run(x, 7, 0.5, 64, grid=lambda meta: (1,), warmup=False)  # a callable grid
        kernel.run(x, 7, 0.5, 64, grid=(1,), warmup=True)
        kernel.run(x, 7, 0.5, [64], grid=(1,), warmup=False)  # an unhashable constexpr
    assert len(kernel.slow_calls) == 8
    monkeypatch.setattr(L, "_hooks", lambda: True)
    kernel.run(x, 9, 0.5, 64, grid=(1,), warmup=False)
    kernel.run(x, 9, 0.5, 64, grid=(1,), warmup=False)
    assert len(kernel.slow_calls) == 10
    monkeypatch.setattr(L, "_hooks", lambda: False)
    with L.fast_launch(False):  # switched off at run time
        kernel.run(x, 9, 0.5, 64, grid=(1,), warmup=False)
    assert len(kernel.slow_calls) == 11


def test_hooks_are_seen_in_either_form(monkeypatch):
    assert not L._hooks()  # none set in the test session
    rt = triton.knobs.runtime
    hook = rt.launch_enter_hook
    if hasattr(hook, "add"):  # Triton >= 3.7: a chain of hooks
        f = lambda *a: None  # noqa: E731
        hook.add(f)
        try:
            assert L._hooks()
        finally:
            hook.remove(f)
    else:
        monkeypatch.setattr(rt, "launch_enter_hook", lambda *a: None)
        assert L._hooks()
    assert not L._hooks()


def test_jit_is_tritons_own_under_the_interpreter():
    @L.jit
    def k(x):
        pass

    if L.ENABLED:
        assert isinstance(k.run, L.FastRun)
    else:
        assert not isinstance(getattr(k, "run", None), L.FastRun)


def test_tuned_returns_the_autotuners_own_cached_choice(monkeypatch):
    def fn(x, n, K, BK: tl.constexpr):
        pass

    jit = triton.jit(fn)
    configs = [triton.Config({"BK": 16}, num_warps=2), triton.Config({"BK": 32}, num_warps=4)]
    tuner = triton.autotune(configs, key=["n", "K"])(jit)
    launched = []
    monkeypatch.setattr(tuner, "_bench", lambda *a, config, **kw: 1.0 if config.kwargs["BK"] == 32 else 2.0)
    monkeypatch.setattr(jit, "run", lambda *a, **kw: launched.append(kw))
    with L.fast_launch(True):
        x = torch.zeros(8)
        assert L.tuned(tuner, (x, 5, 64), {}) is None  # nothing picked yet
        tuner.run(x, 5, 64, grid=(1,), warmup=False)  # the installed Triton's autotuner picks and keeps BK=32
        assert launched[-1]["BK"] == 32
        assert L.tuned(tuner, (x, 5, 64), {}) is configs[1]
        assert L.tuned(tuner, (x, 5), {"K": 64}) is configs[1]
        assert L.tuned(tuner, (x, 6, 64), {}) is None  # another key
        assert L.tuned(tuner, (x.half(), 5, 64), {}) is None  # another dtype
        monkeypatch.setattr(configs[1], "pre_hook", lambda nargs: None)
        assert L.tuned(tuner, (x, 5, 64), {}) is None
    with L.fast_launch(False):
        assert L.tuned(tuner, (x, 5, 64), {}) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not L.ENABLED, reason="needs CUDA and the compiled path")
def test_cuda_results_through_both_paths():
    @L.jit
    def axpy(X, Y, OUT, n, a, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(X + offs, mask=m)
        if SQUARE:
            x = x * x
        tl.store(OUT + offs, a * x + tl.load(Y + offs, mask=m), mask=m)

    g = torch.Generator(device="cuda").manual_seed(0)
    for n, dtype, shift, square in [(1000, torch.float32, 0, False), (1000, torch.float32, 0, False),
                                    (999, torch.float32, 1, False), (1024, torch.bfloat16, 0, True),
                                    (1, torch.float32, 0, False), (4096, torch.float32, 3, True),
                                    (1000, torch.float32, 0, False)]:
        x = torch.randn(n + shift, device="cuda", dtype=dtype, generator=g)[shift:]
        y = torch.randn(n + shift, device="cuda", dtype=dtype, generator=g)[shift:]
        o = torch.empty_like(x)
        axpy[(triton.cdiv(n, 256),)](x, y, o, n, 0.5, 256, SQUARE=square)
        want = 0.5 * (x.float() ** 2 if square else x.float()) + y.float()
        torch.testing.assert_close(o.float(), want, atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=1e-2)
    assert len(axpy.run.compiled) == 5  # distinct specialisations; the repeated ones reused theirs
