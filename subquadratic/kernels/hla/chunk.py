"""Chunked HLA: the training / prefill form, equal to `hla_recurrent` up to rounding.

The sequence is cut into chunks of C tokens (the tail is padded internally
with q = k = v = 0, log_alpha = 0, which changes no state). All intra-chunk
work is batched over every chunk at once with einsum; only the carry of the
D x D / D x Dv states from one chunk to the next is a Python loop.

Within a chunk, with b_t = sum of log alpha over the chunk's tokens <= t and
L_alpha[t, i] = exp(b_t - b_i) for i <= t (0 above the diagonal):

hla2:  Ktilde_c = exp(b) * (Q_c S_prev) + (L_alpha o (Q_c K_c^T)) K_c
       (row t is S_t q_t), then ordinary chunked decayed linear attention on
       (Q, Ktilde, V) with decay alpha^2 carrying F. S is carried with decay
       alpha. The normalised form runs the same linear attention on [V, 1],
       whose last column carries eta and gives the denominator q_t . eta_t.
ahla:  two chunked linear attentions with decay alpha: u = LA(q, k, v) then
       o = LA(q, k, u); normalised: on [V, 1], whose last columns carry z and
       eta.
"""

from __future__ import annotations

import torch
import torch.nn.functional as Fn
from torch import Tensor

from ..utils import acc_dtype
from .recurrent import HLAState, check_inputs, clamp_signed, init_state


def _decay_mask(b: Tensor) -> Tensor:
    """b: [B, H, N, C] in-chunk inclusive cumsum of log alpha ->
    L[..., t, i] = exp(b_t - b_i) for i <= t, else 0: [B, H, N, C, C]."""
    C = b.shape[-1]
    upper = torch.ones(C, C, dtype=torch.bool, device=b.device).triu(1)
    # mask before exp: above the diagonal b_t - b_i > 0 could overflow
    return (b[..., :, None] - b[..., None, :]).masked_fill(upper, float("-inf")).exp()


def _carry(k: Tensor, v: Tensor, b: Tensor, X: Tensor) -> tuple[Tensor, Tensor]:
    """Chunk-start states of X_t = alpha_t X_{t-1} + k_t v_t^T.

    k: [B, H, N, C, D], v: [B, H, N, C, E], b: [B, H, N, C], X: [B, H, D, E]
    (state before the first chunk). Returns (starts [B, H, N, D, E], final X).
    """
    b_last = b[..., -1:]  # [B, H, N, 1]
    # each chunk's own contribution, decayed to the chunk end: [B, H, N, D, E]
    delta = torch.einsum("bhncd,bhnce->bhnde", k * (b_last - b).exp()[..., None], v)
    chunk_decay = b_last.exp()[..., None]  # [B, H, N, 1, 1]
    starts = []
    for n in range(k.shape[2]):
        starts.append(X)
        X = chunk_decay[:, :, n] * X + delta[:, :, n]
    return torch.stack(starts, 2), X


def _linear_attention(
    q: Tensor, k: Tensor, v: Tensor, b: Tensor, X: Tensor, scores: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Chunked decayed linear attention o_t = q_t^T X_t, X_t = alpha_t X_{t-1} + k_t v_t^T.

    q, k: [B, H, N, C, D]; v: [B, H, N, C, E]; b: [B, H, N, C] (in-chunk
    cumsum of log alpha); X: [B, H, D, E]; scores: L_alpha o (Q K^T) if already
    computed. Returns (o [B, H, N, C, E], final X).
    """
    starts, X = _carry(k, v, b, X)
    if scores is None:
        scores = _decay_mask(b) * torch.einsum("bhntd,bhnsd->bhnts", q, k)  # [B, H, N, C, C]
    intra = torch.einsum("bhnts,bhnse->bhnte", scores, v)
    inter = torch.einsum("bhntd,bhnde->bhnte", q * b.exp()[..., None], starts)
    return intra + inter, X


def hla_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor,
    state: HLAState | None = None,
    chunk_size: int = 64,
    normalize: bool = False,
    eps: float = 1e-6,
    variant: str = "hla2",
) -> tuple[Tensor, HLAState]:
    """Chunked HLA, same contract as `hla_recurrent`.

    q, k: [B, T, H, D]; v: [B, T, H, Dv]; log_alpha: [B, T, H] (<= 0).
    Returns o: [B, T, H, Dv] in q.dtype and the state after the last token.
    """
    check_inputs(q, k, v, log_alpha, variant)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    out_dtype, cd = q.dtype, acc_dtype(q)
    st = init_state(state, B, H, D, Dv, variant, normalize, cd, q.device)
    if T == 0:
        return v.new_zeros(B, 0, H, Dv, dtype=out_dtype), st

    C = chunk_size
    N = -(-T // C)
    pad = N * C - T

    def chunks(x: Tensor) -> Tensor:  # [B, T, H, *] -> [B, H, N, C, *]
        x = x.to(cd).transpose(1, 2)
        if x.dim() == 3:
            return Fn.pad(x, (0, pad)).reshape(B, H, N, C)
        return Fn.pad(x, (0, 0, 0, pad)).reshape(B, H, N, C, x.shape[-1])

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    b = chunks(log_alpha).cumsum(-1)  # [B, H, N, C]
    if normalize:  # a column of ones in v carries the normaliser
        vc = torch.cat([vc, torch.ones_like(vc[..., :1])], -1)  # [B, H, N, C, Dv+1]

    def with_norm(X: Tensor, col: Tensor | None) -> Tensor:  # [B, H, D, Dv] (+ [B, H, D])
        return X if col is None else torch.cat([X, col[..., None]], -1)

    scores = _decay_mask(b) * torch.einsum("bhntd,bhnsd->bhnts", qc, kc)  # L_alpha o (Q K^T)
    if variant == "hla2":
        S_starts, S = _carry(kc, kc, b, st.S)  # [B, H, N, D, D]
        # Ktilde row t = S_t q_t: carried part + in-chunk part
        kt = b.exp()[..., None] * torch.einsum("bhnde,bhnte->bhntd", S_starts, qc)
        kt = kt + torch.einsum("bhnts,bhnsd->bhntd", scores, kc)  # [B, H, N, C, D]
        o, F = _linear_attention(qc, kt, vc, 2 * b, with_norm(st.F, st.eta))
        z = None
    else:
        u, S = _linear_attention(qc, kc, vc, b, with_norm(st.S, st.z), scores)
        o, F = _linear_attention(qc, kc, u, b, with_norm(st.F, st.eta), scores)
        z = S[..., Dv].contiguous() if normalize else None
        S = S[..., :Dv].contiguous()

    eta = None
    if normalize:
        o = o[..., :Dv] / clamp_signed(o[..., Dv:], eps)
        F, eta = F[..., :Dv].contiguous(), F[..., Dv].contiguous()
    o = o.reshape(B, H, N * C, Dv)[:, :, :T].transpose(1, 2)  # [B, T, H, Dv]
    return o.to(out_dtype), HLAState(S=S, F=F, eta=eta, z=z)
