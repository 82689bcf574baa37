"""Machinery shared by the PyTorch forms of the chunked linear-attention ops (`gla`, `gated_delta`):
the serial recurrence driver, input checks, and the variable-length chunk layout with the
inter-chunk carry.

Chunked layout. Every segment is cut into chunks of C tokens, its tail padded
with q = k = v = 0, g = log_alpha = beta = 0 (padding neither writes nor
decays). Chunks are stored step-major: first chunk 0 of every segment, then
chunk 1 of every segment that has one, ... with segments ordered by length
(longest first), so step j of the inter-chunk carry works on a prefix of the
running states. All intra-chunk math is batched over every chunk at once; only
the carry S_next = trans(S) + inject is a Python loop over steps. An op supplies
`terms(q, k, v, *decays)` on [Nc, H, C, *] chunks returning (trans, inject, out):
the carry is S_next = trans(S) + inject, and out(S_before [Nc, H, Dk, Dv]) gives
the chunk outputs [Nc, H, C, Dv].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .utils import acc_dtype


def read(q: Tensor, S: Tensor) -> Tensor:
    """q: [*, Dk], S: [*, Dk, Dv] -> q S: [*, Dv]."""
    return torch.einsum("...k,...kv->...v", q, S)


def recurrent(step: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor,
               decays: tuple[Tensor, ...], state: Tensor | None) -> tuple[Tensor, Tensor]:
    B, T, H, Dk = q.shape
    dt = acc_dtype(q)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    decays = tuple(x.to(dt) for x in decays)
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if state is None else state.to(dt)
    outs = []
    for t in range(T):
        S = step(S, k[:, t], v[:, t], *(x[:, t] for x in decays))
        outs.append(read(q[:, t], S))
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, v.shape[-1])
    return o, S


def suffix_sum(g: Tensor, dim: int) -> Tensor:
    """Exclusive reverse cumsum along dim: out_s = sum_{u > s} g_u (summed directly,
    not as a difference of prefix sums, so it is accurate when the tail is small)."""
    incl = g.flip(dim).cumsum(dim).flip(dim)
    return torch.cat([incl.narrow(dim, 1, g.shape[dim] - 1),
                      torch.zeros_like(incl.narrow(dim, 0, 1))], dim)


@dataclass
class _ChunkPlan:
    """Where each packed token goes in the step-major chunk buffer."""

    dest: Tensor        # [M] row of each token in the padded buffer [Nc * C]
    rank: Tensor        # [S] slot of each segment (slots are sorted longest first)
    order: Tensor       # [S] segment in each slot (inverse of rank)
    sizes: list[int]    # active segments at each carry step (non-increasing)
    chunk_size: int
    identity: bool      # dest is 0, 1, ..., M - 1 (no padding, chunks in token order)

    @property
    def num_chunks(self) -> int:
        return sum(self.sizes)

    def to_chunks(self, x: Tensor) -> Tensor:
        """[M, H, *D] packed tokens (D may be empty) -> [Nc, H, C, *D], zero at padding."""
        _, H, *D = x.shape
        Nc, C = self.num_chunks, self.chunk_size
        if self.identity:    # one segment, whole chunks: the buffer is x itself
            return x.view(Nc, C, H, *D).transpose(1, 2).contiguous()
        buf = x.new_zeros(Nc * C, H, *D).index_put_((self.dest,), x)
        return buf.view(Nc, C, H, *D).transpose(1, 2).contiguous()   # contiguous for the matmuls

    def from_chunks(self, x: Tensor) -> Tensor:
        """[Nc, H, C, *D] -> [M, H, *D] (drops padding; reads the rows without a transposed copy)."""
        C = self.chunk_size
        return x[self.dest // C, :, self.dest % C]


def _plan(cu_seqlens: Tensor, chunk_size: int, num_tokens: int) -> _ChunkPlan:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    cu = cu_seqlens.long()
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [S + 1] running from 0 to the number "
                         f"of packed tokens ({num_tokens}); got {cu_seqlens.tolist()}")
    lens = cu[1:] - cu[:-1]                                   # [S]
    if bool((lens < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    C = chunk_size
    n_chunks = (lens + C - 1) // C                            # [S]
    order = torch.argsort(n_chunks, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=cu.device)
    max_c = int(n_chunks.max()) if n_chunks.numel() else 0
    sizes = (n_chunks[None, :] > torch.arange(max_c, device=cu.device)[:, None]).sum(1)  # [max_c]
    step_start = sizes.cumsum(0) - sizes                      # first chunk row of each step
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens)  # [M]
    pos = torch.arange(num_tokens, device=cu.device) - cu[:-1][seg]
    dest = (step_start[pos // C] + rank[seg]) * C + pos % C
    identity = lens.numel() == 1 and num_tokens % C == 0
    return _ChunkPlan(dest, rank, order, sizes.tolist(), C, identity)


def _carry(trans, inject: Tensor, S0: Tensor, sizes: list[int]) -> tuple[Tensor, Tensor]:
    """Run S_next = trans(S) + inject over the steps. S0: [S, H, Dk, Dv] in slot order.
    Returns (state before every chunk [Nc, H, Dk, Dv], final states in slot order)."""
    S, before, row = S0, [], 0
    for n in sizes:
        sl = slice(row, row + n)
        cur = S[:n]
        before.append(cur)
        nxt = trans(sl, cur) + inject[sl]
        S = torch.cat([nxt, S[n:]]) if n < S.shape[0] else nxt
        row += n
    return (torch.cat(before) if before else S0[:0]), S


def varlen(terms, q: Tensor, k: Tensor, v: Tensor, decays: tuple[Tensor, ...],
            cu_seqlens: Tensor, initial_state: Tensor | None,
            chunk_size: int) -> tuple[Tensor, Tensor]:
    M, H, Dk = q.shape
    Dv = v.shape[-1]
    dt = acc_dtype(q)
    plan = _plan(cu_seqlens, chunk_size, M)
    S = cu_seqlens.numel() - 1
    if initial_state is None:
        S0 = q.new_zeros(S, H, Dk, Dv, dtype=dt)
    else:
        if initial_state.shape != (S, H, Dk, Dv):
            raise ValueError(f"initial_state must be [num_segments={S}, H={H}, Dk={Dk}, Dv={Dv}], "
                             f"got {list(initial_state.shape)}")
        S0 = initial_state.to(dt)
    trans, inject, out = terms(*(plan.to_chunks(x.to(dt)) for x in (q, k, v, *decays)))
    before, S_last = _carry(trans, inject, S0[plan.order], plan.sizes)
    o = plan.from_chunks(out(before)) if plan.num_chunks else v.new_zeros(M, H, Dv, dtype=dt)
    return o.to(q.dtype), S_last[plan.rank]


def segments(terms, q: Tensor, k: Tensor, v: Tensor, decays: tuple[Tensor, ...], seg: Tensor, pos: Tensor,
             initial_state: Tensor, max_len: int, chunk_size: int,
             num_chunks: int | None = None, fixed_shapes: bool | None = None) -> tuple[Tensor, Tensor]:
    """The packed form with fixed shapes and no host synchronisation: tokens [M, H, *] of
    `initial_state.shape[0]` segments, token i at position pos[i] of segment seg[i] (each segment's
    positions 0, 1, ... without gaps, in any row order), no segment longer than `max_len` (a bound
    known from shapes). Each segment is cut into chunks of C tokens (compact, at most
    M // C + num_segments chunks in all, or `num_chunks` when the caller knows the exact count);
    the carry runs ceil(max_len / C) steps over every segment at once, masked where a segment has
    no chunk left. Returns (o [M, H, Dv] in q.dtype, final states [S, H, Dk, Dv]).

    `fixed_shapes=False` (the default on the CPU outside tracing, where reading lengths on the host costs nothing)
    runs the compact form instead: the segments' real lengths (`varlen`), so the carry runs as many
    steps as the longest segment has chunks and no step touches a finished segment; same values."""
    if fixed_shapes is None:   # traced (export, compile): fixed shapes on every device
        fixed_shapes = q.device.type != "cpu" or torch.compiler.is_compiling()
    if not fixed_shapes:
        return _segments_compact(terms, q, k, v, decays, seg, pos, initial_state, max_len, chunk_size)
    M, H, Dk = q.shape
    Dv = v.shape[-1]
    S_n = initial_state.shape[0]
    C = chunk_size
    dt = acc_dtype(q)
    dev = q.device
    lens = torch.zeros(S_n, dtype=torch.long, device=dev).index_add(0, seg, torch.ones_like(seg))
    n_chunks = (lens + C - 1) // C                                   # [S]
    first = n_chunks.cumsum(0) - n_chunks                            # first chunk of each segment
    Nc = M // C + S_n if num_chunks is None else num_chunks
    dest = (first[seg] + pos // C) * C + pos % C                     # [M] row in the chunk buffer

    def to_chunks(x: Tensor) -> Tensor:  # a fresh zero buffer filled in place (no copy of it)
        buf = x.new_zeros(Nc * C, *x.shape[1:]).index_put_((dest,), x)
        return buf.view(Nc, C, *x.shape[1:]).transpose(1, 2).contiguous()   # contiguous for the matmuls

    trans, inject, out = terms(*(to_chunks(x.to(dt)) for x in (q, k, v, *decays)))
    S = initial_state.to(dt)
    before = q.new_zeros(Nc, H, Dk, Dv, dtype=dt)
    for j in range(-(-max_len // C)):
        live = n_chunks > j                                          # [S] segments with a chunk j
        idx = torch.where(live, first + j, 0).clamp(max=Nc - 1)      # dead ones read chunk 0, masked
        gate = live[:, None, None, None]
        before.index_add_(0, idx, S * gate)                          # every live index is distinct
        S = torch.where(gate, trans(idx, S) + inject[idx], S)
    o = out(before)[dest // C, :, dest % C]                          # [M, H, Dv]
    return o.to(q.dtype), S


def _segments_compact(terms, q: Tensor, k: Tensor, v: Tensor, decays: tuple[Tensor, ...], seg: Tensor,
                      pos: Tensor, initial_state: Tensor, max_len: int,
                      chunk_size: int) -> tuple[Tensor, Tensor]:
    """`segments` through `varlen`: rows sorted by (segment, position) where they are not already."""
    S_n = initial_state.shape[0]
    key = seg * max_len + pos                                        # [M]
    perm = None
    if key.numel() > 1 and not bool((key[1:] > key[:-1]).all()):
        perm = torch.argsort(key)
        q, k, v, decays = q[perm], k[perm], v[perm], tuple(x[perm] for x in decays)
    lens = torch.bincount(seg, minlength=S_n)                        # [S]
    cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    o, S = varlen(terms, q, k, v, decays, cu, initial_state, chunk_size)
    if perm is not None:
        o = torch.empty_like(o).index_put_((perm,), o)
    return o, S


def dense(terms, q: Tensor, k: Tensor, v: Tensor, decays: tuple[Tensor, ...],
           state: Tensor | None, chunk_size: int) -> tuple[Tensor, Tensor]:
    """[B, T, H, *] as B segments of length T of the packed form (`segments`: fixed shapes except on
    the CPU)."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    dev = q.device
    flat = [x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, *decays)]
    seg = torch.arange(B, device=dev).repeat_interleave(T)
    pos = torch.arange(T, device=dev).repeat(B)
    S0 = q.new_zeros(B, H, Dk, Dv, dtype=acc_dtype(q)) if state is None else state
    o, S = segments(terms, *flat[:3], tuple(flat[3:]), seg, pos, S0, T, chunk_size,
                    num_chunks=B * -(-T // chunk_size))
    return o.view(B, T, H, Dv), S


def check_dense(q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor | None,
                 state: Tensor | None, decay_name: str, per_key: bool) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, Dk]; got {list(q.shape)} "
                         f"and {list(k.shape)}")
    B, T, H, Dk = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B={B}, T={T}, H={H}, Dv]; got {list(v.shape)}")
    want = (B, T, H, Dk) if per_key else (B, T, H)
    if decay.shape != want:
        raise ValueError(f"{decay_name} must be {list(want)}; got {list(decay.shape)}")
    if beta is not None and beta.shape != (B, T, H):
        raise ValueError(f"beta must be [{B}, {T}, {H}]; got {list(beta.shape)}")
    if state is not None and state.shape != (B, H, Dk, v.shape[-1]):
        raise ValueError(f"state must be [B, H, Dk, Dv] = {[B, H, Dk, v.shape[-1]]}; "
                         f"got {list(state.shape)}")
