"""A mixer's input projections as one matmul.

A layer of the state families reads its input x through many linear maps: q, k, v, and, for SSE, the
low-rank offsets' and decays' down projections, the output gate's and the router; HLA its decay and
gate projections; the MLP its gate and up. At a decode step each is a one-row matmul of its own kernel
(the largest share of a captured step's kernels), at prefill each a launch and, for the low-rank ones,
a GEMM too narrow to fill the GPU. `input_projections` runs them as one matmul: on first use the
members' weights (and biases) are copied into one packed tensor and each member's parameter becomes a
view of its rows (`param.data`: the same Parameter objects, the same values, no second copy kept), so
the packed matmul reads the live weights and later in-place updates (an optimizer step,
`load_state_dict`) keep it valid. A member whose tensor was replaced (`model.to(...)`, a new weight
assigned) invalidates the pack, which is rebuilt at the next use. The outputs are column slices of the
packed result (views, no copy).

With gradients the packed matmul is differentiable in x and in every member's parameters
(`_PackedLinear`): one GEMM for x's gradient (where each member's dx was a GEMM and their sum further
adds) and one for the weights' (each member's gradient the view of its rows), no weight copied at the
call; under autocast its operands are cast as autocast casts a linear layer's. Where a call with
gradients does not take the pack (it asks for some members only), a mixer whose `concat_with_grad` is
set (SSE's and HLA's, with many narrow members) runs its members as one matmul over the concatenation of
their weights made at the call; the others run every member as it is.
The separate form is also taken wherever packing could change what a member computes or who owns
its memory: a member that is not a plain `nn.Linear` (a PEFT adapter, a quantised layer), one with
hooks (accelerate's offload), parameters that are not plain tensors (FSDP's), a distributed run,
a trace (`torch.compile`), a CUDA graph being captured (a pack is never built inside a capture), or
the model's `fuse_projections` set to False; with gradients also a call that asks for some members only
(the others would get a zero gradient instead of none). Every form gives the same values (one matmul
over the concatenated rows: each output column is the same dot product).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.utils import scoped

#: Rows of the packed weight each member's slot is rounded up to (zero rows between slots): 16 elements,
#: 32 bytes in bf16.
ALIGN = 16

#: The projections every attention mixer has (`base.AttentionBase`).
QKV = ("q_proj", "k_proj", "v_proj")


def _member(owner: nn.Module, name: str) -> nn.Module | None:
    """owner's submodule at dotted path `name` ("g_proj.0"), None if absent (read from the modules'
    `_modules`, as `get_submodule` does, without `nn.Module.__getattr__`'s cost: this runs at every call)."""
    m = owner
    for part in name.split("."):
        m = m._modules.get(part)
        if m is None:
            return None
    return m


def _unhooked(lin: nn.Module) -> bool:
    """No forward hooks on `lin`, nor accelerate's."""
    return not (lin._forward_hooks or lin._forward_pre_hooks or "_hf_hook" in lin.__dict__)


def _plain(lin: nn.Module) -> bool:
    """A plain nn.Linear without hooks whose parameters are plain tensors on a real device."""
    if type(lin) is not nn.Linear or not _unhooked(lin):
        return False
    ps = [p for p in (lin._parameters["weight"], lin._parameters.get("bias")) if p is not None]
    return all(type(p) is nn.Parameter and type(p.data) is torch.Tensor and p.device.type != "meta" for p in ps)


def _signature(linears: Sequence[nn.Linear]) -> list[tuple[int, torch.Size]]:
    """The data pointer and shape of each member's parameters."""
    return [(p.data_ptr(), p.shape) for lin in linears for p in (lin._parameters["weight"], lin._parameters.get("bias"))
            if p is not None]


