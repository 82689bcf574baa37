"""Helpers shared by the Triton kernel modules: the input dtypes the kernels take, the input
precision of their dots, block sizes, and autotuned launches.

Importable without Triton (the dispatch functions read `TRITON_DTYPES`); the functions that need
Triton import it when called.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import torch

from .utils import import_triton, scoped

#: Input dtypes the Triton kernels take (fp64 stays on the PyTorch forms).
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: The 16-bit float dtypes (kept as they are where an output may take the inputs' dtype; fp32 otherwise).
HALF_DTYPES = (torch.bfloat16, torch.float16)


def half_or_fp32(dtype: torch.dtype) -> torch.dtype:
    """`dtype` if it is a 16-bit float, else fp32: the dtype of an output written in the inputs' precision
    where that precision is 16-bit, at least fp32 otherwise."""
    return dtype if dtype in HALF_DTYPES else torch.float32


#: `input_precision` values of tl.dot a caller may ask for: "ieee" (exact fp32) or "tf32" (fp32
#: operands on the tensor cores; bf16 / fp16 operands always run there with fp32 accumulation).
PRECISIONS = ("ieee", "tf32")

#: Autotuning runs on the GPU only; the CPU interpreter launches with the fixed settings, and so does the
#: GPU with SUBQUADRATIC_AUTOTUNE=0 (correctness runs: each kernel compiles once instead of once per setting).
AUTOTUNE = os.environ.get("TRITON_INTERPRET", "0") != "1" and os.environ.get("SUBQUADRATIC_AUTOTUNE", "1") != "0"


def autotuning(enabled: bool):
    """Within the block the kernels autotune (`enabled`) or launch with their fixed settings (`AUTOTUNE`):
    a benchmark's comparison of the two."""
    return scoped(globals(), "AUTOTUNE", enabled)


def dot_precision(dtype: torch.dtype, precision: str | None = None) -> str:
    """`input_precision` of the dots for operands of `dtype`. fp32: `precision` (one of PRECISIONS),
    exact ("ieee") when None. bf16 / fp16 operands always run on the tensor cores with fp32
    accumulation: "tf32" whatever was asked (the setting has no effect on them)."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} or None (by dtype); got {precision!r}")
    if dtype != torch.float32:
        return "tf32"
    return precision or "ieee"


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for ints: `triton.cdiv` without its per-call unwrapping of constexpr arguments (some
    microseconds each: a launch's grid is worked out on every call)."""
    return -(-x // y)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n = 0): `triton.next_power_of_2` as a plain function."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def block_size(n: int, lo: int = 16) -> int:
    """The smallest power of two >= n and >= lo (a tile dimension covering n; tl.dot wants >= 16)."""
    return max(lo, 1 << max(0, n - 1).bit_length())


def rows_per_program(width: int, elements: int, most: int | None = None) -> int:
    """Rows a program of a row-wise kernel takes: about `elements` elements of rows `width` wide, at
    least one (and at most `most`)."""
    rows = max(1, elements // width)
    return rows if most is None else min(most, rows)


def autotune(configs: Sequence[tuple[int | None, int | None, int, int]], key: list[str]) -> Callable:
    """triton.autotune over (BK, BV, warps, stages) settings (BK / BV None: the kernel has no such
    block size, or takes it as an argument), block sizes clamped to the padded head dims K and V of
    the call (duplicates dropped)."""
    triton, _ = import_triton()

    def prune(configs, nargs, **kw):
        K, V = block_size(nargs.get("K", 16)), block_size(nargs.get("V", 16))
        out, seen = [], set()
        for c in configs:
            kwargs = {n: min(b, K if n == "BK" else V) for n, b in c.kwargs.items()}
            sig = (tuple(sorted(kwargs.items())), c.num_warps, c.num_stages)
            if sig not in seen:
                seen.add(sig)
                out.append(triton.Config(kwargs, num_warps=c.num_warps, num_stages=c.num_stages))
        return out

    configs = [triton.Config({n: b for n, b in (("BK", bk), ("BV", bv)) if b is not None}, num_warps=w, num_stages=st)
               for bk, bv, w, st in configs]
    return triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": prune})


def launch(kernel, grid, args: tuple, fixed: dict, warps: int, stages: int = 2, **kwargs) -> None:
    """kernel[grid](*args, **kwargs) for a kernel made with `autotune`: autotuned on the GPU (once a
    key's setting is picked, straight to the kernel with it: `triton_launch.tuned`), with the `fixed`
    block sizes, `warps` and `stages` under the interpreter (AUTOTUNE off). A callable grid is called
    here with the arguments and the setting, as Triton calls it: the kernel gets a tuple, which takes the
    cheaper launch (`triton_launch.FastRun`)."""
    if AUTOTUNE:
        from .triton_launch import tuned

        config = tuned(kernel, args, kwargs)
        if config is None:
            kernel[grid](*args, **kwargs)  # the autotuner (benchmarks the settings on a key's first call)
            return
        options = config.all_kwargs()
    else:
        options = {**fixed, "num_warps": warps, "num_stages": stages}
    if callable(grid):
        grid = grid({**dict(zip(kernel.fn.arg_names, args, strict=False)), **kwargs, **options})
    kernel.fn.run(*args, grid=grid, warmup=False, **kwargs, **options)


def token_stride(t: torch.Tensor) -> int | None:
    """The stride between the tokens of t [B, T, ...] when each token's entries are contiguous and its
    B x T tokens are one stride apart (a column slice of a packed projection's [B, T, N] output, or a
    contiguous tensor), else None."""
    if t.is_contiguous():
        return math.prod(t.shape[2:])
    B, T = t.shape[:2]
    inner = 1
    for n, st in zip(reversed(t.shape[2:]), reversed(t.stride()[2:]), strict=True):
        if n > 1 and st != inner:
            return None
        inner *= n
    S = t.stride(1) if T > 1 else (t.stride(0) if B > 1 else inner)
    return S if S >= inner and (B == 1 or T == 1 or t.stride(0) == T * S) else None


def read_in_place(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(t, its token stride) where t's tokens are rows of one stride (`token_stride`: a column slice of a
    packed projection's output, or contiguous): what a kernel reads where it is; else a contiguous copy
    and its stride."""
    S = token_stride(t)
    if S is None:
        t = t.contiguous()
        S = token_stride(t)
    return t, S
