"""SSE's router (softmax over partitions, top-K) and its load-balancing loss."""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton_utils import TRITON_DTYPES
from ..utils import acc_dtype, fused_kernel, run_function

#: The most partitions the router kernel takes.
MAX_PARTITIONS = 256


def router_unsupported(logits: Tensor, valid: Tensor | None = None) -> str | None:
    """Why the router kernel cannot take these inputs, or None."""
    if logits.dtype not in TRITON_DTYPES:
        return f"logits dtype {logits.dtype} (one of {TRITON_DTYPES})"
    if logits.shape[-1] > MAX_PARTITIONS:
        return f"{logits.shape[-1]} partitions (at most {MAX_PARTITIONS})"
    if valid is not None and (valid.shape != logits.shape[:-1] or valid.dtype != torch.bool):
        return f"valid {list(valid.shape)} {valid.dtype} (bool, the logits' shape without N)"
    return None


def router_topk(logits: Tensor, k: int, valid: Tensor | None = None, backend: str = "torch",
                aux: bool = False, counts: bool = False) -> tuple[Tensor, ...]:
    """Router: softmax over the N partitions in float32 (float64 stays float64),
    then the top-k mask. logits: [B, T, N], valid: [B, T] bool (False at
    padding). Returns (probs [B, T, N], sel [B, T, N] bool; all False where invalid), and with `aux`
    the load-balancing loss `sse_aux_loss(probs, sel, valid)` third.
    backend: "auto" runs one Triton kernel on CUDA for inputs it takes (`router_unsupported`; among equal
    probabilities the lowest partitions are selected; with `aux` the loss's sums in the same launch and
    the loss in a second), "triton" it on any device Triton runs on (the CPU interpreter in tests) or a
    ValueError, "torch" (the default) the PyTorch ops. Differentiable in the logits through probs (and
    the loss). With `counts` the last element is what SSE's grouping would count first
    (`triton_sse.group_rows(..., counts=)`: one launch less there), from the kernel's launch; None from the
    PyTorch ops."""
    N = logits.shape[-1]
    if not 1 <= k <= N:
        raise ValueError(f"top-k must be in [1, N={N}]; got {k}")
    if fused_kernel(backend, logits.device, "router", router_unsupported(logits, valid)):
        from .triton_router import Router

        probs, sel, loss, count = run_function(Router, logits, k, valid, aux, counts and logits.dim() == 3)
        return (probs, sel) + ((loss,) if aux else ()) + ((count,) if counts else ())
    probs = torch.softmax(logits, dim=-1, dtype=acc_dtype(logits))  # the cast inside the softmax
    top = probs.topk(k, dim=-1).indices
    sel = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, top, True)
    if valid is not None:
        sel = sel & valid[..., None].bool()
    return (probs, sel) + ((sse_aux_loss(probs, sel, valid),) if aux else ()) + ((None,) if counts else ())


def sse_aux_loss(probs: Tensor, sel: Tensor, valid: Tensor | None = None) -> Tensor:
    """Load-balancing loss (N / K) sum_i mean_t(p^i_t) mean_t(1[i in T_t]) over
    the valid tokens of the whole batch; 1 when routing is uniform.
    probs, sel: [B, T, N], valid: [B, T] bool (default: tokens with any selection).
    K is the number of selected partitions of a valid token.

    With c valid tokens, P_i and S_i the sums of p^i and of the selections over them and S their
    total (K = S / c): (N / max(K, 1)) sum_i (P_i / c)(S_i / c) = N sum_i P_i S_i / (c max(S, c)),
    c at least 1: 0 (and a zero gradient) without valid tokens. One pass over [B, T, 2N] for the two
    sums (a training step runs it in every SSE layer)."""
    N = probs.shape[-1]
    if valid is None:
        valid = sel.any(-1)
    w = valid.to(probs.dtype)[..., None]                             # [B, T, 1]; masks, no indexing
    sums = (torch.cat([probs, sel.to(probs.dtype)], -1) * w).sum((0, 1))  # [2N]: P_i, then S_i
    c = w.sum().clamp(min=1)
    p_sum, s_sum = sums.split(N)
    return N * (p_sum * s_sum).sum() / (c * torch.maximum(s_sum.sum(), c))
