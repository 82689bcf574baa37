"""Sparse State Expansion (SSE): the state, the shared input checks and the serial recurrence
(`sse_recurrent`: the oracle and the decode step).

Owns the math of one SSE token mixer after the projections and feature maps
(those live in the model code). Per head, with N partitions and top-K routing:

    shared:                   S0_t = diag(exp g1_t) S0_{t-1} + k1_t^T v_t
    partition i in T_t:       Si_t = diag(exp g2_t) Si_{t-1} + (p^i_t k2_t)^T v_t
    partition i not in T_t:   Si_t = Si_{t-1}                     (no write, no decay)
    read:                     o_t  = q1_t S0_t + sum_{i in T_t} p^i_t q2_t Si_t

Three implementations that agree up to rounding:

- `sse_recurrent`: serial loop over t, the oracle and the decode step; each
  step gathers, updates and scatters back only the selected partitions.
- `sse_masked`: the (N+1)-heads form: every partition is an extra head of the
  chunked base with k = p k2, q = p q2, g = g2 where selected and 0 elsewhere.
  Costs N T; simple, a second reference.
- `sse_varlen`: tokens sorted by (sample, partition) in time order (a token
  appears once per selected partition), one variable-length chunked pass over
  the non-empty (sample, partition) segments, each starting from its
  partition's state, outputs scattered back. Costs (1 + K) T.

Bases (`base=`):

- "gla" (default): g1, g2: [B, T, H, Dk] log decays per key dim (<= 0).
- "gdn": gated delta rule. g1, g2 are the per-head log_alpha1 / log_alpha2:
  [B, T, H], and `beta`: [B, T, H] (required) is the delta-rule step size,
  shared by the shared state and all partitions. A partition write uses the
  key p^i k2, exactly as in the GLA case:
      Si_t = alpha2_t (I - beta_t (p^i_t k2_t)^T (p^i_t k2_t)) Si_{t-1} + beta_t (p^i_t k2_t)^T v_t
  (so the erase strength along k2 scales with (p^i_t)^2); this is what the
  masked (N+1)-heads form computes, and an unselected partition (k = 0,
  log_alpha = 0) is left unchanged.

Shapes: q1, k1, q2, k2: [B, T, H, Dk], v: [B, T, H, Dv], probs: [B, T, N]
(router softmax, float32), sel: [B, T, N] bool (top-K mask, all False at
padding tokens). State: `SSEState` with shared [B, H, Dk, Dv] and parts
[B, N, H, Dk, Dv], float32 (float64 when the inputs are float64). Outputs are
in q1's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..gated_delta import gdn_chunk_terms, gdn_chunked, gdn_step, gdn_varlen
from ..gla import gla_chunk_terms, gla_chunked, gla_step, gla_varlen
from ..utils import acc_dtype


@dataclass
class SSEState:
    """Recurrent state of one SSE layer."""

    shared: Tensor  # [B, H, Dk, Dv]
    parts: Tensor   # [B, N, H, Dk, Dv]

    @classmethod
    def zeros(cls, batch: int, num_partitions: int, heads: int, dk: int, dv: int,
              device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> SSEState:
        return cls(torch.zeros(batch, heads, dk, dv, device=device, dtype=dtype),
                   torch.zeros(batch, num_partitions, heads, dk, dv, device=device, dtype=dtype))


@dataclass(frozen=True)
class _Base:
    step: Callable[..., Tensor]                  # (S, k, v, decay, *extra) -> S
    chunked: Callable[..., tuple[Tensor, Tensor]]  # (q, k, v, decay, *extra, state=, chunk_size=)
    varlen: Callable[..., tuple[Tensor, Tensor]]   # (q, k, v, decay, *extra, cu_seqlens=, ...)
    terms: Callable                              # chunk terms for `linear_common.segments`
    per_key_decay: bool                          # decay [B, T, H, Dk] (else [B, T, H])
    needs_beta: bool


_BASES = {
    "gla": _Base(gla_step, gla_chunked, gla_varlen, gla_chunk_terms, per_key_decay=True, needs_beta=False),
    "gdn": _Base(gdn_step, gdn_chunked, gdn_varlen, gdn_chunk_terms, per_key_decay=False, needs_beta=True),
}


def _read(q: Tensor, S: Tensor) -> Tensor:
    return torch.einsum("...k,...kv->...v", q, S)


def setup(q1, k1, q2, k2, v, g1, g2, probs, sel, state, base: str, beta: Tensor | None, make_state: bool = True):
    """Validate the inputs; return (base ops, extra per-token args, state in compute dtype; None for a
    None state without `make_state`: a caller that starts from zero states without building them)."""
    if base not in _BASES:
        raise ValueError(f"SSE base '{base}' is not supported; supported: {', '.join(_BASES)}")
    ops = _BASES[base]
    if ops.needs_beta and beta is None:
        raise ValueError(f"SSE base '{base}' needs beta: [B, T, H]")
    if not ops.needs_beta and beta is not None:
        raise ValueError(f"SSE base '{base}' takes no beta (it is for base='gdn')")
    if q1.dim() != 4:
        raise ValueError(f"q1 must be [B, T, H, Dk]; got {list(q1.shape)}")
    B, T, H, Dk = q1.shape
    Dv = v.shape[-1]
    for name, x in (("k1", k1), ("q2", q2), ("k2", k2)):
        if x.shape != q1.shape:
            raise ValueError(f"{name} must match q1 {list(q1.shape)}; got {list(x.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B={B}, T={T}, H={H}, Dv]; got {list(v.shape)}")
    want = (B, T, H, Dk) if ops.per_key_decay else (B, T, H)
    for name, x in (("g1", g1), ("g2", g2)) + ((("beta", beta),) if beta is not None else ()):
        w = (B, T, H) if name == "beta" else want
        if x.shape != w:
            raise ValueError(f"{name} must be {list(w)} for base='{base}'; got {list(x.shape)}")
    if probs.dim() != 3 or probs.shape[:2] != (B, T) or sel.shape != probs.shape:
        raise ValueError(f"probs and sel must both be [B={B}, T={T}, N]; got {list(probs.shape)} "
                         f"and {list(sel.shape)}")
    if sel.dtype != torch.bool:
        raise ValueError(f"sel must be a bool mask; got {sel.dtype}")
    N = probs.shape[-1]
    dt = acc_dtype(q1)
    extra = (beta,) if beta is not None else ()
    if state is None:
        if not make_state:
            return ops, extra, None
        state = SSEState.zeros(B, N, H, Dk, Dv, device=q1.device, dtype=dt)
    elif isinstance(state, Mapping):
        state = SSEState(**state)
    if state.shared.shape != (B, H, Dk, Dv) or state.parts.shape != (B, N, H, Dk, Dv):
        raise ValueError(f"state must have shared [B, H, Dk, Dv] = {[B, H, Dk, Dv]} and parts "
                         f"[B, N, H, Dk, Dv] = {[B, N, H, Dk, Dv]}; got {list(state.shared.shape)} "
                         f"and {list(state.parts.shape)}")
    return ops, extra, state


def sse_recurrent(q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, g1: Tensor,
                  g2: Tensor, probs: Tensor, sel: Tensor, state: SSEState | None = None, *,
                  base: str = "gla", beta: Tensor | None = None,
                  inplace: bool = False, topk: int | None = None) -> tuple[Tensor, SSEState]:
    """Serial SSE (the oracle, and the decode step when T = 1).

    Each step touches only the selected partitions: their states are gathered
    with an index, updated and scattered back. With `inplace=True` (inference
    with a cache) the new states are written into `state`'s tensors, so only
    the selected rows of `state.parts` are written; otherwise `state` is left
    as it is and new tensors are returned. Fixed shapes: each step gathers K partitions per row
    (`topk`, at most that many selected; None: N), a row's unselected ones (padding) left as they
    are, so no step synchronises with the host. Returns (o [B, T, H, Dv], state).
    """
    ops, extra, state = setup(q1, k1, q2, k2, v, g1, g2, probs, sel, state, base, beta)
    B, T, H, _ = q1.shape
    dt, out_dtype = acc_dtype(q1), q1.dtype
    if inplace and (state.shared.dtype != dt or state.parts.dtype != dt):
        raise ValueError(f"inplace=True needs the state in the compute dtype {dt}")
    q1, k1, q2, k2, v, g1, g2, probs = (x.to(dt) for x in (q1, k1, q2, k2, v, g1, g2, probs))
    extra = tuple(x.to(dt) for x in extra)
    S0, parts = state.shared.to(dt), state.parts.to(dt)   # [B, H, Dk, Dv], [B, N, H, Dk, Dv]
    K = probs.shape[-1] if topk is None else min(topk, probs.shape[-1])
    b = torch.arange(B, device=q1.device).repeat_interleave(K)      # [B K]
    outs = []
    for t in range(T):
        S0 = ops.step(S0, k1[:, t], v[:, t], g1[:, t], *(x[:, t] for x in extra))
        o_t = _read(q1[:, t], S0)                                    # [B, H, Dv]
        n = sel[:, t].to(torch.int8).topk(K, dim=-1).indices.reshape(-1)  # [P = B K] (b, partition)
        live = sel[b, t, n][:, None, None, None]                     # [P, 1, 1, 1] selected, not padding
        p = probs[b, t, n][:, None, None]                            # [P, 1, 1]
        old = parts[b, n]
        S_sel = ops.step(old, p * k2[b, t], v[b, t], g2[b, t], *(x[b, t] for x in extra))
        S_sel = torch.where(live, S_sel, old)
        parts = parts.index_put_((b, n), S_sel) if inplace else parts.index_put((b, n), S_sel)
        p = p * live[..., 0]
        outs.append(o_t.index_add(0, b, _read(p * q2[b, t], S_sel)))
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, v.shape[-1])
    if inplace:
        state.shared.copy_(S0)
        return o.to(out_dtype), state
    return o.to(out_dtype), SSEState(S0, parts)


def sse_decode_step(q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, g1: Tensor,
                    g2: Tensor, probs: Tensor, sel: Tensor, state: SSEState | None = None, *,
                    base: str = "gla", beta: Tensor | None = None,
                    inplace: bool = False, topk: int | None = None) -> tuple[Tensor, SSEState]:
    """`sse_recurrent` for one token (T = 1) in few ops: the decode step.

    The K routed partitions of each row are read with one index_select over the flattened
    [B N, H, Dk, Dv] states and written back with one index_copy; a routed-but-unselected slot
    (padding) gets decay exp(0) = 1 and key 0, so its state is written back unchanged without a
    masked select. With `inplace=True` the shared state is updated in place and only the routed rows
    of `state.parts` are written; otherwise new tensors are returned (autograd works). No host
    synchronisation. Same contract and values (up to rounding) as `sse_recurrent`."""
    ops, extra, state = setup(q1, k1, q2, k2, v, g1, g2, probs, sel, state, base, beta)
    B, T, H, Dk = q1.shape
    if T != 1:
        raise ValueError(f"sse_decode_step takes one token per row; got T={T} (use sse_recurrent)")
    dt, out_dtype = acc_dtype(q1), q1.dtype
    if inplace and (state.shared.dtype != dt or state.parts.dtype != dt):
        raise ValueError(f"inplace=True needs the state in the compute dtype {dt}")
    N, Dv = probs.shape[-1], v.shape[-1]
    K = N if topk is None else min(topk, N)
    q1, k1, q2, k2, v, g1, g2 = (x[:, 0].to(dt) for x in (q1, k1, q2, k2, v, g1, g2))  # [B, H, *]
    extra = tuple(x[:, 0].to(dt) for x in extra)                                        # beta [B, H]
    sel0 = sel[:, 0]                                                                    # [B, N]
    n = sel0.to(torch.int8).topk(K, dim=-1).indices                                     # [B, K] distinct
    live = sel0.gather(-1, n)                                                           # [B, K]
    p = probs[:, 0].to(dt).gather(-1, n) * live                                         # [B, K]; 0: no write
    flat = n.reshape(-1) if B == 1 else (n + N * torch.arange(B, device=n.device)[:, None]).reshape(-1)

    S0 = state.shared if inplace else state.shared.to(dt)                               # [B, H, Dk, Dv]
    parts = state.parts.view(B * N, H, Dk, Dv) if inplace else state.parts.to(dt).reshape(B * N, H, Dk, Dv)
    old = parts.index_select(0, flat).view(B, K, H, Dk, Dv)
    if base == "gla":
        g2 = g2[:, None] * live[:, :, None, None]                                       # [B, K, H, Dk]
        dec2 = g2.exp()[..., None]
        if inplace:
            S0.mul_(g1.exp()[..., None]).addcmul_(k1[..., :, None], v[..., None, :])
            new = old.mul_(dec2)
        else:
            S0 = torch.addcmul(S0 * g1.exp()[..., None], k1[..., :, None], v[..., None, :])
            new = old * dec2
        new = new.addcmul_(p[:, :, None, None, None] * k2[:, None, :, :, None], v[:, None, :, None, :])
    else:
        S1 = ops.step(S0, k1, v, g1, *extra)
        S0 = S0.copy_(S1) if inplace else S1
        g2 = g2[:, None] * live[:, :, None]                                             # [B, K, H]
        new = ops.step(old, p[:, :, None, None] * k2[:, None], v[:, None], g2, *(x[:, None] for x in extra))
    if inplace:
        parts.index_copy_(0, flat, new.view(B * K, H, Dk, Dv))
        parts_out = state.parts
    else:
        parts_out = parts.index_copy(0, flat, new.reshape(B * K, H, Dk, Dv)).view(B, N, H, Dk, Dv)
    o = (q1[..., None, :] @ S0).squeeze(-2)                                             # [B, H, Dv]
    r = ((p[:, :, None, None] * q2[:, None])[..., None, :] @ new).squeeze(-2)         # [B, K, H, Dv]
    o = (o + r.sum(1))[:, None].to(out_dtype)                                           # [B, 1, H, Dv]
    if inplace:
        return o, state
    return o, SSEState(S0, parts_out)
