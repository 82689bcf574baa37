"""Chunked linear attention on Triton, forward and backward: one kernel family for every decay kind.

    S_t = decay_t S_{t-1} + k_t^T v_t,    o_t = q_t S_t                  (per sequence, from S_0)

decay_t: none (SPLA's causal linear term), exp(g_t) per (token, KV head) (HLA's two stages, "simple
GLA"), or diag(exp g_t) per key dim (GLA, SSE's branches). `chunk_linear_attention` is the op
(dense [B, T, heads, dim] or packed variable-length [M, heads, dim] with cu_seqlens; GQA: query
head j reads KV head j // G); `gla_varlen_triton` keeps SSE's varlen GLA contract on it.

Kernels, chunk C (a power of two >= 16, 64 at most with per-key decay; 64 is the fast one):
  `triton_chunk_h` `chunk_fwd_h` the state walk (the state before every chunk, the final state),
                   which also writes the in-chunk cumulative sum gc of the log decays in the
                   forward, and its backward `chunk_bwd_dh`; calls of more than PIECE chunks take
                   the split walk (`piece_fwd_h`, `piece_carry`, `piece_fix`: pieces of PIECE
                   chunks walked side by side, then joined);
  `triton_chunk_o` `chunk_fwd_o` o = (q decay) h_c + A v, and its backward `chunk_bwd_dv`,
                   `chunk_bwd_dqk` (dq, dk and the decays' gradient); per-key decay adds the
                   intra-chunk scores by sub-chunks (`intra_fwd`, `intra_bwd_dA`, `intra_bwd`).
Forward: walk (with the cumsum), (intra,) output; backward: walk again (h is recomputed, not kept), reverse
walk, (intra,) dv, dq/dk/dg. Dense inputs need no chunk table; variable-length ones a device-side
table of fixed size (`chunk_table`): no host synchronisation on any path, every grid from shapes.
The states h are stored in the input dtype (fp32 for fp32 inputs) and accumulated in fp32; the
dots take the input dtype with fp32 accumulation (`precision` for fp32 operands: "ieee" exact,
"tf32" on the tensor cores; `triton_utils.dot_precision`). On the GPU every kernel is
autotuned once per (K, V, chunk, G, decay kind, precision) (the per-key intra ones over warps and
stages).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..triton_launch import jit
from ..triton_utils import TRITON_DTYPES, block_size, cdiv, dot_precision, launch
from ..utils import import_triton, new_output, new_outputs, run_function
from .triton_chunk_h import chunk_bwd_dh, chunk_fwd_h, piece_carry, piece_fix, piece_fwd_h
from .triton_chunk_o import BC, chunk_bwd_dqk, chunk_bwd_dv, chunk_fwd_o, intra_bwd, intra_bwd_dA, intra_fwd

triton, tl = import_triton()

#: Launch settings under the interpreter (on the GPU the kernels are autotuned): blocks along K / V
#: of the walks, along V of the output and backward kernels; warps.
BK_H = 64
BV_H = 64
BV_O = 64
BV_DQK = 64
WARPS = 4
WARPS_WIDE = 8  # kernels holding several [chunk, K] fp32 tiles

DECAY_KINDS = ("none", "head", "key")


#: Chunks of one piece of the split state walk (`triton_chunk_h`): a call of more tokens than one
#: piece walks its sequences' pieces side by side and joins them (the serial part is a sequence's
#: pieces, not its chunks); one piece or fewer take the single walk.
PIECE = 16
#: The decay kinds whose walks split. Per-key decay (SSE's GLA) pays for it: its walk also forms the
#: in-chunk cumulative decays (the walks of an 8k SSE-H first token: docs/benchmarks.md). The
#: split's two extra launches a call cost more than they save where the walk is cheap and the
#: forward is bound by the host's launches (HLA's two stages a layer, SPLA's causal linear term:
#: docs/benchmarks_history.md, 2026-12-04), so those keep the single walk; the kernels take every kind.
SPLIT_DECAYS = ("key",)


@dataclass(frozen=True)
class Pieces:
    """The split walk's NP piece slots: for varlen inputs `table`, a chunk table of PIECE * C-token
    chunks (its `ccu`: each sequence's first piece, `seq`: each piece's sequence); dense inputs have
    cdiv(NT, PIECE) pieces per sequence, found by arithmetic."""

    NP: int
    table: Chunks | None = None

    def args(self) -> tuple:
        t = self.table
        return (None, None, None) if t is None else (t.bos, t.n, t.seq)


@dataclass(frozen=True)
class Chunks:
    """Where the chunks are: C tokens each, NC of them (slots) over N sequences; dense: N = B
    sequences of T tokens (NT chunks each); varlen: cu [N + 1], ccu [N + 1] (first chunk of each
    sequence), and per chunk slot its first token `bos`, valid tokens `n` (0: unused) and sequence
    `seq` [NC]. `pieces`: where the split walk's pieces are (`with_pieces`), or None."""

    C: int
    N: int
    NC: int
    T: int = 0
    NT: int = 0
    cu: Tensor | None = None
    ccu: Tensor | None = None
    bos: Tensor | None = None
    n: Tensor | None = None
    seq: Tensor | None = None
    pieces: Pieces | None = None

    @property
    def varlen(self) -> bool:
        return self.cu is not None

    def seq_args(self) -> tuple:
        return self.cu, self.ccu, self.T, self.NT

    def chunk_args(self) -> tuple:
        return self.bos, self.n, self.T, self.NT


