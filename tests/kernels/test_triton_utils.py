"""The Triton helpers' switches: where kernels autotune."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")
from subquadratic.kernels import triton_utils  # noqa: E402


@pytest.mark.parametrize("interpret,switch,expected", [("0", "1", True), ("0", "0", False), ("1", "1", False),
                                                       ("0", None, True)])
def test_autotuning_is_on_the_gpu_unless_switched_off(interpret, switch, expected, monkeypatch):
    """Kernels autotune on the GPU (not under the interpreter), and launch with their fixed settings
    there too with SUBQUADRATIC_AUTOTUNE=0."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    if switch is None:
        monkeypatch.delenv("SUBQUADRATIC_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("SUBQUADRATIC_AUTOTUNE", switch)
    try:
        assert importlib.reload(triton_utils).AUTOTUNE is expected
    finally:
        monkeypatch.undo()
        importlib.reload(triton_utils)


def test_run_function_calls_forward_directly_without_grad(monkeypatch):
    """`run_function`: with grad mode off a Function's forward runs directly (apply not called), the
    outputs of apply; with grad mode on through apply, gradients flowing."""
    from subquadratic.kernels.utils import run_function

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, s):
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(x)
            ctx.s = s
            return x * s, x + 1

        @staticmethod
        def backward(ctx, dy, dz):
            return dy * ctx.s + dz, None

    x = torch.randn(5, requires_grad=True)
    want = Scale.apply(x, 3.0)
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(Scale, "apply", lambda *a: pytest.fail("apply ran without grad"))
        got = run_function(Scale, x, 3.0)
    assert all(torch.equal(a, b.detach()) for a, b in zip(got, want, strict=True))
    assert not any(t.requires_grad for t in got)
    y, z = run_function(Scale, x, 3.0)
    (g,) = torch.autograd.grad((y + z).sum(), x)
    assert torch.equal(g, torch.full_like(x, 4.0))


@pytest.mark.parametrize("shape", [(1, 1, 4, 8), (1, 5, 3, 8), (2, 1, 16), (3, 7, 2, 4), (2, 6, 1, 5)])
def test_token_stride_of_a_contiguous_tensor_is_its_row_length(shape):
    """The contiguous case's shortcut gives what the stride walk gives: a token's element count, for one
    row, one token, and a unit head dim; and a column slice of such a tensor keeps the full row's stride."""
    t = torch.zeros(shape)
    n = 1
    for s in shape[2:]:
        n *= s
    assert triton_utils.token_stride(t) == n
    assert triton_utils.token_stride(t.as_strided(t.shape, t.stride())) == n
    wide = torch.zeros(*shape[:2], 3 * n)
    part = wide[..., n:2 * n].view(shape)
    assert not part.is_contiguous() or shape[:2] == (1, 1)
    assert triton_utils.token_stride(part) == (n if shape[:2] == (1, 1) else 3 * n)


class _Fn:
    """What `launch` reads of a kernel's JITFunction; records the calls."""

    arg_names = ["X", "n", "K", "BK"]

    def __init__(self):
        self.calls = []

    def run(self, *args, grid, warmup, **kwargs):
        self.calls.append((args, grid, warmup, kwargs))


class _Tuner:
    def __init__(self):
        self.fn, self.tuner_calls = _Fn(), []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.tuner_calls.append((grid, args, kwargs))


@pytest.mark.parametrize("autotune", [True, False])
def test_launch_hands_the_kernel_a_tuple_grid(autotune, monkeypatch):
    """A callable grid is called with the arguments by name, the keywords and the setting (the picked one,
    or the fixed block sizes, warps and stages), and the kernel gets the tuple it returns, which takes the
    cheaper launch; a key with nothing picked yet goes to the autotuner with the grid as given."""
    import triton

    from subquadratic.kernels import triton_launch

    config = triton.Config({"BK": 32}, num_warps=8, num_stages=3)
    with triton_utils.autotuning(autotune):  # the setting under test, restored after the block
        monkeypatch.setattr(triton_launch, "tuned", lambda kernel, args, kwargs: config)
        seen = []

        def grid(meta):
            seen.append(meta)
            return (meta["K"] // meta["BK"], meta["n"])

        kernel, x = _Tuner(), torch.zeros(4)
        triton_utils.launch(kernel, grid, (x, 5), {"BK": 16}, 4, K=64)
        (args, got, warmup, kwargs), = kernel.fn.calls
        assert args == (x, 5) and not warmup and kwargs["K"] == 64
        if autotune:
            assert got == (2, 5) and kwargs["BK"] == 32 and kwargs["num_warps"] == 8 and kwargs["num_stages"] == 3
        else:
            assert got == (4, 5) and kwargs["BK"] == 16 and kwargs["num_warps"] == 4 and kwargs["num_stages"] == 2
        assert seen[0]["X"] is x and seen[0]["n"] == 5
        triton_utils.launch(kernel, (7,), (x, 5), {"BK": 16}, 4, K=64)
        assert kernel.fn.calls[-1][1] == (7,)
        if autotune:
            monkeypatch.setattr(triton_launch, "tuned", lambda kernel, args, kwargs: None)
            triton_utils.launch(kernel, grid, (x, 5), {"BK": 16}, 4, K=64)
            assert kernel.tuner_calls == [(grid, (x, 5), {"K": 64})] and len(kernel.fn.calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.int64])
def test_new_outputs_carves_aligned_contiguous_views_of_one_allocation(dtype):
    """`new_outputs`: each shape, contiguous, in the dtype, at a CARVE_ALIGN-byte offset of one shared
    allocation, disjoint from the others (a write to one leaves the rest), poisoned as `new_output` is under
    the kernel tests; empty and scalar shapes too."""
    from subquadratic.kernels.utils import CARVE_ALIGN, new_outputs

    shapes = [(3,), (2, 5), (0,), (4, 1, 7), (), (64,)]
    out = new_outputs(shapes, "cpu", dtype)
    assert [t.shape for t in out] == [torch.Size(s) for s in shapes]
    assert all(t.dtype == dtype and t.is_contiguous() for t in out)
    base = out[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in out)
    starts = [t.data_ptr() - base for t in out if t.numel()]
    assert all(s % CARVE_ALIGN == 0 for s in starts) and starts == sorted(set(starts))
    poison = -1 if not dtype.is_floating_point else float("nan")
    assert all((t.isnan() if dtype.is_floating_point else t == poison).all() for t in out)
    for i, t in enumerate(out):  # disjoint: each view written with its index, read back intact
        t.fill_(i)
    assert all((t == i).all() for i, t in enumerate(out))
