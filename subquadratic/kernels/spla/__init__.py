"""SPLA ops: one dispatch function per op. The Triton path is used on CUDA when its kernels are
available, the pure-PyTorch reference (`reference.py`) everywhere else; `naive.py` is the
brute-force test oracle."""

from __future__ import annotations

import torch

from .reference import BlockStats, feature_map, select_blocks, spla_attention_reference

__all__ = ["BlockStats", "feature_map", "select_blocks", "spla_attention", "resolve_backend"]

#: Triton implementations by op name, filled in on first use on a CUDA device (never imported on CPU,
#: so that tests can set TRITON_INTERPRET before importing `triton_ops` themselves).
TRITON_OPS: dict = {}


def _triton_available() -> bool:
    if not TRITON_OPS:
        try:
            from .triton_ops import spla_attention_triton
        except ImportError:
            return False
        TRITON_OPS["spla_attention"] = spla_attention_triton
    return True


def resolve_backend(requested: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA when the Triton kernels are available, else 'reference'."""
    if requested == "reference":
        return "reference"
    if device.type == "cuda" and _triton_available():
        return "triton"
    if requested == "triton":
        raise RuntimeError(
            "spla_backend='triton' needs a CUDA device and the Triton kernels; use 'auto' or 'reference'"
        )
    return "reference"


def spla_attention(q, k, v, q_pos, k_pos, stats, sbar, *, backend: str = "auto", **kw):
    """SPLA attention of the new tokens over the cache; see `spla_attention_reference` for shapes."""
    if resolve_backend(backend, q.device) == "triton":
        return TRITON_OPS["spla_attention"](q, k, v, q_pos, k_pos, stats, sbar, **kw)
    return spla_attention_reference(q, k, v, q_pos, k_pos, stats, sbar, **kw)
