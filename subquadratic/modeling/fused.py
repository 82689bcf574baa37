"""The decoder's elementwise modules (RMSNorm and the residual add before it, RoPE, the SwiGLU MLP,
the per-head norm) with their fused forms: inside a captured one-token step each chain runs as one
kernel compiled by torch.compile (Inductor), everywhere else as the plain modules.

Eagerly each chain is a handful of tiny kernels; at one token per row a CUDA graph of the whole
model still pays for every kernel node, so these chains, not the matmuls, set the step's time. The
fused forms compute what the modules compute (LlamaRMSNorm, LlamaMLP, `apply_rotary_pos_emb`,
`HeadNorm`) and take the weights as arguments, so one compiled graph serves every layer. They run
only inside `compiled_step()`, which `cuda_graph.DecodeGraph` enters while it warms up and records a
step of a cache built with `fuse=True`; the layer code calls the modules and never asks which form
runs. A chain that fails to compile warns once and runs eagerly from then on. `recording()` tells
any layer that it runs inside such a warm-up or recording (fused or not). Outside a captured step,
RoPE and the RMSNorms (with the residual add before them) on CUDA run as one Triton kernel forward and
one backward each with Transformers' values (`kernels.rope`, `kernels.rms_norm`; kernel_backend "auto"
or "triton").
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from ..kernels.norm_gate import add_norm, add_norm_takes_kernel
from ..kernels.rms_norm import add_rms_norm as add_rms_norm_kernel
from ..kernels.rms_norm import rms_norm as rms_norm_kernel
from ..kernels.rms_norm import rms_norm_takes_kernel
from ..kernels.rope import rope as rope_kernel
from ..kernels.rope import rope_takes_kernel
from ..kernels.swiglu import silu_mul as silu_mul_kernel
from ..kernels.swiglu import silu_mul_packed, silu_mul_packed_takes_kernel, silu_mul_takes_kernel
from .projections import PackedInputs, input_projections, packed_members, packed_output


class _Step:
    """Whether the running step is one `cuda_graph.DecodeGraph` warms up or records (`recorded`), and
    whether its chains run fused (`compiled`); set by `compiled_step` alone (class attributes, not
    context variables, so that torch.compile and torch.export trace the modules that read them)."""

    compiled = False
    recorded = False


@contextmanager
def compiled_step(enabled: bool = True) -> Iterator[None]:
    """The block is the warm-up or the recording of a captured step: the modules of this file run
    their fused forms inside it (with `enabled`), and `recording()` is true."""
    before = _Step.compiled, _Step.recorded
    _Step.compiled, _Step.recorded = enabled, True
    try:
        yield
    finally:
        _Step.compiled, _Step.recorded = before


def recording() -> bool:
    """Whether the running step is the warm-up or the recording of a captured decode step: a layer
    must take the same path in both (the warm-up compiles what the recording replays) and one that
    stays right on every later replay (no shortcut decided from the current weights)."""
    return _Step.recorded


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


class RMSNorm(LlamaRMSNorm):
    """LlamaRMSNorm (x: [..., dim]), fused inside a captured step; `add_and_norm` also does the
    residual add before it. Elsewhere, with `config` given and its kernel_backend in ROPE_KERNEL_BACKENDS,
    on CUDA one Triton kernel forward and one backward with LlamaRMSNorm's values (`kernels.rms_norm`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, config=None) -> None:
        super().__init__(hidden_size, eps=eps)
        self.config = config

    def _kernel(self, x: torch.Tensor, h: torch.Tensor | None = None) -> bool:
        return (self.config is not None and getattr(self.config, "kernel_backend", "torch") in ROPE_KERNEL_BACKENDS
                and rms_norm_takes_kernel(x, self.weight, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _Step.compiled:
            return rms_norm(x, self.weight, self.variance_epsilon)
        if self._kernel(x):
            return rms_norm_kernel(x, self.weight, self.variance_epsilon, backend="triton")
        return super().forward(x)

    def add_and_norm(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, this norm of x + h): a residual add and the norm after it."""
        if _Step.compiled:
            return add_rms_norm(x, h, self.weight, self.variance_epsilon)
        if self._kernel(x, h):
            return add_rms_norm_kernel(x, h, self.weight, self.variance_epsilon, backend="triton")
        y = x + h
        return y, super().forward(y)


class MLP(PackedInputs, LlamaMLP):
    """LlamaMLP (SwiGLU: down(act(gate(x)) * up(x))); gate and up are one matmul, with gradients too
    (`projections.packed_output`); with hidden_act "silu", act(gate) * up runs as one kernel inside a
    captured step (compiled) and, on CUDA with a kernel backend, on the packed output's two column slices
    where they are, its backward one kernel writing the packed output's gradient (`kernels.swiglu`)."""

    input_projection_names = ("gate_proj", "up_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        silu = self.config.hidden_act == "silu"
        kernels = getattr(self.config, "kernel_backend", "torch") in ROPE_KERNEL_BACKENDS
        y = None if _Step.compiled else packed_output(self, x)
        if y is None:
            p = input_projections(self, x)
        else:
            # gate and up as one matmul (with gradients too) and SiLU(gate) * up on its output where it is,
            # forward and backward one kernel each on CUDA
            if silu and kernels and y.dim() == 3:
                start = self.__dict__["_input_pack"].start
                g0, u0, width = start["gate_proj"], start["up_proj"], self.intermediate_size
                if silu_mul_packed_takes_kernel(y, g0, u0, width):
                    return self.down_proj(silu_mul_packed(y, g0, u0, width, backend="triton"))
            p = packed_members(self, y)
        gate, up = p["gate_proj"], p["up_proj"]
        if silu:
            if _Step.compiled:
                return self.down_proj(silu_mul(gate, up))
            if kernels and gate.dim() == 3 and silu_mul_takes_kernel(gate, up):
                return self.down_proj(silu_mul_kernel(gate, up, backend="triton"))
        return self.down_proj(self.act_fn(gate) * up)


#: The kernel_backend values whose models take the RoPE kernel (`apply_rope`) and the residual norm's
#: (`HeadNorm.add`); "torch" keeps the PyTorch forms.
ROPE_KERNEL_BACKENDS = ("auto", "triton")


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "torch"):
    """RoPE of q [B, T, HQ, D] and k [B, T, H, D] (cos, sin [B, T, D]): fused inside a captured step;
    elsewhere on CUDA with a `backend` (the model's kernel_backend) in ROPE_KERNEL_BACKENDS one Triton
    kernel forward and one backward with the values of that form (`kernels.rope`); else that form."""
    if _Step.compiled:
        return rope(q, k, cos, sin)
    if backend in ROPE_KERNEL_BACKENDS and rope_takes_kernel(q, k, cos, sin):
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

    def add(self, o: torch.Tensor, x: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """o + this norm of x (o, x: [B, heads, T, dim]). With a `backend` (the model's kernel_backend)
        in ROPE_KERNEL_BACKENDS, on CUDA one Triton kernel forward and one backward with the PyTorch form's
        values (`kernels.norm_gate.add_norm`, on the [B, T, heads, dim] layout) for inputs it takes."""
        if _Step.compiled:
            return add_head_norm(o, x, self.weight, self.eps)
        if backend in ROPE_KERNEL_BACKENDS:
            ot, xt = o.transpose(1, 2), x.transpose(1, 2)
            if add_norm_takes_kernel(ot, xt, self.weight):
                return add_norm(ot, xt, self.weight, self.eps, backend="triton").transpose(1, 2)
        return o + self(x)
