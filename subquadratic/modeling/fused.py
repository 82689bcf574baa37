"""The decoder's elementwise modules (RMSNorm and the residual add before it, RoPE, the SwiGLU MLP,
the per-head norm) with their fused forms: inside a captured one-token step each chain runs as one
kernel compiled by torch.compile (Inductor), everywhere else as the plain modules.

Eagerly each chain is a handful of tiny kernels; at one token per row a CUDA graph of the whole
model still pays for every kernel node, so these chains, not the matmuls, set the step's time. The
fused forms compute what the modules compute (LlamaRMSNorm, LlamaMLP, `apply_rotary_pos_emb`,
`HeadNorm`) and take the weights as arguments, so one compiled graph serves every layer. They run
only where the forward's `FusedPlan` says `compiled`, which `cuda_graph.DecodeGraph` sets on the plans
of the step it warms up and records for a cache built with `fuse=True` (`captured_step`, passed as the
forward's `plan_settings`); the layer code hands the plan to the modules and never asks which form
runs. A chain that fails to compile warns once and runs eagerly from then on. `FusedPlan.recorded`
tells any layer that it runs inside such a warm-up or recording (fused or not). Outside a captured step,
RoPE and the RMSNorms (with the residual add before them) on CUDA run as one Triton kernel forward and
one backward each with Transformers' values (`kernels.rope`, `kernels.rms_norm`; kernel_backend "auto"
or "triton").

Which form runs outside a captured step is one frozen `FusedPlan` (a field per op: "kernel" or "torch"),
made once per forward by `plan_fused` from the residual stream's dtype and device, the norms' weight dtype,
the model's sizes and kernel_backend and whether gradients are on (`forward_plan`: through
`SequenceInfo.plan`, so `model.set_plan("fused", rope="kernel", ...)` sets a field, and
`set_plan("fused", device="cuda")` plans the CUDA paths on any machine). The decoder layer hands it to
its modules; a module called without one (vLLM's model, a training loop calling the layer's parts)
plans for its own call from its config. Two per-call guards remain, on metadata only, where a tensor
can legitimately differ from the stream the plan was made for: the residual added before a norm and
the two branches `HeadNorm.add` sums may have other dtypes under autocast, and RoPE's cos / sin may be
broadcast over the batch (`[1, T, D]`); where they do, the PyTorch form runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from ..kernels.norm_gate import MAX_DIM as NORM_GATE_MAX_DIM
from ..kernels.norm_gate import add_norm, norm_gate_unsupported
from ..kernels.rms_norm import MAX_DIM as RMS_NORM_MAX_DIM
from ..kernels.rms_norm import add_rms_norm as add_rms_norm_kernel
from ..kernels.rms_norm import rms_norm as rms_norm_kernel
from ..kernels.rope import rope as rope_kernel
from ..kernels.rope import rope_unsupported
from ..kernels.swiglu import silu_mul as silu_mul_kernel
from ..kernels.swiglu import silu_mul_packed
from ..kernels.triton_utils import TRITON_DTYPES
from ..kernels.utils import check_plan, check_plan_fields, triton_available
from .projections import PackedInputs, input_projections, packed_members, packed_output


class Compiled:
    """fn compiled on first use (static shapes); fn itself if compiling fails."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled = None  # None: not tried yet; False: compiling failed

    def __call__(self, *args):
        if self.compiled is not False:
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn, dynamic=False)
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 (any compiler failure: keep running eagerly)
                warnings.warn(f"torch.compile of {self.fn.__name__} failed ({type(e).__name__}: {e}); "
                              "the captured step runs it eagerly", stacklevel=2)
                self.compiled = False
        return self.fn(*args)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm(x) with this weight and eps."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + h, LlamaRMSNorm(x + h)): a residual add and the next norm."""
    y = x + h
    return y, _rms_norm(y, weight, eps)


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE of q [B, T, HQ, D] and k [B, T, H, D] (cos, sin [B, T, D])."""
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HeadNorm(x) for x [B, heads, T, dim] and a per-head weight [heads, dim]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()[:, None, :]).to(x.dtype)


def _add_head_norm(o: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o + HeadNorm(x)."""
    return o + _head_norm(x, weight, eps)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up: LlamaMLP's gate with hidden_act "silu"."""
    return torch.nn.functional.silu(gate) * up


