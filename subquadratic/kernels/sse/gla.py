"""Gated linear attention (GLA) and the gated delta rule (GDN): the linear-attention
bases of SSE, in pure PyTorch.

Owns, for each base, a serial recurrence (the oracle; also the decode step) and
a chunked form (training / prefill) in two layouts: dense [B, T, H, D] and
variable-length packed [M, H, D] with `cu_seqlens` (one sequence per segment,
each with its own initial state; SSE runs its partitions through this).

    GLA: S_t = diag(exp g_t) S_{t-1} + k_t^T v_t                    o_t = q_t S_t
    GDN: S_t = alpha_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t
         (k_t a row vector, so k_t^T k_t is the outer product; alpha_t = exp(log_alpha_t))

S is [Dk, Dv] per head. q, k: [.., H, Dk], v: [.., H, Dv], g: [.., H, Dk] (log
decay per key dim, <= 0), log_alpha and beta: [.., H]. Math runs in float32, or
float64 when q is float64; outputs come back in q's dtype, states in the
compute dtype (float32, float64 for float64 inputs).

Chunked layout. Every segment is cut into chunks of C tokens, its tail padded
with q = k = v = 0, g = log_alpha = beta = 0 (padding neither writes nor
decays). Chunks are stored step-major: first chunk 0 of every segment, then
chunk 1 of every segment that has one, ... with segments ordered by length
(longest first), so step j of the inter-chunk carry works on a prefix of the
running states. All intra-chunk math is batched over every chunk at once; only
the carry S_next = trans(S) + inject is a Python loop over steps.

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

GDN chunking is the WY / UT-transform form of DeltaNet: within a chunk, with
Gamma_t = exp(b_t) and w_t = beta_t (v_t - k_t alpha_t S_{t-1}),
    (I + A) W = beta V - (beta Gamma K) S_0,  A[t, s] = beta_t (k_t . k_s) Gamma_t / Gamma_s (s < t)
solved with a unit-lower-triangular solve, then
    o_t = Gamma_t q_t S_0 + sum_{s<=t} (Gamma_t / Gamma_s)(q_t . k_s) w_s
    S_C = Gamma_C S_0 + sum_s (Gamma_C / Gamma_s) k_s^T w_s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

_SUB_CHUNK = 16  # GLA secondary-chunk size (used when it divides chunk_size)


def compute_dtype(x: Tensor) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _read(q: Tensor, S: Tensor) -> Tensor:
    """q: [*, Dk], S: [*, Dk, Dv] -> q S: [*, Dv]."""
    return torch.einsum("...k,...kv->...v", q, S)


# ---------------------------------------------------------------------------
# single steps (shared by the recurrences and by SSE's decode)
# ---------------------------------------------------------------------------


def gla_step(S: Tensor, k: Tensor, v: Tensor, g: Tensor) -> Tensor:
    """One GLA write. S: [*, H, Dk, Dv], k, g: [*, H, Dk], v: [*, H, Dv] -> new S."""
    return g.exp()[..., None] * S + k[..., :, None] * v[..., None, :]


def gdn_step(S: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor) -> Tensor:
    """One gated-delta-rule write. S: [*, H, Dk, Dv], k: [*, H, Dk], v: [*, H, Dv],
    log_alpha, beta: [*, H] -> new S."""
    S = log_alpha.exp()[..., None, None] * S
    u = beta[..., None] * (v - _read(k, S))  # [*, H, Dv]
    return S + k[..., :, None] * u[..., None, :]


def _recurrent(step: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor,
               decays: tuple[Tensor, ...], state: Tensor | None) -> tuple[Tensor, Tensor]:
    B, T, H, Dk = q.shape
    dt = compute_dtype(q)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    decays = tuple(x.to(dt) for x in decays)
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if state is None else state.to(dt)
    outs = []
    for t in range(T):
        S = step(S, k[:, t], v[:, t], *(x[:, t] for x in decays))
        outs.append(_read(q[:, t], S))
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, v.shape[-1])
    return o, S


def gla_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Serial GLA (the oracle). q, k, g: [B, T, H, Dk], v: [B, T, H, Dv],
    state: [B, H, Dk, Dv]. Returns (o [B, T, H, Dv] in q.dtype, final state)."""
    _check_dense(q, k, v, g, None, state, "g", per_key=True)
    o, S = _recurrent(gla_step, q, k, v, (g,), state)
    return o.to(q.dtype), S


