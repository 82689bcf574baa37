"""A cheaper launch path for the Triton kernels.

`kernel[grid](*args)` goes through Triton's `JITFunction.run` on every call: it binds the arguments,
specialises each one, builds and stringifies the options for the cache key, looks up the current device
and stream and the launch hooks, then calls the compiled kernel's launcher. On the GPU that costs tens of
microseconds of host time a launch, which a model forward of a thousand launches pays in full wherever the
host, not the GPU, bounds a call.

`jit` is `triton.jit` whose kernels keep, per argument signature, the compiled kernel Triton's own path
returned on the first call of that signature, and launch it directly on the next ones. The signature is at
least as fine as Triton's specialisation: a tensor's dtype and whether its address is 16-byte aligned, an
int's being 1, divisible by 16 and its width, the type of a bool or float, a constexpr's value and type,
the options passed by keyword. Anything else (a callable grid, a launch hook set, warm-up, an argument of
another type) takes Triton's path, as does the CPU interpreter, where `jit` is `triton.jit` itself.

`tuned` does the same for the autotuner: once a configuration was picked for an autotuning key, the
launch goes straight to the kernel with it (`launch` in triton_utils).
"""

from __future__ import annotations

import inspect
import os

import torch

from .utils import import_triton, scoped

triton, _ = import_triton()

#: Launch through Triton's own path always (SUBQUADRATIC_FAST_LAUNCH=0, or `fast_launch(False)` at run time),
#: e.g. to compare the two.
ENABLED = os.environ.get("TRITON_INTERPRET", "0") != "1" and os.environ.get("SUBQUADRATIC_FAST_LAUNCH", "1") != "0"


def fast_launch(enabled: bool):
    """Within the block the kernels launch through the kept compiled kernel (`enabled`) or Triton's own
    path (`ENABLED`): a benchmark's comparison of the two."""
    return scoped(globals(), "ENABLED", enabled)

_INT32 = (-(2 ** 31), 2 ** 31)


class _Unkeyed(Exception):
    """An argument whose specialisation the key does not model: the call takes Triton's path."""


def _signature(v):
    """What of a non-constexpr argument Triton specialises on (or something finer)."""
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() & 15 == 0
    t = type(v)
    if t is int:
        return v == 1, v & 15 == 0, _INT32[0] <= v < _INT32[1], v >= 2 ** 63
    if t is bool or t is float:
        return t
    if v is None:
        return None
    raise _Unkeyed


def _device() -> int:
    return torch._C._cuda_getDevice()


def _stream(device: int) -> int:
    """The current CUDA stream's handle (what Triton's driver passes the launcher)."""
    return torch._C._cuda_getCurrentRawStream(device)


def _hooks() -> bool:
    """Whether a launch hook is set (a profiler's): those calls take Triton's path, which calls them. Triton
    3.6 keeps a hook or None, later versions a chain of hooks (`.calls`), empty when none is set."""
    rt = triton.knobs.runtime
    return any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