rms_norm = Compiled(_rms_norm)
silu_mul = Compiled(_silu_mul)
add_rms_norm = Compiled(_add_rms_norm)
rope = Compiled(_rope)
add_head_norm = Compiled(_add_head_norm)


#: The kernel_backend values whose models take the fused elementwise kernels (`plan_fused`); "torch" keeps
#: the PyTorch forms.
ROPE_KERNEL_BACKENDS = ("auto", "triton")
#: Where a fused elementwise op runs outside a captured step: "kernel" (its Triton kernel) or "torch".
FUSED_PATHS = ("kernel", "torch")


@dataclass(frozen=True)
class FusedPlan:
    """Where the decoder's elementwise ops run outside a captured step, each "kernel" or "torch"
    (`FUSED_PATHS`): `rms_norm` (RMSNorm, and the residual add before it: `kernels.rms_norm`), `silu_mul`
    (the MLP's SiLU(gate) * up: on a packed output's slices forward and backward, on separate gate and up
    only without gradients: `kernels.swiglu`), `rope` (`kernels.rope`) and `add_norm` (`HeadNorm.add`:
    `kernels.norm_gate.add_norm`); `grad`: whether gradients were on when it was made.

    Inside a captured decode step (set by its capture, `captured_step`): `recorded`, the forward is the
    warm-up or the recording of the step, so a layer takes the same path in both (the warm-up compiles
    what the recording replays) and one that stays right on every later replay (no shortcut decided
    from the current weights); `compiled`, each chain runs its torch.compile'd form (module docstring)
    instead of the four fields' paths."""

    rms_norm: str = "torch"
    silu_mul: str = "torch"
    rope: str = "torch"
    add_norm: str = "torch"
    grad: bool = False
    compiled: bool = False
    recorded: bool = False

    def __post_init__(self) -> None:
        check_plan(self, tuple((name, FUSED_PATHS) for name in ("rms_norm", "silu_mul", "rope", "add_norm")))


def plan_fused(dtype: torch.dtype, device: torch.device | str, *, backend: str = "torch", grad: bool = False,
               weight_dtype: torch.dtype | None = None, hidden_size: int = 0, head_dim: int = 0, silu: bool = True,
               **fields_set) -> FusedPlan:
    """The plan of the elementwise ops of a forward whose residual stream is `dtype` on `device` (a device
    type is enough: "cuda" plans the CUDA paths on any machine, the kernels then run under Triton's
    interpreter), with the norms' `weight_dtype` (None: `dtype`), the model's `hidden_size`, `head_dim`
    and kernel `backend`, `grad` (gradients on) and `silu` (hidden_act "silu"). `fields_set` sets fields of
    the plan (`FusedPlan`), e.g. rope="kernel". Reads no tensor.

    Each op takes its kernel under a backend in ROPE_KERNEL_BACKENDS on CUDA with Triton installed for
    fp32 / bf16 / fp16 operands that fit it: the norms a hidden size up to the kernel's MAX_DIM, RoPE an
    even head dim, the residual head norm a head dim up to the norm-gate kernel's, SiLU(gate) * up with
    hidden_act "silu"."""
    check_plan_fields(FusedPlan, fields_set, "plan_fused")
    device = torch.device(device)
    weight_dtype = dtype if weight_dtype is None else weight_dtype
    on = (backend in ROPE_KERNEL_BACKENDS and device.type == "cuda" and triton_available()
          and dtype in TRITON_DTYPES and weight_dtype in TRITON_DTYPES)

    def path(name: str, fits: bool) -> str:
        return fields_set.get(name) or ("kernel" if on and fits else "torch")

    return FusedPlan(rms_norm=path("rms_norm", hidden_size <= RMS_NORM_MAX_DIM), silu_mul=path("silu_mul", silu),
                     rope=path("rope", head_dim % 2 == 0), add_norm=path("add_norm", head_dim <= NORM_GATE_MAX_DIM),
                     grad=fields_set.get("grad", grad), compiled=fields_set.get("compiled", False),
                     recorded=fields_set.get("recorded", False))