#: The most sequences whose chunk table one launch of `chunk_table_kernel` builds (their lengths in
#: one register tile); more take the PyTorch ops of `chunk_table_reference`.
TABLE_SEQS = 4096
#: Chunk slots a block of `chunk_table_kernel` fills at a time.
TABLE_SLOTS = 64


@jit
def _chunk_table(CU, CCU, BOS, CNT, SEQ, N, NC, C, BN: tl.constexpr, BJ: tl.constexpr):
    """One chunk table of C-token chunks: the chunks per sequence and their exclusive cumulative count
    ccu [N + 1] in registers, then per block of slots j: the sequence seg = #{s: ccu[s + 1] <= j}
    (clamped to N - 1), bos = cu[seg] + (j - ccu[seg]) C and the valid tokens n (0 past the last
    chunk), as `chunk_table_reference` computes them."""
    s = tl.arange(0, BN)
    real = s < N
    lo = tl.load(CU + s, mask=real, other=0)
    hi = tl.load(CU + s + 1, mask=real, other=0)
    nch = tl.where(real, (hi - lo + C - 1) // C, 0)
    incl = tl.cumsum(nch, 0)  # ccu[s + 1]
    total = tl.sum(nch, 0)
    tl.store(CCU + 1 + s, incl, mask=real)
    tl.store(CCU + s, 0, mask=s == 0)
    ends = tl.where(real, incl, 2147483647)  # past the sequences: never <= j
    for j0 in range(0, NC, BJ):
        j = j0 + tl.arange(0, BJ)
        seg = tl.minimum(tl.sum((ends[None, :] <= j[:, None]).to(tl.int32), 1), tl.maximum(N - 1, 0))
        before = tl.sum(tl.where(s[None, :] < seg[:, None], nch[None, :], 0), 1)  # ccu[seg]
        bos = tl.load(CU + seg) + (j - before) * C
        n = tl.minimum(tl.maximum(tl.load(CU + seg + 1) - bos, 0), C)
        n = tl.where(j < total, n, 0)
        tl.store(BOS + j, bos, mask=j < NC)
        tl.store(CNT + j, n, mask=j < NC)
        tl.store(SEQ + j, seg, mask=j < NC)


@jit
def chunk_table_kernel(CU, CCU, BOS, CNT, SEQ, NC, C, CCU2, BOS2, CNT2, SEQ2, NC2, C2, N, BN: tl.constexpr,
                       BJ: tl.constexpr):
    """Program 0: the chunk table of C-token chunks (`_chunk_table`); program 1 (a grid of two) that of
    C2-token chunks over the same sequences, the split walk's pieces."""
    if tl.program_id(0) == 0:
        _chunk_table(CU, CCU, BOS, CNT, SEQ, N, NC, C, BN, BJ)
    else:
        _chunk_table(CU, CCU2, BOS2, CNT2, SEQ2, N, NC2, C2, BN, BJ)


def chunk_table(cu: Tensor, M: int, C: int, piece: int = 0) -> Chunks:
    """The chunk table of packed sequences cut by cu [N + 1] (int32, on the device) over M tokens,
    with no host synchronisation: NC = M // C + N chunk slots (an upper bound of sum_s
    ceil(len_s / C)); slot j holds chunk j of the sequence-major chunk list, or nothing (0 valid
    tokens). With `piece` > 0 and M past one piece of `piece` chunks, also the split walk's pieces (the
    table of piece * C-token chunks, `with_pieces`'s) from the same launch. One launch (`chunk_table_kernel`)
    for up to TABLE_SEQS sequences, else the PyTorch ops of `chunk_table_reference`."""
    N = cu.numel() - 1
    if not 1 <= N <= TABLE_SEQS:
        ch = chunk_table_reference(cu, M, C)
        return with_pieces(ch, M, piece) if piece else ch
    split = piece and M > C * piece
    tables = [(C, M // C + N)] + ([(C * piece, M // (C * piece) + N)] if split else [])
    # every table's ccu, bos, n and seq from one allocation
    bufs = new_outputs([(n,) for _, NC in tables for n in (N + 1, NC, NC, NC)], cu.device, torch.int32)
    made = [[size, NC, *bufs[4 * i : 4 * i + 4]] for i, (size, NC) in enumerate(tables)]
    first = made[0]
    second = made[1] if split else first  # one program without pieces: any tensors stand in
    BN = block_size(N)
    # a [slots, sequences] tile of comparisons per block of slots: at most 16k elements
    chunk_table_kernel[(len(tables),)](cu, *first[2:], first[1], first[0], *second[2:], second[1], second[0], N, BN,
                                       max(4, min(TABLE_SLOTS, 16384 // BN)), num_warps=4)
    chunks = [Chunks(size, N, NC, cu=cu, ccu=ccu, bos=bos, n=n, seq=seq) for size, NC, ccu, bos, n, seq in made]
    return replace(chunks[0], pieces=Pieces(chunks[1].NC, chunks[1])) if split else chunks[0]


def chunk_table_reference(cu: Tensor, M: int, C: int) -> Chunks:
    """`chunk_table` in PyTorch ops (about twenty launches; the kernel's oracle)."""
    N = cu.numel() - 1
    NC = M // C + N
    lens = cu[1:] - cu[:-1]
    nch = (lens + C - 1) // C
    ccu = torch.cat([nch.new_zeros(1), nch.cumsum(0)])
    j = torch.arange(NC, device=cu.device, dtype=ccu.dtype)
    seg = torch.searchsorted(ccu[1:].contiguous(), j, right=True).clamp_(max=max(N - 1, 0))
    bos = cu[seg] + (j - ccu[seg]) * C
    n = (cu[seg + 1] - bos).clamp(0, C)
    n = torch.where(j < ccu[-1], n, torch.zeros_like(n))
    i32 = torch.int32
    return Chunks(C, N, NC, cu=cu, ccu=ccu.to(i32), bos=bos.to(i32).contiguous(), n=n.to(i32).contiguous(),
                  seq=seg.to(i32).contiguous())


def with_pieces(ch: Chunks, M: int, piece: int | None = None) -> Chunks:
    """`ch` with the split walk's pieces when its M tokens are more than one piece of `piece` chunks (None:
    PIECE) (varlen inputs: one launch, the piece table; `chunk_table` makes both tables in one), else `ch`."""
    piece = PIECE if piece is None else piece
    if M <= ch.C * piece:
        return ch
    if not ch.varlen:
        return replace(ch, pieces=Pieces(ch.N * cdiv(ch.NT, piece)))
    table = chunk_table(ch.cu, M, ch.C * piece)
    return replace(ch, pieces=Pieces(table.NC, table))


def _walk(k, v, gc, h0, ch: Chunks, G, decay, prec, want_final, g=None, gs=1.0):
    """The state before every chunk h [NC, H, K, V] (input dtype, fp32 for fp32) and the final
    states [N, H, K, V] fp32 (None unless `want_final`). With the raw log decays `g`, the walk also
    writes the in-chunk cumulative sum of gs g into `gc` (the forward); without, it reads `gc`. One walk
    per sequence, or with `ch.pieces` the split walk: its pieces side by side, their joins, the
    states' fix (three launches)."""
    M, H, K = k.shape
    V = v.shape[-1]
    dev = k.device
    h = new_output((ch.NC, H, K, V), dev, k.dtype)
    ht = new_output((ch.N, H, K, V), dev) if want_final else None
    blocks = {"BK": min(BK_H, block_size(K)), "BV": min(BV_H, block_size(V))}
    pc = ch.pieces
    if pc is None:
        launch(chunk_fwd_h, lambda m: (cdiv(K, m["BK"]), cdiv(V, m["BV"]), ch.N * H),
               (k, v, g, gc, h, h0, ht, *ch.seq_args(), gs, H, G, K, V, ch.C, decay, ch.varlen, h0 is not None,
                want_final, prec, g is not None), blocks, WARPS)
        return h, ht
    NP = pc.NP
    # the pieces' states and decays, the carried states (the walk's scratch): one allocation
    S, X, D, E = new_outputs([(NP, H, K, V), (NP, H, K, V)] + ([(NP, H, K), (ch.NC, H, K)] if decay else []),
                             dev) + ([] if decay else [None, None])
    launch(piece_fwd_h, lambda m: (cdiv(K, m["BK"]), cdiv(V, m["BV"]), NP * H),
           (k, v, g, gc, h, h0, S, D, E, ch.cu, ch.ccu, *pc.args(), ch.T, ch.NT, gs, H, G, K, V, ch.C, PIECE, decay,
            ch.varlen, h0 is not None, prec, g is not None), blocks, WARPS)
    BK, BV = blocks["BK"], blocks["BV"]
    kv = (cdiv(K, BK), cdiv(V, BV))
    # not autotuned: piece_fix adds into h (an autotuner's repeated runs would add again)
    piece_carry[(*kv, ch.N * H)](S, D, X, h0, ht, None if pc.table is None else pc.table.ccu, ch.NT, H, K, V,
                                 PIECE, decay, ch.varlen, h0 is not None, want_final, BK, BV, num_warps=WARPS)
    piece_fix[(NP * H * PIECE, *kv)](h, X, E, ch.cu, ch.ccu, *pc.args(), ch.T, ch.NT, H, K, V, ch.C, PIECE, decay,
                                     ch.varlen, BK, BV, num_warps=WARPS)
    return h, ht


class ChunkLinearAttention(torch.autograd.Function):
    """o, S_T = the op on packed tokens: q [M, HQ, K], k [M, H, K], v [M, H, V] of one dtype, g
    None / [M, H] / [M, H, K] fp32 log decays (the op decays by gs g), h0 [N, H, K, V] fp32 or None; o in
    `out_dtype`, S_T [N, H, K, V] fp32 (None unless `want_final`)."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, ch: Chunks, prec, out_dtype, want_final, gs):
        M, HQ, K = q.shape
        H, V = k.shape[1], v.shape[-1]
        G = HQ // H
        decay = 0 if g is None else (1 if g.dim() == 2 else 2)
        C, BK = ch.C, block_size(K)
        # the walk writes the in-chunk cumulative log decays gc as it goes (no launch of its own)
        gc, A = None, None
        if decay == 2:  # gc (saved) and the diagonal blocks' scores A (freed after the forward) apart
            gc, A = new_output(g.shape, g.device), new_output((ch.NC, H, C, C), g.device)
        elif decay:
            gc = new_output(g.shape, g.device)
        h, ht = _walk(k, v, gc, h0, ch, G, decay, prec, want_final, g, gs)
        if decay == 2:
            launch(intra_fwd, (ch.NC, C // BC, H), (q, k, gc, A, *ch.chunk_args(), H, K, C, BC, BK, ch.varlen, prec),
                   {}, WARPS)
        o = new_output((M, HQ, V), q.device, out_dtype)
        launch(chunk_fwd_o, lambda m: (cdiv(V, m["BV"]), ch.NC, H),
               (q, k, v, gc, h, A, o, *ch.chunk_args(), H, G, K, V, C, decay, ch.varlen, prec, BK),
               {"BV": min(BV_O, block_size(V))}, WARPS_WIDE)
        # A (fp32, C scores per token and head: twice q's bytes in bf16) is not saved: the backward
        # recomputes it with one intra_fwd launch, as it recomputes the chunk states h
        ctx.save_for_backward(q, k, v, gc, h0)
        ctx.ch, ctx.prec, ctx.decay, ctx.gs = ch, prec, decay, gs
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gc, h0 = ctx.saved_tensors
        ch, prec, decay = ctx.ch, ctx.prec, ctx.decay
        M, HQ, K = q.shape
        H, V = k.shape[1], v.shape[-1]
        G, C, BK = HQ // H, ch.C, block_size(K)
        dev = q.device
        do = q.new_zeros(M, HQ, V) if do is None else do.to(q.dtype).contiguous()
        dht = None if dht is None else dht.float().contiguous()
        g = getattr(ctx, "g", None)
        if gc is None and g is not None:  # a caller that kept the log decays g, not gc: the walk writes gc again
            gc = new_output(g.shape, dev)
        h, _ = _walk(k, v, gc, h0, ch, G, decay, prec, False, g, ctx.gs)
        dh = new_output(h.shape, dev, h.dtype)
        dh0 = new_output(h0.shape, dev) if h0 is not None and ctx.needs_input_grad[4] else None
        launch(chunk_bwd_dh, lambda m: (cdiv(K, m["BK"]), cdiv(V, m["BV"]), ch.N * H),
               (q, do, gc, dh, dht, dh0, *ch.seq_args(), H, G, K, V, C, decay, ch.varlen, dht is not None,
                dh0 is not None, prec), {"BK": min(BK_H, block_size(K)), "BV": min(BV_H, block_size(V))}, WARPS)
        dq_in = dk_in = A = None
        if decay == 2:
            A = new_output((ch.NC, H, C, C), dev)
            launch(intra_fwd, (ch.NC, C // BC, H), (q, k, gc, A, *ch.chunk_args(), H, K, C, BC, BK, ch.varlen, prec),
                   {}, WARPS)
            dA = new_output((ch.NC, H, C, C), dev)
            launch(intra_bwd_dA, (ch.NC, H), (v, do, dA, *ch.chunk_args(), H, V, C, ch.varlen, prec),
                   {"BV": min(BV_O, block_size(V))}, WARPS)
            dq_in, dk_in = new_output(q.shape, dev), new_output(k.shape, dev)
            launch(intra_bwd, (ch.NC, C // BC, H), (q, k, gc, dA, dq_in, dk_in, *ch.chunk_args(), H, K, C, BC, BK,
                                                     C // BC, ch.varlen, prec), {}, WARPS)
        dv = new_output(v.shape, dev, v.dtype)
        launch(chunk_bwd_dv, lambda m: (cdiv(V, m["BV"]), ch.NC, H),
               (q, k, gc, A, do, dh, dv, *ch.chunk_args(), H, G, K, V, C, decay, ch.varlen, prec, BK),
               {"BV": min(BV_O, block_size(V))}, WARPS_WIDE)
        dq, dk = new_output(q.shape, dev, q.dtype), new_output(k.shape, dev, k.dtype)
        dg = new_output(gc.shape, dev) if decay else None
        launch(chunk_bwd_dqk, (ch.NC, H),
               (q, k, v, gc, h, do, dh, dq_in, dk_in, dq, dk, dg, *ch.chunk_args(), ctx.gs, H, G, K, V, C, decay,
                ch.varlen, prec, BK), {"BV": min(BV_DQK, block_size(V))}, WARPS_WIDE)
        return dq, dk, dv, dg, dh0, None, None, None, None, None


def varlen_chunks(cu_seqlens: Tensor, M: int, chunk_size: int, kind: str = "key") -> Chunks:
    """The chunk table of M packed tokens in the sequences cu_seqlens [S + 1] (on the device, no host
    synchronisation), with the split walk's pieces where decays of `kind` ("none", "head", "key") split
    (`SPLIT_DECAYS`): what `ChunkLinearAttention` takes for a packed call."""
    ch = chunk_table(cu_seqlens.to(torch.int32).contiguous(), M, chunk_size, PIECE if kind in SPLIT_DECAYS else 0)
    return with_pieces(ch, M) if kind in SPLIT_DECAYS and ch.pieces is None else ch


def chunk_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    *,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    precision: str | None = None,
    out_dtype: torch.dtype | None = None,
    output_final_state: bool = True,
    g_scale: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """Chunked linear attention S_t = decay_t S_{t-1} + k_t^T v_t, o_t = q_t S_t on the Triton
    kernels (module docstring); differentiable in q, k, v, g and the initial state; no host
    synchronisation.

    Dense: q [B, T, HQ, K], k [B, T, H, K], v [B, T, H, V]; packed: q [M, HQ, K], k [M, H, K],
    v [M, H, V] with cu_seqlens [N + 1] (int, on the device; empty sequences keep their state).
    HQ = G * H: query head j reads the state of KV head j // G (computed once per KV head).
    g: None (no decay), [.., H] (one log decay <= 0 per token and KV head) or [.., H, K] (one per
    key dim; G = 1). initial_state: [N, H, K, V] (N = B or the number of sequences), None = 0.
    q's dtype (fp32 / bf16 / fp16) is the compute dtype (k, v are cast to it); `precision`: the
    dots' input precision for fp32 ("ieee" or "tf32"; None: "ieee"). chunk_size: a power of two
    >= 16 (<= 64 with per-key decay). `g_scale`: the log decays are g_scale * g (HLA's second stage decays
    by 2 log alpha: its g without a launch to double it; the gradient is g's). Returns (o [.., HQ, V] in
    `out_dtype` (default q's dtype), final states [N, H, K, V] fp32, or None without `output_final_state`)."""
    dense = cu_seqlens is None
    if q.dim() != (4 if dense else 3) or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k, v must be [B, T, heads, dim] (or [M, heads, dim] with cu_seqlens); got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if q.dtype not in TRITON_DTYPES:
        raise ValueError(f"the chunked linear-attention kernels take {TRITON_DTYPES} inputs, got {q.dtype}")
    *lead, HQ, K = q.shape
    H, V = k.shape[-2], v.shape[-1]
    if list(k.shape) != [*lead, H, K] or list(v.shape[:-1]) != [*lead, H] or HQ % H:
        raise ValueError(f"k must be [{', '.join(map(str, lead))}, H, {K}] and v [.., H, V] with H dividing "
                         f"HQ = {HQ}; got {list(k.shape)}, {list(v.shape)}")
    kind = "none" if g is None else ("head" if g.dim() == q.dim() - 1 else "key")
    if g is not None and list(g.shape) != [*lead, H] + ([K] if kind == "key" else []):
        raise ValueError(f"g must be [.., H] (per-head decay) or [.., H, K] (per-key decay) of k's tokens and "
                         f"heads; got {list(g.shape)} for k {list(k.shape)}")
    if kind == "key" and HQ != H:
        raise ValueError(f"per-key decay takes as many query heads as KV heads; got HQ = {HQ}, H = {H}")
    if chunk_size < 16 or chunk_size & (chunk_size - 1) or (kind == "key" and chunk_size > 64):
        raise ValueError(f"chunk_size must be a power of two >= 16 (at most 64 with per-key decay); got {chunk_size}")
    if K > 256:
        raise ValueError(f"key head dims up to 256 are supported; got {K}")
    dt = q.dtype
    prec = dot_precision(dt, precision)
    q, k, v = q.contiguous(), k.to(dt).contiguous(), v.to(dt).contiguous()
    g = None if g is None else g.float().contiguous()
    M = q.shape[0] * (q.shape[1] if dense else 1)
    if dense:
        B, T = lead
        ch = Chunks(chunk_size, B, B * cdiv(T, chunk_size), T=T, NT=cdiv(T, chunk_size))
        if kind in SPLIT_DECAYS:
            ch = with_pieces(ch, M)
    else:
        ch = varlen_chunks(cu_seqlens, M, chunk_size, kind)  # with the split walk's pieces where they split
    if initial_state is not None:
        if initial_state.shape != (ch.N, H, K, V):
            raise ValueError(f"initial_state must be [N={ch.N}, H={H}, K={K}, V={V}]; got "
                             f"{list(initial_state.shape)}")
        initial_state = initial_state.float().contiguous()
    if M == 0:  # nothing to attend: every state passes through
        o = v.new_zeros(*lead, HQ, V, dtype=out_dtype or dt)
        st = initial_state.clone() if initial_state is not None else q.new_zeros(ch.N, H, K, V, dtype=torch.float32)
        return o, st if output_final_state else None
    flat = (lambda x: x.reshape(M, *x.shape[2:])) if dense else (lambda x: x)  # noqa: E731
    o, st = run_function(ChunkLinearAttention, flat(q), flat(k), flat(v), None if g is None else flat(g),
                         initial_state, ch, prec, out_dtype or dt, output_final_state, float(g_scale))
    return o.view(*lead, HQ, V), st


def gla_varlen_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, cu_seqlens: Tensor,
                      initial_state: Tensor | None = None, chunk_size: int = 64,
                      out_dtype: torch.dtype | None = None, precision: str | None = None) -> tuple[Tensor, Tensor]:
    """Chunked GLA over packed variable-length segments on the Triton kernels, same contract as
    `gla_varlen` (differentiable in q, k, v, g and the initial states; no host synchronisation).

    q, k, g: [M, H, K], v: [M, H, V] (q's dtype is the compute dtype of the dots: bf16 / fp16 /
    fp32: exact unless `precision` is "tf32"), cu_seqlens: [S + 1] on the device, initial_state:
    [S, H, K, V]. K <= 128, V <= 256; chunk_size 16, 32 or 64. Returns (o [M, H, V] in `out_dtype` (default q's dtype),
    final states [S, H, K, V] fp32)."""
    K, V = q.shape[-1], v.shape[-1]
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    if K > 128 or V > 256:
        raise ValueError(f"head dims up to K = 128, V = 256 are supported; got K = {K}, V = {V}")
    return chunk_linear_attention(q, k, v, g, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                  chunk_size=chunk_size, out_dtype=out_dtype, precision=precision)