def _slot_split(sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """The split of a packed output whose members' slots are rounded up to ALIGN rows: each member's
    columns, then its slot's zero columns where there are any; and the index of each member's piece."""
    split, index = [], []
    for n in sizes:
        index.append(len(split))
        split.append(n)
        if n % ALIGN:
            split.append(-n % ALIGN)
    return split, index


class _Members:
    """Members (`names`, the module objects `members`) whose weights were moved into one tensor (`weight`),
    with the data pointers and shapes their parameters must keep (`sig`) for it to be the live weights."""

    names: list[str]
    members: list[nn.Module]
    sig: list
    weight: torch.Tensor

    def live(self, owner: nn.Module, x: torch.Tensor) -> bool:
        """Whether the tensor still is `owner`'s members' (the same modules, plain, without hooks, their
        parameters views of it) for an input on its device: the checks of its every use, kept cheap (no
        `nn.Module.__getattr__`)."""
        return (all(_member(owner, n) is m and _unhooked(m) for n, m in zip(self.names, self.members, strict=True))
                and _signature(self.members) == self.sig and x.device == self.weight.device)


class _Pack(_Members):
    """The packed weight [rows, in] (and bias, or None) of a mixer's members (`names`, the module objects
    `members`): member i's rows at offsets[i] (a multiple of ALIGN; zero rows between slots), and the
    data pointers and shapes their parameters must have for the pack to be the live weights."""

    def __init__(self, names: Sequence[str], linears: Sequence[nn.Linear]) -> None:
        w0 = linears[0].weight
        self.names, self.members = list(names), list(linears)
        self.sizes = [lin.out_features for lin in linears]
        # each member's rows start at a multiple of ALIGN and the packed row is a multiple of ALIGN long, so
        # that every output slice (and its row stride) is aligned for vectorised loads and the GEMMs' fast paths
        self.offsets, row = [], 0
        for n in self.sizes:
            self.offsets.append(row)
            row += -(-n // ALIGN) * ALIGN
        self.start = dict(zip(self.names, self.offsets, strict=True))  # each member's first column of a result
        self.split, self.index = _slot_split(self.sizes)
        # normal tensors even under torch.inference_mode (parameters made of inference tensors could not be
        # trained later)
        with torch.inference_mode(False), torch.no_grad():
            self.weight = w0.new_zeros(row, w0.shape[1])
            has_bias = any(lin.bias is not None for lin in linears)
            self.bias = w0.new_zeros(row) if has_bias else None
            for lin, off, n in zip(linears, self.offsets, self.sizes, strict=True):
                self.weight[off:off + n] = lin.weight.detach()
                lin.weight.data = self.weight[off:off + n]
                if lin.bias is not None:
                    self.bias[off:off + n] = lin.bias.detach()
                    lin.bias.data = self.bias[off:off + n]
        self.sig = _signature(linears)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The packed result [..., rows] of one matmul over the packed weight; with gradients through the
        members' parameters (`_PackedLinear`) where grad mode is on."""
        if torch.is_grad_enabled():
            return _PackedLinear.apply(x, self, *self.params())
        return F.linear(x, self.weight, self.bias)

    def columns(self, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """{name: member's columns of y} for y, a result of `output` (views)."""
        parts = y.split(self.split, -1)
        return {n: parts[i] for n, i in zip(self.names, self.index, strict=True)}

    def params(self) -> list[torch.Tensor]:
        """The members' parameters in order: each weight, then its bias where it has one."""
        return [p for lin in self.members for p in (lin._parameters["weight"], lin._parameters.get("bias"))
                if p is not None]


def _autocast_operands(x: torch.Tensor, *others: torch.Tensor | None) -> tuple:
    """(x, *others) cast as autocast casts F.linear's operands where it is on for x's device (fp64 and None
    kept), else as they are: what a Function that runs a linear layer's matmul itself computes in."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return (x, *others)
    dt = torch.get_autocast_dtype(device)
    return tuple(t if t is None or t.dtype == torch.float64 else t.to(dt) for t in (x, *others))


class _PackedLinear(torch.autograd.Function):
    """x [..., in] -> x W^T + b over a `_Pack`'s weight W [rows, in] (bias b or none), differentiable in x
    and in the members' parameters (`_Pack.params`, views of W's and b's rows): the weights' gradient is
    one GEMM over every row, each member's the view of its rows; x's one GEMM over every row too. Under
    autocast the operands are cast as autocast casts F.linear's (the gradients come in the compute dtype,
    and autograd casts each to its input's dtype)."""

    @staticmethod
    def forward(ctx, x, pack, *params):
        ctx.pack = pack
        x, w, b = _autocast_operands(x, pack.weight, pack.bias)
        ctx.save_for_backward(x, w)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        pack = ctx.pack
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        need = ctx.needs_input_grad[2:]
        dw = db = None
        if any(need):
            d2 = dy.reshape(-1, dy.shape[-1])
            dw = d2.t() @ x.reshape(-1, x.shape[-1])
            db = d2.sum(0) if pack.bias is not None else None
        grads, i = [], 0
        for lin, off, n in zip(pack.members, pack.offsets, pack.sizes, strict=True):
            grads.append(dw[off:off + n] if need[i] else None)
            i += 1
            if lin._parameters.get("bias") is not None:
                grads.append(db[off:off + n] if need[i] else None)
                i += 1
        return dx, None, *grads


def _may_use_pack(owner: nn.Module) -> bool:
    """The conditions on the call (not the members) for one matmul (module docstring)."""
    return (getattr(owner.config, "fuse_projections", True) and not torch.compiler.is_compiling()
            and not (torch.distributed.is_available() and torch.distributed.is_initialized()))


def _may_pack(owner: nn.Module, linears: Sequence[nn.Module | None], x: torch.Tensor) -> bool:
    if len(linears) < 2 or not _may_use_pack(owner):
        return False
    if not all(lin is not None and _plain(lin) for lin in linears):
        return False
    w0 = linears[0].weight
    return all(lin.in_features == w0.shape[1] and lin.weight.dtype == w0.dtype and lin.weight.device == w0.device
               for lin in linears) and x.device == w0.device


def _concat_outputs(linears: Sequence[nn.Linear], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each member's output on x, with gradients: one matmul over the members' weights (and biases,
    zeros for a member without) concatenated at this call, each slot padded with zero rows to a multiple
    of ALIGN as in the pack (an unaligned row count sends the GEMMs to slow narrow-alignment kernels);
    column slices of its result."""
    w0 = linears[0].weight
    split, index = _slot_split([lin.out_features for lin in linears])
    has_bias = any(lin.bias is not None for lin in linears)
    parts, biases = [], []
    for lin in linears:
        pad = -lin.out_features % ALIGN
        parts += [lin.weight, w0.new_zeros(pad, w0.shape[1])] if pad else [lin.weight]
        if has_bias:
            b = w0.new_zeros(lin.out_features) if lin.bias is None else lin.bias
            biases += [b, w0.new_zeros(pad)] if pad else [b]
    y = F.linear(x, torch.cat(parts), torch.cat(biases) if has_bias else None).split(split, -1)
    return tuple(y[i] for i in index)


class PackedInputs:
    """Mixin of a module whose `input_projection_names` run through `input_projections`: a device or
    dtype change (`model.to`, `.half()`) drops the pack (and the `stacked_linears` stacks), whose tensors
    the members no longer use.
    `concat_with_grad`: where a call with gradients does not take the pack, one matmul over the
    members' concatenated weights."""

    input_projection_names: tuple[str, ...] = ()
    concat_with_grad: bool = False

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_input_pack", None)
        self.__dict__.pop("_stacks", None)
        return super()._apply(fn, recurse)


def input_projections(owner: nn.Module, x: torch.Tensor, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """{name: member(x)} for the `names` (default: all) of `owner.input_projection_names` that exist:
    one packed matmul (`packed_output`), else one over the concatenated weights with gradients where the
    owner sets `concat_with_grad` (module docstring), else each member on its own."""
    y = packed_output(owner, x, names)
    if y is not None:
        outs = packed_members(owner, y)
        return outs if names is None else {n: outs[n] for n in names}
    members = []
    for n in owner.input_projection_names:
        m = _member(owner, n)
        if m is not None:
            members.append((n, m))
    wanted = [n for n, _ in members] if names is None else list(names)
    mods = dict(members)
    if torch.is_grad_enabled() or owner.training:
        use = [mods[n] for n in wanted]
        if getattr(owner, "concat_with_grad", False) and _may_pack(owner, use, x):
            return dict(zip(wanted, _concat_outputs(use, x), strict=True))
    return {n: mods[n](x) for n in wanted}


#: Whether the pack also serves calls with gradients (`packing_with_grad(False)`: the separate or concatenated
#: members, to compare with).
PACK_WITH_GRAD = True


def packing_with_grad(enabled: bool):
    """Within the block calls with gradients take the pack (`enabled`) or not (`PACK_WITH_GRAD`)."""
    return scoped(globals(), "PACK_WITH_GRAD", enabled)


def packed_members(owner: nn.Module, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: member's columns of y} for y, `packed_output(owner, ...)`'s result (views)."""
    return owner.__dict__["_input_pack"].columns(y)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def packed_output(owner: nn.Module, x: torch.Tensor, names: Sequence[str] | None = None) -> torch.Tensor | None:
    """The packed result [..., rows] of all of `owner`'s input projections as one matmul (the pack's
    `split` / `index` give each member's columns; built on first use), or None where the pack is not
    taken (module docstring): with gradients also where `names` leaves a member out (it would get a zero
    gradient, not none)."""
    if not _may_use_pack(owner):
        return None
    grad = torch.is_grad_enabled()
    if grad and not PACK_WITH_GRAD:
        return None
    pack = owner.__dict__.get("_input_pack")
    if pack is None or not pack.live(owner, x):
        members = [(n, m) for n in owner.input_projection_names if (m := _member(owner, n)) is not None]
        linears = [m for _, m in members]
        if not _may_pack(owner, linears, x) or _capturing():  # never build a pack inside a capture
            return None
        pack = owner.__dict__["_input_pack"] = _Pack([n for n, _ in members], linears)
    if grad and names is not None and set(names) != set(pack.names):
        return None
    return pack.output(x)


def linear_plus(lin: nn.Module, x: torch.Tensor, addend: torch.Tensor) -> torch.Tensor:
    """lin(x) + addend as one GEMM that adds `addend` in its epilogue (`torch.addmm`: one launch where the
    two ops take two, and no intermediate [..., out] tensor), where `lin` is a plain nn.Linear without a
    bias (`_plain`: no PEFT adapter, hooks or sharded parameters, whose forward must run) and addend has
    lin(x)'s shape and x's dtype; else the two ops. The same values up to the sum's rounding (the GEMM's
    fp32 result plus addend, rounded once)."""
    if (_plain(lin) and lin.bias is None and addend.shape == (*x.shape[:-1], lin.out_features)
            and addend.dtype == x.dtype == lin.weight.dtype and x.device == lin.weight.device):
        return torch.addmm(addend.reshape(-1, lin.out_features), x.reshape(-1, x.shape[-1]),
                           lin.weight.t()).view(addend.shape)
    return lin(x) + addend


class _Stack(_Members):
    """The weights of members of one shape [out, in] (plain bias-free nn.Linear) in one tensor [n, out, in],
    each member's parameter a view of its slice (as a `_Pack`'s rows: the live weights, no second copy)."""

    def __init__(self, names: Sequence[str], linears: Sequence[nn.Linear]) -> None:
        self.names, self.members = list(names), list(linears)
        with torch.inference_mode(False), torch.no_grad():
            self.weight = torch.stack([lin.weight.detach() for lin in linears])
            for i, lin in enumerate(linears):
                lin.weight.data = self.weight[i]
        self.sig = _signature(linears)


def _batched_view(xs: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """xs (n tensors [..., r] of one shape, dtype and strides, views of one tensor whose rows are one stride
    apart: column slices of one packed projection's output) as one [n, rows, r] view where their first
    elements lie one constant step apart (adjacent slots of the pack), else None. (Read from shapes and
    strides: this runs at every call.)"""
    x0 = xs[0]
    shape, strides = x0.shape, x0.stride()
    if len(shape) < 2 or strides[-1] != 1:
        return None
    # one base tensor (under torch.inference_mode views keep no `_base`: then one storage)
    base = x0._base
    if base is None:
        base = x0.untyped_storage().data_ptr()
        if any(x.untyped_storage().data_ptr() != base for x in xs):
            return None
    lead = [(n, st) for n, st in zip(shape[:-1], strides[:-1], strict=True) if n != 1]
    for (_, outer), (n, inner) in zip(lead, lead[1:], strict=False):  # the leading dims as one stride
        if outer != inner * n:
            return None
    row_stride = lead[-1][1] if lead else shape[-1]
    off0 = x0.storage_offset()
    step = xs[1].storage_offset() - off0
    if step < shape[-1]:  # overlapping or in reverse order: not a pack's slots
        return None
    for i, x in enumerate(xs):
        if ((x0._base is not None and x._base is not base) or x.shape != shape or x.stride() != strides
                or x.dtype != x0.dtype or x.storage_offset() - off0 != i * step):
            return None
    return x0.as_strided((len(xs), x0.numel() // shape[-1], shape[-1]), (step, row_stride, 1))


class _StackedLinear(torch.autograd.Function):
    """The members' outputs of `stacked_linears` with gradients: forward one bmm over the stack's weight
    [n, out, in] and the inputs' [n, rows, in] view (step, row stride: `_batched_view`'s), backward one bmm
    for the inputs' gradients (each input's the view of its slice, which autograd adds into the packed
    output's gradient as it adds the members') and one for the weights' (each member's the view of its
    slice), where the members took two GEMMs each. Under autocast the operands are cast as autocast casts
    F.linear's (as `_PackedLinear`)."""

    @staticmethod
    def forward(ctx, stack, step, row_stride, *tensors):
        n = len(stack.members)
        x0 = tensors[0]
        r = x0.shape[-1]
        batch, w = _autocast_operands(x0.as_strided((n, x0.numel() // r, r), (step, row_stride, 1)), stack.weight)
        ctx.save_for_backward(batch, w)
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None
        ctx.lead = x0.shape[:-1]
        out = torch.bmm(batch, w.transpose(1, 2))  # [n, rows, out]
        return tuple(y.view(*ctx.lead, y.shape[-1]) for y in out)

    @staticmethod
    def backward(ctx, *dys):
        batch, w = ctx.saved_tensors
        n, rows, out = batch.shape[0], batch.shape[1], w.shape[1]
        dy = torch.stack([batch.new_zeros(rows, out) if d is None else d.reshape(rows, out) for d in dys])
        # a member whose output was not used gets no gradients (as its own graph gives it none)
        used = [d is not None for d in dys]
        need_x = [a and u for a, u in zip(ctx.needs_input_grad[3:3 + n], used, strict=True)]
        need_w = [a and u for a, u in zip(ctx.needs_input_grad[3 + n:], used, strict=True)]
        dx = torch.bmm(dy, w) if any(need_x) else None
        dw = torch.bmm(dy.transpose(1, 2), batch) if any(need_w) else None
        return (None, None, None, *(dx[i].view(*ctx.lead, dx.shape[-1]) if need_x[i] else None for i in range(n)),
                *(dw[i] if need_w[i] else None for i in range(n)))


def stacked_linears(owner: nn.Module, names: Sequence[str], xs: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """[member(x) for each member `names[i]` of owner and x = xs[i]] as one batched matmul (`torch.bmm`: one
    launch where the members take one each; with gradients `_StackedLinear`: two backward where they take two
    each), for members of one weight shape (plain bias-free nn.Linear: no PEFT adapter, hooks or sharded
    parameters) on inputs that are adjacent equal-width column slices of one tensor (a packed projection's
    output: `_batched_view`); the members' weights are stacked on first use (`_Stack`, rebuilt when a
    member's tensor was replaced). None where this does not apply: then the caller runs each member. The
    same values and gradients as the members (each output column the same dot product)."""
    if len(names) < 2 or not _may_use_pack(owner):
        return None
    batch = _batched_view(xs)  # first: a stack is built (its members' weights rebound) only where it serves
    if batch is None:
        return None
    stacks = owner.__dict__.setdefault("_stacks", {})
    key = tuple(names)
    stack = stacks.get(key)
    if stack is None or not stack.live(owner, xs[0]):
        linears = [_member(owner, n) for n in names]
        # `_may_pack`'s conditions (plain members of one input width, dtype and device), one output width too
        if (not _may_pack(owner, linears, xs[0]) or _capturing()
                or any(lin.bias is not None or lin.out_features != linears[0].out_features for lin in linears)):
            return None
        stack = stacks[key] = _Stack(names, linears)
    if batch.dtype != stack.weight.dtype:
        return None
    if torch.is_grad_enabled():
        params = [lin._parameters["weight"] for lin in stack.members]
        return list(_StackedLinear.apply(stack, batch.stride(0), batch.stride(1), *xs, *params))
    out = torch.bmm(batch, stack.weight.transpose(1, 2))  # [n, rows, out]
    lead = xs[0].shape[:-1]
    return [y.view(*lead, y.shape[-1]) for y in out]
