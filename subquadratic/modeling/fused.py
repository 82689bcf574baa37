"""The elementwise chains of a captured one-token step (RMSNorm, residual add + RMSNorm, RoPE, the
SwiGLU gate, SPLA's residual head norm), each fused into one kernel by torch.compile (Inductor).

Eagerly each chain is a handful of tiny kernels; at one token per row a CUDA graph of the whole
model still pays for every kernel node, so these chains, not the matmuls, set the step's time.
The functions compute what the modules they stand for compute (LlamaRMSNorm, `apply_rotary_pos_emb`,
`HeadNorm`) and take the weights as arguments, so one compiled graph serves every layer. They run
only inside the captured step (`cuda_graph.DecodeGraph` sets `cache.fuse_step` while it warms up
and records); a function that fails to compile warns once and runs eagerly from then on.
"""

from __future__ import annotations

import warnings

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


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


def _add_head_norm(o: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o + HeadNorm(x) for x [B, heads, T, dim] and a per-head weight [heads, dim]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return o + (xf * weight.float()[:, None, :]).to(x.dtype)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up: LlamaMLP's gate with hidden_act "silu"."""
    return torch.nn.functional.silu(gate) * up


rms_norm = Compiled(_rms_norm)
silu_mul = Compiled(_silu_mul)
add_rms_norm = Compiled(_add_rms_norm)
rope = Compiled(_rope)
add_head_norm = Compiled(_add_head_norm)