def captured_step(fuse: bool) -> dict:
    """The plan settings (`SequenceInfo.plan_settings`) of a captured decode step's warm-up and recording:
    `FusedPlan.recorded`, and `compiled` where the cache asks to `fuse` the elementwise chains."""
    return {"fused": {"compiled": fuse, "recorded": True}}


def plan_settings(config, weight: torch.Tensor, grad: bool | None = None) -> dict:
    """`plan_fused`'s keywords for a model of `config` whose norms have `weight` (its dtype), gradients
    `grad` (None: grad mode)."""
    return dict(backend=getattr(config, "kernel_backend", "torch"),
                grad=torch.is_grad_enabled() if grad is None else grad, weight_dtype=weight.dtype,
                hidden_size=config.hidden_size,
                head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                silu=getattr(config, "hidden_act", "silu") == "silu")


def forward_plan(seq, config, x: torch.Tensor, weight: torch.Tensor) -> FusedPlan:
    """This forward's plan (`seq.plan("fused", plan_fused, ...)`, made once per forward) for a residual
    stream like `x` (its dtype and device) of a model of `config` whose norms have `weight`."""
    return seq.plan("fused", plan_fused, dtype=x.dtype, device=x.device, **plan_settings(config, weight))


def own_plan(config, x: torch.Tensor, weight: torch.Tensor) -> FusedPlan:
    """The plan of a module called without one (outside a model forward): made for this call from its
    config (none: the PyTorch forms)."""
    if config is None:
        return FusedPlan()
    return plan_fused(x.dtype, x.device, **plan_settings(config, weight))


class RMSNorm(LlamaRMSNorm):
    """LlamaRMSNorm (x: [..., dim]), fused inside a captured step; `add_and_norm` also does the
    residual add before it. Elsewhere, where the forward's `FusedPlan` (`plan`; none given: `own_plan` from
    `config`) says rms_norm="kernel", one Triton kernel forward and one backward with LlamaRMSNorm's values
    (`kernels.rms_norm`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, config=None) -> None:
        super().__init__(hidden_size, eps=eps)
        self.config = config

    def forward(self, x: torch.Tensor, plan: FusedPlan | None = None) -> torch.Tensor:
        plan = plan or own_plan(self.config, x, self.weight)
        if plan.compiled:
            return rms_norm(x, self.weight, self.variance_epsilon)
        if plan.rms_norm == "kernel":
            return rms_norm_kernel(x, self.weight, self.variance_epsilon, backend="triton")
        return super().forward(x)

    def add_and_norm(self, x: torch.Tensor, h: torch.Tensor, plan: FusedPlan | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, this norm of x + h): a residual add and the norm after it. The kernel also needs h of x's
        dtype (a mixer's output under autocast may not be: then the PyTorch form)."""
        plan = plan or own_plan(self.config, x, self.weight)
        if plan.compiled:
            return add_rms_norm(x, h, self.weight, self.variance_epsilon)
        if plan.rms_norm == "kernel" and h.dtype == x.dtype:
            return add_rms_norm_kernel(x, h, self.weight, self.variance_epsilon, backend="triton")
        y = x + h
        return y, super().forward(y)