def gdn_recurrent(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Serial gated delta rule (the oracle). q, k: [B, T, H, Dk], v: [B, T, H, Dv],
    log_alpha, beta: [B, T, H], state: [B, H, Dk, Dv]. Returns (o, final state)."""
    _check_dense(q, k, v, log_alpha, beta, state, "log_alpha", per_key=False)
    o, S = _recurrent(gdn_step, q, k, v, (log_alpha, beta), state)
    return o.to(q.dtype), S


# ---------------------------------------------------------------------------
# per-chunk terms, batched over chunks: inputs are [Nc, H, C, *]
# each returns (trans, inject, out): the carry is S_next = trans(S) + inject,
# and out(S_before [Nc, H, Dk, Dv]) gives the chunk outputs [Nc, H, C, Dv].
# ---------------------------------------------------------------------------


def _suffix_sum(g: Tensor, dim: int) -> Tensor:
    """Exclusive reverse cumsum along dim: out_s = sum_{u > s} g_u (summed directly,
    not as a difference of prefix sums, so it is accurate when the tail is small)."""
    incl = g.flip(dim).cumsum(dim).flip(dim)
    return torch.cat([incl.narrow(dim, 1, g.shape[dim] - 1),
                      torch.zeros_like(incl.narrow(dim, 0, 1))], dim)


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
        e = _suffix_sum(gs, 3)[:, :, None] + between[..., None, :]    # [Nc, H, m(i), m(j), c, Dk]
        not_before = torch.ones(m, m, dtype=torch.bool, device=q.device).triu()
        e = e.masked_fill(not_before[..., None, None], neg_inf)
        k_rel = ks[:, :, None] * e.exp()
        A = A + torch.einsum("nhitd,nhijsd->nhitjs", q_rel, k_rel)
    return A.reshape(Nc, H, C, C)


def _gla_chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor):
    """q, k, g: [Nc, H, C, Dk], v: [Nc, H, C, Dv]."""
    C = q.shape[2]
    b = g.cumsum(2)                                       # [Nc, H, C, Dk], <= 0
    c = _SUB_CHUNK if C % _SUB_CHUNK == 0 else C
    o_intra = _gla_intra_scores(q, k, g, c) @ v           # [Nc, H, C, Dv]
    q_dec = q * b.exp()                                   # decay from the chunk start
    k_dec = k * _suffix_sum(g, 2).exp()                   # decay to the chunk end
    inject = k_dec.transpose(-1, -2) @ v                  # [Nc, H, Dk, Dv]
    decay = b[:, :, -1].exp()                             # [Nc, H, Dk]

    def trans(sl: slice, S: Tensor) -> Tensor:
        return decay[sl, :, :, None] * S

    def out(S_before: Tensor) -> Tensor:
        return o_intra + q_dec @ S_before

    return trans, inject, out


def _gdn_chunk_terms(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor):
    """q, k: [Nc, H, C, Dk], v: [Nc, H, C, Dv], log_alpha, beta: [Nc, H, C]."""
    C = q.shape[2]
    b = log_alpha.cumsum(2)                               # [Nc, H, C]
    b_last = b[:, :, -1]                                  # [Nc, H]
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    # exp(b_t - b_s) for s <= t, 0 above the diagonal (masked before exp)   [Nc, H, C, C]
    decay = (b[..., :, None] - b[..., None, :]).masked_fill(upper, float("-inf")).exp()
    A = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    IA = A + eye                                          # unit lower triangular
    rhs = torch.cat([beta[..., None] * v, (beta * b.exp())[..., None] * k], dim=-1)
    sol = torch.linalg.solve_triangular(IA, rhs, upper=False, unitriangular=True)
    U, Wk = sol.split([v.shape[-1], k.shape[-1]], dim=-1)  # W = U - Wk S_0
    Aqk = (q @ k.transpose(-1, -2)) * decay               # [Nc, H, C, C], incl. diagonal
    q_dec = q * b.exp()[..., None]
    k_dec = k * _suffix_sum(log_alpha, 2).exp()[..., None]  # [Nc, H, C, Dk]
    eye_k = torch.eye(k.shape[-1], dtype=q.dtype, device=q.device)
    M = b_last.exp()[..., None, None] * eye_k - k_dec.transpose(-1, -2) @ Wk  # [Nc, H, Dk, Dk]
    inject = k_dec.transpose(-1, -2) @ U                  # [Nc, H, Dk, Dv]

    def trans(sl: slice, S: Tensor) -> Tensor:
        return M[sl] @ S

    def out(S_before: Tensor) -> Tensor:
        W = U - Wk @ S_before
        return q_dec @ S_before + Aqk @ W

    return trans, inject, out


# ---------------------------------------------------------------------------
# variable-length chunk layout and the inter-chunk carry
# ---------------------------------------------------------------------------


@dataclass
class _ChunkPlan:
    """Where each packed token goes in the step-major chunk buffer."""

    dest: Tensor        # [M] row of each token in the padded buffer [Nc * C]
    rank: Tensor        # [S] slot of each segment (slots are sorted longest first)
    order: Tensor       # [S] segment in each slot (inverse of rank)
    sizes: list[int]    # active segments at each carry step (non-increasing)
    chunk_size: int

    @property
    def num_chunks(self) -> int:
        return sum(self.sizes)

    def to_chunks(self, x: Tensor) -> Tensor:
        """[M, H, *D] packed tokens (D may be empty) -> [Nc, H, C, *D], zero at padding."""
        _, H, *D = x.shape
        buf = x.new_zeros(self.num_chunks * self.chunk_size, H, *D).index_put((self.dest,), x)
        return buf.view(self.num_chunks, self.chunk_size, H, *D).transpose(1, 2)

    def from_chunks(self, x: Tensor) -> Tensor:
        """[Nc, H, C, *D] -> [M, H, *D] (drops padding)."""
        Nc, H, C, *D = x.shape
        return x.transpose(1, 2).reshape(Nc * C, H, *D)[self.dest]


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
    return _ChunkPlan(dest, rank, order, sizes.tolist(), C)


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


def _varlen(terms, q: Tensor, k: Tensor, v: Tensor, decays: tuple[Tensor, ...],
            cu_seqlens: Tensor, initial_state: Tensor | None,
            chunk_size: int) -> tuple[Tensor, Tensor]:
    M, H, Dk = q.shape
    Dv = v.shape[-1]
    dt = compute_dtype(q)
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


def gla_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, cu_seqlens: Tensor,
               initial_state: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked GLA over packed variable-length segments.

    q, k, g: [M, H, Dk], v: [M, H, Dv]; cu_seqlens: [S + 1] segment boundaries
    (empty segments allowed: their state passes through); initial_state:
    [S, H, Dk, Dv]. Returns (o [M, H, Dv] in q.dtype, final states [S, H, Dk, Dv]).
    """
    return _varlen(_gla_chunk_terms, q, k, v, (g,), cu_seqlens, initial_state, chunk_size)


def gdn_varlen(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor, *,
               cu_seqlens: Tensor, initial_state: Tensor | None = None,
               chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule over packed variable-length segments.
    q, k: [M, H, Dk], v: [M, H, Dv], log_alpha, beta: [M, H]; otherwise as `gla_varlen`."""
    return _varlen(_gdn_chunk_terms, q, k, v, (log_alpha, beta), cu_seqlens, initial_state,
                   chunk_size)


def _dense(varlen_fn, q: Tensor, k: Tensor, v: Tensor, decays: tuple[Tensor, ...],
           state: Tensor | None, chunk_size: int) -> tuple[Tensor, Tensor]:
    """[B, T, H, *] as B segments of length T of the packed form."""
    B, T, H, _ = q.shape
    cu = torch.arange(B + 1, device=q.device) * T
    flat = [x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, *decays)]
    o, S = varlen_fn(*flat, cu_seqlens=cu, initial_state=state, chunk_size=chunk_size)
    return o.view(B, T, H, v.shape[-1]), S


def gla_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor | None = None,
                chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked GLA, equal to `gla_recurrent` up to rounding (any T, any chunk_size).
    q, k, g: [B, T, H, Dk], v: [B, T, H, Dv], state: [B, H, Dk, Dv]."""
    _check_dense(q, k, v, g, None, state, "g", per_key=True)
    return _dense(gla_varlen, q, k, v, (g,), state, chunk_size)


def gdn_chunked(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor,
                state: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked (WY / UT-transform) gated delta rule, equal to `gdn_recurrent` up to
    rounding. q, k: [B, T, H, Dk], v: [B, T, H, Dv], log_alpha, beta: [B, T, H]."""
    _check_dense(q, k, v, log_alpha, beta, state, "log_alpha", per_key=False)
    return _dense(gdn_varlen, q, k, v, (log_alpha, beta), state, chunk_size)


def _check_dense(q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor | None,
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