class FastRun:
    """A JITFunction's `run`, with Triton's per-call bookkeeping done once per argument signature.

    The signature of a call is read in two steps: its layout (each positional argument's type, the keywords'
    names), and for that layout a key function made once (`_key_source`) that reads what the layout's
    arguments are specialised on in one expression: no per-argument function call, branch or loop, which were
    most of a launch's host time."""

    def __init__(self, kernel):
        self.slow = kernel.run  # the bound method, before this object shadows it on the instance
        self.names = tuple(kernel.arg_names)
        constexprs = set(kernel.constexprs)
        self.constexpr = tuple(i in constexprs for i in range(len(self.names)))
        self.by_name = dict(zip(self.names, self.constexpr, strict=True))  # a keyword's: constexpr or not
        self.defaults = {n: p.default for n, p in kernel.signature.parameters.items()
                         if p.default is not inspect.Parameter.empty}
        self.layouts: dict = {}  # layout -> its key function, or None where the key does not model it
        self.compiled: dict = {}  # key -> the compiled kernel

    def _key_source(self, layout_id: int, types: tuple, kwnames: tuple) -> str:
        """The key function of one layout: (its id, the device, each argument's specialisation), as `_signature`
        reads it (a constexpr's value; its type is the layout's)."""
        parts = [str(layout_id), "_device()"]
        for i, (t, const) in enumerate(zip(types, self.constexpr, strict=False)):
            a = f"a[{i}]"
            if const:
                parts.append(a)
            elif issubclass(t, torch.Tensor):
                parts += [f"{a}.dtype", f"not {a}.data_ptr() & 15"]
            elif t is int:
                parts += [f"{a} == 1", f"not {a} & 15", f"{_INT32[0]} <= {a} < {_INT32[1]}", f"{a} >= {2 ** 63}"]
            elif not (t is bool or t is float or t is type(None)):
                raise _Unkeyed
        for n in kwnames:  # a constexpr or an option (num_warps, ...) by type and value, else its signature
            parts += [f"type(k[{n!r}])", f"k[{n!r}]"] if self.by_name.get(n, True) else [f"_signature(k[{n!r}])"]
        return f"def key(a, k):\n    return ({', '.join(parts)},)\n"

    def key(self, args: tuple, kwargs: dict) -> tuple:
        """The call's signature (raises _Unkeyed where the key does not model an argument)."""
        layout = (*map(type, args), *kwargs)
        fn = self.layouts.get(layout, False)
        if fn is False:
            try:
                made: dict = {}  # the function reads this module's names (`_device`, `_signature`) at each call
                exec(self._key_source(len(self.layouts), layout[:len(args)], tuple(kwargs)), globals(), made)  # noqa: S102
                fn = made["key"]
            except _Unkeyed:
                fn = None
            self.layouts[layout] = fn
        if fn is None:
            raise _Unkeyed
        return fn(args, kwargs)

    def values(self, args: tuple, kwargs: dict) -> tuple:
        """All the parameters' values in order, as Triton's binder gives them to the launcher."""
        rest = self.names[len(args):]
        return args + tuple(kwargs[n] if n in kwargs else self.defaults[n] for n in rest)

    def __call__(self, *args, grid, warmup, **kwargs):
        if not ENABLED or warmup or type(grid) is not tuple or len(args) > len(self.names) or _hooks():
            return self.slow(*args, grid=grid, warmup=warmup, **kwargs)
        try:
            key = self.key(args, kwargs)
            kernel = self.compiled.get(key)
        except (_Unkeyed, TypeError):  # TypeError: an unhashable value (a list constexpr)
            return self.slow(*args, grid=grid, warmup=warmup, **kwargs)
        if kernel is None:
            kernel = self.slow(*args, grid=grid, warmup=warmup, **kwargs)
            if kernel is not None and not hasattr(kernel, "result"):
                self.compiled[key] = kernel
            return kernel
        n = len(grid)
        kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _stream(key[1]),
                   kernel.function, kernel.packed_metadata, None, None, None, *self.values(args, kwargs))
        return kernel


def fast(kernel):
    """Give a JITFunction the cheaper launch path (a no-op under the interpreter or when disabled)."""
    if ENABLED and isinstance(kernel, triton.runtime.JITFunction) and not isinstance(kernel.run, FastRun):
        kernel.run = FastRun(kernel)
    return kernel


def jit(fn):
    """`@triton.jit`, whose launches take the cheaper path on the GPU (`FastRun`)."""
    return fast(triton.jit(fn))


def tuned(kernel, args: tuple, kwargs: dict):
    """The configuration a `triton.autotune` kernel already picked for this call's autotuning key (its
    cached choice, as `Autotuner.run` forms the key), or None where it has none yet or the choice has a
    hook: then the call goes through the autotuner."""
    if not ENABLED:
        return None
    if len(kernel.configs) == 1:
        config = kernel.configs[0]
    else:
        names = kernel.arg_names
        nargs = dict(zip(names, args, strict=False))
        nargs.update((k, v) for k, v in kwargs.items() if k in names)
        key = [nargs[k] for k in kernel.keys if k in nargs]
        key.extend(str(v.dtype) for v in nargs.values() if hasattr(v, "dtype"))
        try:
            config = kernel.cache.get(tuple(key))
        except TypeError:  # an unhashable key
            return None
    return None if config is None or config.pre_hook is not None else config