class MLP(PackedInputs, LlamaMLP):
    """LlamaMLP (SwiGLU: down(act(gate(x)) * up(x))); gate and up are one matmul, with gradients too
    (`projections.packed_output`); with hidden_act "silu", act(gate) * up runs as one kernel inside a
    captured step (compiled) and, where the forward's `FusedPlan` says silu_mul="kernel", on the packed
    output's two column slices where they are, its backward one kernel writing the packed output's
    gradient (`kernels.swiglu`), or on separate gate and up without gradients."""

    input_projection_names = ("gate_proj", "up_proj")

    def forward(self, x: torch.Tensor, plan: FusedPlan | None = None) -> torch.Tensor:
        silu = self.config.hidden_act == "silu"
        plan = plan or own_plan(self.config, x, x)
        kernels = not plan.compiled and plan.silu_mul == "kernel"
        y = None if plan.compiled else packed_output(self, x)
        if y is None:
            p = input_projections(self, x)
        else:
            # gate and up as one matmul (with gradients too) and SiLU(gate) * up on its output where it is,
            # forward and backward one kernel each on CUDA
            if silu and kernels and y.dim() == 3:  # [B, T, C] (a caller's 2-D tokens take the PyTorch form)
                start = self.__dict__["_input_pack"].start
                g0, u0, width = start["gate_proj"], start["up_proj"], self.intermediate_size
                return self.down_proj(silu_mul_packed(y, g0, u0, width, backend="triton"))
            p = packed_members(self, y)
        gate, up = p["gate_proj"], p["up_proj"]
        if silu:
            if plan.compiled:
                return self.down_proj(silu_mul(gate, up))
            if kernels and gate.dim() == 3 and not plan.grad:
                return self.down_proj(silu_mul_kernel(gate, up, backend="triton"))
        return self.down_proj(self.act_fn(gate) * up)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "torch",
               plan: FusedPlan | None = None):
    """RoPE of q [B, T, HQ, D] and k [B, T, H, D] (cos, sin [B, T, D]): fused inside a captured step;
    elsewhere where the forward's `plan` (none given: planned for this call under `backend`, the model's
    kernel_backend) says rope="kernel", one Triton kernel forward and one backward with the values of that
    form (`kernels.rope`) for inputs it takes (cos / sin broadcast otherwise than over the batch: that
    form); else that form."""
    plan = plan or plan_fused(q.dtype, q.device, backend=backend, head_dim=q.shape[-1])
    if plan.compiled:
        return rope(q, k, cos, sin)
    if plan.rope == "kernel" and rope_unsupported(q, k, cos, sin) is None:
        return rope_kernel(q, k, cos, sin, backend="triton")
    return _rope(q, k, cos, sin)


class HeadNorm(nn.Module):
    """RMSNorm over the head dimension with a per-head weight [heads, dim] (x: [B, heads, T, dim]);
    `add` (o + this norm of x) is fused inside a captured step."""

    def __init__(self, num_heads: int, dim: int, eps: float = 1e-6, init_value: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((num_heads, dim), float(init_value)))
        self.eps = eps
        self.init_value = init_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _head_norm(x, self.weight, self.eps)

    def add(self, o: torch.Tensor, x: torch.Tensor, backend: str = "torch", plan: FusedPlan | None = None
            ) -> torch.Tensor:
        """o + this norm of x (o, x: [B, heads, T, dim]). Where the forward's `plan` (none given: planned for
        this call under `backend`, the model's kernel_backend) says add_norm="kernel", one Triton kernel
        forward and one backward with the PyTorch form's values (`kernels.norm_gate.add_norm`, on the
        [B, T, heads, dim] layout) for inputs it takes (o and x of two branches may differ in dtype under
        autocast: then the PyTorch form)."""
        plan = plan or plan_fused(x.dtype, x.device, backend=backend, weight_dtype=self.weight.dtype,
                                  head_dim=x.shape[-1])
        if plan.compiled:
            return add_head_norm(o, x, self.weight, self.eps)
        if plan.add_norm == "kernel":
            ot, xt = o.transpose(1, 2), x.transpose(1, 2)
            if norm_gate_unsupported(xt, self.weight, ot) is None:
                return add_norm(ot, xt, self.weight, self.eps, backend="triton").transpose(1, 2)
        return o + self(x)
