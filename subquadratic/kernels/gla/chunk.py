"""Gated linear attention (GLA): the chunked PyTorch forms (training / prefill), dense
[B, T, H, D] (`gla_chunked`) and variable-length packed [M, H, D] with `cu_seqlens` (`gla_varlen`:
one sequence per segment, each with its own initial state; SSE runs its partitions through it).
Chunk layout and carry: `linear_common`. Equal to `gla_recurrent` up to rounding.

Numerical safety (GLA). The intra-chunk score is A[t, s] = sum_d q_td k_sd
exp(sum_{s<u<=t} g_ud), s <= t. The usual factorisation (q exp b)(k exp -b)^T,
b = cumsum g, exponentiates -b, which is large and positive when decays are
strong. We bisect the chunk instead (`_gla_chunk_parts`): at the level of
blocks of 2w tokens, a query t in the second half and a key s in the first
half of the same block are split at the block's midpoint p:
exp(sum_{p<=u<=t} g) * exp(sum_{s<u<p} g), both exponents <= 0, so the pairs
of one level are one batched matmul of decayed queries and keys; the levels
w = 1, 2, 4, ..., C/2 cover every pair s < t once, and s = t is q_t . k_t.
Each exponent is a sum over exactly the span it covers: the decayed queries and
keys are carried from level to level, each multiplied by exp of the neighbouring
half's total (a factor <= 1) when the halves double, never by a difference of
cumulative sums, which keeps float32 accurate under strong decay; the last
level's factors are the chunk-wide decays of the inter-chunk terms. A chunk
whose length is not a power of two is padded with zero tokens (no write, no
decay) for the intra-chunk part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..linear_common import check_dense, dense, varlen


def _gla_chunk_parts(q: Tensor, k: Tensor, v: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The intra-chunk output and the chunk-wide decayed factors of GLA, by bisection (see the
    module docstring). q, k, g: [Nc, H, C, Dk] (g <= 0), v: [Nc, H, C, Dv]. Returns
    (o_intra = A v [Nc, H, C, Dv], q_dec = q exp(decay from the chunk start through t),
    k_dec = k exp(decay after s to the chunk end) [Nc, H, C, Dk], decay of the chunk [Nc, H, Dk]).

    The decayed queries and keys are carried from level to level: zq = q exp(in-half prefix sum)
    and zk = k exp(in-half suffix sum); going from halves of w to halves of 2w multiplies the second
    half's zq by exp(first half's total) and the first half's zk by exp(second half's total), each
    factor <= 1 (so no intermediate is larger than its final value, and nothing overflows)."""
    Nc, H, C, Dk = q.shape
    Cp = 1 << max(C - 1, 0).bit_length()                  # the bisection runs on a power of two
    if Cp != C:
        q, k, v, g = (F.pad(x, (0, 0, 0, Cp - C)) for x in (q, k, v, g))
    inplace = not torch.is_grad_enabled() or not any(x.requires_grad for x in (q, k, v, g))
    eg = torch.exp(g)
    zq = eg * q                                                   # halves of w = 1: q_t exp(g_t)
    zk = k.clone() if inplace else k                              # k_s exp(0)
    tot = g                     # [Nc, H, Cp / w, Dk]: the sum of g over each half of width w
    A = q.new_zeros(Nc, H, Cp, Cp)
    torch.diagonal(A, dim1=-2, dim2=-1).copy_((q * k).sum(-1))
    w = 1
    while w < Cp:
        nb = Cp // (2 * w)                                 # blocks of 2w tokens: halves 0 and 1 of width w
        zq_h, zk_h = (x.view(Nc, H, nb, 2, w, Dk) for x in (zq, zk))   # [Nc, H, block, half, w, Dk]
        a, b = zq_h[:, :, :, 1], zk_h[:, :, :, 0]          # queries of the second halves, keys of the first
        if w <= 2:   # tiny blocks: a broadcast product beats a batch of tiny matmuls
            blk = (a[..., :, None, :] * b[..., None, :, :]).sum(-1)
        else:
            blk = a @ b.transpose(-1, -2)                                # [Nc, H, nb, w, w]
        diag = torch.diagonal(A.view(Nc, H, nb, 2 * w, nb, 2 * w), dim1=2, dim2=4)  # [Nc, H, 2w, 2w, nb]
        diag[:, :, w:, :w].copy_(blk.permute(0, 1, 3, 4, 2))
        tot = tot.view(Nc, H, nb, 2, Dk)
        e = eg.view(Nc, H, nb, 2, Dk) if w == 1 else torch.exp(tot)   # exp of each half's total
        # halves of 2w: the second half's prefixes start at the first half's start, the first half's
        # suffixes run on through the second half
        e_first, e_second = e[:, :, :, 0, None], e[:, :, :, 1, None]   # [Nc, H, nb, 1, Dk]
        if inplace:
            zq_h[:, :, :, 1].mul_(e_first)
            zk_h[:, :, :, 0].mul_(e_second)
        else:
            one = torch.ones_like(e_first)
            zq = (zq_h * torch.stack([one, e_first], 3)).view_as(zq)
            zk = (zk_h * torch.stack([e_second, one], 3)).view_as(zk)
        tot = tot.sum(3)                                   # [Nc, H, nb, Dk]: halves of 2w
        w *= 2
    o_intra = A @ v
    decay = tot.reshape(Nc, H, Dk)                         # the whole chunk (padding adds no decay)
    if Cp != C:
        o_intra, zq, zk = o_intra[:, :, :C], zq[:, :, :C], zk[:, :, :C]
    return o_intra, zq, zk, decay.exp()


def gla_chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor):
    """The chunk terms (trans, inject, out) of GLA for `linear_common`'s carry (SSE's fixed-shape
    segments use them too). q, k, g: [Nc, H, C, Dk], v: [Nc, H, C, Dv]."""
    Nc, H, C, Dk = q.shape
    Dv = v.shape[-1]
    o_intra, q_dec, k_dec, decay = _gla_chunk_parts(q, k, v, g)
    inject = k_dec.transpose(-1, -2) @ v                  # [Nc, H, Dk, Dv]

    def trans(sl: slice, S: Tensor) -> Tensor:
        return decay[sl, :, :, None] * S

    def out(S_before: Tensor) -> Tensor:                   # o_intra + q_dec S_before
        return torch.baddbmm(o_intra.reshape(-1, C, Dv), q_dec.reshape(-1, C, Dk),
                             S_before.reshape(-1, Dk, Dv)).view(Nc, H, C, Dv)

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
