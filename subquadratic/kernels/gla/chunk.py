"""Gated linear attention (GLA): the chunked PyTorch forms (training / prefill), dense
[B, T, H, D] (`gla_chunked`) and variable-length packed [M, H, D] with `cu_seqlens` (`gla_varlen`:
one sequence per segment, each with its own initial state; SSE runs its partitions through it).
Chunk layout and carry: `linear_common`. Equal to `gla_recurrent` up to rounding.

Numerical safety (GLA). The intra-chunk score is A[t, s] = sum_d q_td k_sd
exp(sum_{s<u<=t} g_ud), s <= t. The usual factorisation (q exp b)(k exp -b)^T,
b = cumsum g, exponentiates -b, which is large and positive when decays are
strong. We use secondary chunking instead: the chunk is split into sub-chunks
of 16 tokens. For a query sub-chunk i and an earlier key sub-chunk j < i the
product is factored at the start of sub-chunk i: exp(decay from the start of i
to t) * exp(decay from s to the start of i), both exponents <= 0. Inside a
diagonal sub-chunk the decays are formed pairwise from in-sub-chunk cumsums,
with the upper triangle masked to -inf before exp. No exponent is ever
positive, and each is summed over the span it covers (suffix sums, sub-chunk
cumsums) rather than as a difference of chunk-wide cumsums, which keeps float32
accurate under strong decay. (GDN has one scalar decay per head, so its [C, C]
decay matrix is formed pairwise directly, masked the same way.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..linear_common import check_dense, dense, suffix_sum, varlen

_SUB_CHUNK = 16  # GLA secondary-chunk size (used when it divides chunk_size)


def _gla_intra_scores(q: Tensor, k: Tensor, g: Tensor, c: int) -> Tensor:
    """Causal decayed scores A[t, s] = sum_d q_td k_sd exp(sum_{s<u<=t} g_ud), s <= t,
    by secondary chunking (see module docstring). q, k, g: [Nc, H, C, Dk] -> [Nc, H, C, C].

    Every exponent is <= 0 and is summed within a sub-chunk where it can be
    small (rather than as a difference of chunk-wide cumsums), for accuracy
    under strong decay."""
    Nc, H, C, Dk = q.shape
    m = C // c
    qs, ks, gs = (x.view(Nc, H, m, c, Dk) for x in (q, k, g))
    L = gs.cumsum(3)                        # in-sub-chunk inclusive cumsum   [Nc, H, m, c, Dk]
    neg_inf = float("-inf")
    # diagonal sub-chunks, pairwise: exp(L_t - L_s) for s <= t            [Nc, H, m, c, c, Dk]
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    pair = (L[..., :, None, :] - L[..., None, :, :]).masked_fill(upper[..., None], neg_inf)
    A_diag = torch.einsum("nhitd,nhitsd,nhisd->nhits", qs, pair.exp(), ks)
    eye = torch.eye(m, dtype=q.dtype, device=q.device)
    A = torch.einsum("nhits,ij->nhitjs", A_diag, eye)                 # [Nc, H, m, c, m, c]
    if m > 1:
        # query t in sub-chunk i, key s in sub-chunk j < i, split at r_i = the
        # start of sub-chunk i: exp(L_t) * exp(sum of g over (s, start_i))
        q_rel = qs * L.exp()
        tot = L[..., -1, :]                                           # [Nc, H, m, Dk]
        incl = tot.cumsum(2)                                          # through sub-chunk j
        excl = torch.cat([torch.zeros_like(incl[:, :, :1]), incl[:, :, :-1]], dim=2)  # before i
        between = excl[:, :, :, None] - incl[:, :, None]              # sub-chunks j < l < i
        e = suffix_sum(gs, 3)[:, :, None] + between[..., None, :]    # [Nc, H, m(i), m(j), c, Dk]
        not_before = torch.ones(m, m, dtype=torch.bool, device=q.device).triu()
        e = e.masked_fill(not_before[..., None, None], neg_inf)
        k_rel = ks[:, :, None] * e.exp()
        A = A + torch.einsum("nhitd,nhijsd->nhitjs", q_rel, k_rel)
    return A.reshape(Nc, H, C, C)


def gla_chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor):
    """The chunk terms (trans, inject, out) of GLA for `linear_common`'s carry (SSE's fixed-shape
    segments use them too). q, k, g: [Nc, H, C, Dk], v: [Nc, H, C, Dv]."""
    C = q.shape[2]
    b = g.cumsum(2)                                       # [Nc, H, C, Dk], <= 0
    c = _SUB_CHUNK if C % _SUB_CHUNK == 0 else C
    o_intra = _gla_intra_scores(q, k, g, c) @ v           # [Nc, H, C, Dv]
    q_dec = q * b.exp()                                   # decay from the chunk start
    k_dec = k * suffix_sum(g, 2).exp()                   # decay to the chunk end
    inject = k_dec.transpose(-1, -2) @ v                  # [Nc, H, Dk, Dv]
    decay = b[:, :, -1].exp()                             # [Nc, H, Dk]

    def trans(sl: slice, S: Tensor) -> Tensor:
        return decay[sl, :, :, None] * S

    def out(S_before: Tensor) -> Tensor:
        return o_intra + q_dec @ S_before

    return trans, inject, out


def gla_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, cu_seqlens: Tensor,
               initial_state: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked GLA over packed variable-length segments.

    q, k, g: [M, H, Dk], v: [M, H, Dv]; cu_seqlens: [S + 1] segment boundaries
    (empty segments allowed: their state passes through); initial_state:
    [S, H, Dk, Dv]. Returns (o [M, H, Dv] in q.dtype, final states [S, H, Dk, Dv]).
    """
    return varlen(gla_chunk_terms, q, k, v, (g,), cu_seqlens, initial_state, chunk_size)


def gla_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor | None = None,
                chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked GLA, equal to `gla_recurrent` up to rounding (any T, any chunk_size).
    q, k, g: [B, T, H, Dk], v: [B, T, H, Dv], state: [B, H, Dk, Dv]."""
    check_dense(q, k, v, g, None, state, "g", per_key=True)
    return dense(gla_chunk_terms, q, k, v, (g,), state, chunk_size)
