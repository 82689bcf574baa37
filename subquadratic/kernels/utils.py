"""What every op shares: the backend vocabulary and the one function that picks the path
(`resolve_backend`), the accumulation dtype, the Triton availability check, the output allocator
(poisoned outputs in tests) and the slot bookkeeping of cached keys.

Backends, the same for every op:
  "auto"   - "triton" on CUDA when the op has Triton kernels, Triton is importable and the op
             supports the inputs; else "torch".
  "torch"  - the PyTorch forms (chunked / variable-length / parallel for sequences, the recurrent
             step for one token).
  "triton" - the Triton kernels (CUDA only; a clear error elsewhere, or where the op's kernels do
             not support the inputs).
  "naive"  - the serial definition (oracle) at every length, where the op has one that can serve
             the model; a clear error otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "torch", "triton", "naive")

#: Dot precisions a caller may ask of the Triton kernels for fp32 operands: "auto" ("tf32" on CUDA,
#: "ieee" elsewhere), "tf32" (the tensor cores, 10-bit mantissas, fp32 accumulation) or "ieee"
#: (exact fp32). 16-bit operands always run on the tensor cores with fp32 accumulation; fp64
#: inputs (tests) run the kernels in exact fp32.
KERNEL_PRECISIONS = ("auto", "tf32", "ieee")

#: Whether every kernel output is filled with NaN (or -1 for indices) before the launch, so that anything
#: a kernel leaves unwritten fails (poisoned outputs): tests set it with `poisoned_outputs`.
POISON_OUTPUTS = False


@contextlib.contextmanager
def scoped(namespace: dict, name: str, value) -> Iterator[None]:
    """The setting `name` of a module (its `namespace`, `globals()`) at `value` within the block, restored
    after it: how a switch of this package (`poisoned_outputs`, `triton_utils.autotuning`,
    `triton_launch.fast_launch`, `projections.packing_with_grad`) is set by its caller."""
    before = namespace[name]
    namespace[name] = value
    try:
        yield
    finally:
        namespace[name] = before


def poisoned_outputs(enabled: bool = True) -> contextlib.AbstractContextManager:
    """Within the block, kernel outputs are poisoned before their launch (`POISON_OUTPUTS`)."""
    return scoped(globals(), "POISON_OUTPUTS", enabled)


def check_plan(plan, choices: tuple[tuple[str, tuple], ...]) -> None:
    """A ValueError where a field of a frozen plan (`SSEPlan`, `HLAPlan`) is not among its `choices`
    ((field name, allowed values) pairs)."""
    for name, allowed in choices:
        if getattr(plan, name) not in allowed:
            raise ValueError(f"{type(plan).__name__}.{name} must be one of {allowed}, got {getattr(plan, name)!r}")


def check_plan_fields(plan_cls: type, fields_set: dict, planner: str) -> None:
    """A TypeError where a planner (`planner`, e.g. "plan_sse") is asked to set what is not a field of
    `plan_cls`."""
    if not fields_set:  # the usual call (and what torch.compile traces)
        return
    names = [f.name for f in dataclasses.fields(plan_cls)]
    unknown = set(fields_set) - set(names)
    if unknown:
        raise TypeError(f"{planner} got {sorted(unknown)}, which are not fields of {plan_cls.__name__}; "
                        f"its fields: {', '.join(names)}")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    return backend


def resolve_precision(precision: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """The dot precision ("tf32" or "ieee") of fp32 operands that `precision` (one of
    KERNEL_PRECISIONS) asks for on `device`: "auto" is "tf32" on CUDA and "ieee" elsewhere (the CPU
    interpreter); fp64 inputs (`dtype`) always "ieee"."""
    if precision not in KERNEL_PRECISIONS:
        raise ValueError(f"kernel_precision must be one of {', '.join(KERNEL_PRECISIONS)}; got {precision!r}")
    if dtype == torch.float64:
        return "ieee"
    if precision == "auto":
        return "tf32" if torch.device(device).type == "cuda" else "ieee"
    return precision


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (checked once)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class _StandInCtx:
    """What a Function's forward may call on its context, for a forward called outside `apply`: no-ops."""

    def save_for_backward(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass


class _RecordlessCtx(_StandInCtx):
    """The context a Function's forward gets from `run_function` when no gradient is recorded: what a
    forward may call on it does nothing (nothing is kept for a backward that will not run)."""


class KeepingCtx(_StandInCtx):
    """A stand-in context for a Function's forward and backward called inside another Function's
    backward (a recomputation): what the forward saves is kept as `saved_tensors`, the attributes it
    sets stay on it, and `needs_input_grad` is what the caller sets (every input by default)."""

    saved_tensors: tuple = ()
    needs_input_grad: tuple = ()

    def __init__(self, **attributes) -> None:
        self.__dict__.update(attributes)

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def records(ctx) -> bool:
    """Whether a Function's forward runs for a backward that may follow (`apply`), not on `run_function`'s
    context that keeps nothing (grad mode off): where the forward may read its inputs in place instead of
    saving copies the backward can read."""
    return not isinstance(ctx, _RecordlessCtx)


def run_function(fn: type[torch.autograd.Function], *args):
    """fn.apply(*args); with grad mode off (generation, evaluation, a first-token call) fn's forward
    called directly on a context that keeps nothing: the same outputs without `apply`'s cost a call
    (the autograd bookkeeping of every argument, some microseconds of host time a launch)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return fn.apply(*args)
    return fn.forward(_RecordlessCtx(), *args)


#: The backends of the fused elementwise ops (`norm_gate`, `rope`, SSE's and HLA's feature maps).
FUSED_BACKENDS = ("auto", "triton", "torch")


def fused_backend(kernel_backend: str) -> str:
    """The backend a fused op takes under a model's `kernel_backend`: "auto" (its kernel on CUDA for inputs
    it takes) for "auto" and "triton", else "torch" (the PyTorch form)."""
    return "auto" if kernel_backend in ("auto", "triton") else "torch"


def fused_kernel(backend: str, device: torch.device, op: str, unsupported: str | None) -> bool:
    """Whether a fused elementwise op runs its Triton kernel: "auto" on CUDA with Triton installed for
    inputs the kernel takes (`unsupported` None, else the reason it refuses them), "triton" on any
    device Triton runs on (the CPU interpreter in tests; a ValueError naming `unsupported` where the
    kernel refuses the inputs), "torch" never; any other backend is a ValueError."""
    if backend not in FUSED_BACKENDS:
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch'; got {backend!r}")
    if backend == "triton":
        if unsupported is not None:
            raise ValueError(f"the {op} kernel does not take these inputs: {unsupported}; use backend='auto'")
        return True
    return backend == "auto" and unsupported is None and device.type == "cuda" and triton_available()


def resolve_backend(
    backend: str,
    device: torch.device,
    *,
    op: str,
    has_triton: bool,
    has_naive: bool,
    unsupported: str | None = None,
) -> str:
    """The path an op takes: "triton", "torch" or "naive" (see the module docstring).

    `has_triton` / `has_naive`: whether the op has Triton kernels / a serial form that serves the
    model; `unsupported`: why the Triton kernels cannot take these inputs (None: they can). "auto"
    takes the PyTorch forms in that case; an explicit "triton" raises."""
    check_backend(backend)
    if backend == "naive":
        if not has_naive:
            raise ValueError(f"{op} has no serial (naive) form that serves the model; use 'auto', 'torch' or 'triton'")
        return "naive"
    if backend == "torch":
        return "torch"
    usable = has_triton and device.type == "cuda" and triton_available()
    if backend == "auto":
        return "triton" if usable and unsupported is None else "torch"
    if not has_triton:
        raise ValueError(f"{op} has no Triton kernels yet; use 'auto' or 'torch'")
    if not usable:
        raise ValueError(f"kernel_backend='triton' needs a CUDA device and `pip install triton` ({op} got a "
                         f"{device.type} tensor); use 'auto' or 'torch'")
    if unsupported is not None:
        raise ValueError(f"the {op} Triton kernels do not support these inputs: {unsupported}; use 'auto' or 'torch'")
    return "triton"


def acc_dtype(x: torch.Tensor | torch.dtype) -> torch.dtype:
    """Accumulation dtype of a tensor or dtype: float64 for float64 (tests), float32 otherwise."""
    dtype = x if isinstance(x, torch.dtype) else x.dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """`torch.promote_types(a, b)` without its dispatch where the two are one dtype (a kernel's usual case)."""
    return a if a == b else torch.promote_types(a, b)


def new_output(shape, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised kernel output; NaN (or -1 for integer outputs) when POISON_OUTPUTS is set."""
    if POISON_OUTPUTS:
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(shape, fill, device=device, dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype)


#: Where `new_outputs` starts each tensor in its shared allocation: 256-byte offsets, as the caching
#: allocator aligns its own blocks (kernels specialise on 16-byte alignment and load in wide vectors).
CARVE_ALIGN = 256


def new_outputs(shapes, device, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """`new_output` of each shape in `shapes`, carved from one allocation: contiguous views, each at a
    CARVE_ALIGN-byte offset. One allocator call where each tensor took one, some microseconds of host time
    each on a GPU; for a kernel's scratch and its outputs that live and die together (the views keep the
    whole allocation alive, and an in-place write bumps the version counter all of them share)."""
    step = max(CARVE_ALIGN // dtype.itemsize, 1)
    sizes = [math.prod(shape) for shape in shapes]
    padded = [-(-n // step) * step for n in sizes]
    base = new_output((sum(padded),), device, dtype)
    out, start = [], 0
    for n, room, shape in zip(sizes, padded, shapes, strict=True):
        t = base[start:start + n]  # (a slice: cheaper on the host than `split`'s Python wrapper)
        out.append(t if len(shape) == 1 else t.view(shape))
        start += room
    return out


def allowed_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Which keys each query of softmax attention sees, bool [B, Tq, S], from logical positions
    q_pos [B, Tq] and k_pos [B, S] (-1 = padding): the real keys at or before the query (and, with a
    `window`, fewer than `window` positions back). Padded queries see every key (their output is
    discarded; a row with no key would give NaN)."""
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    allowed = (kp >= 0) & (kp <= qp)
    if window:
        allowed &= qp - kp < window
    return allowed | (qp < 0)


def slot_offsets(k_pos: torch.Tensor, check: bool = True) -> torch.Tensor | None:
    """Slot of logical position 0 per row ([B] int32) when each row of k_pos [B, S] holds its real
    tokens in consecutive slots (positions 0, 1, 2, ...), with padding (-1) only before them (left
    padding, as in generation), after them (right padding, as in training batches), or both; else
    None. One host sync; none with `check=False`, where the caller knows the slots are consecutive
    (a static cache)."""
    S = k_pos.shape[1]
    valid = k_pos >= 0
    off = valid.int().argmax(-1)  # first real slot (0 for a row without real tokens)
    if not check:
        return off.to(torch.int32)
    expect = torch.arange(S, device=k_pos.device)[None, :] - off[:, None]
    if not bool(torch.where(valid, k_pos == expect, True).all()):
        return None
    return off.to(torch.int32)


def import_triton():
    """(triton, triton.language) for the Triton kernel modules, with an error that says what to
    install; the PyTorch forms never import Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError("the Triton kernels need `pip install triton` (and a CUDA device); "
                          "kernel_backend='torch' runs the PyTorch forms") from e
    return triton, tl
