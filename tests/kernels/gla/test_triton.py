"""The chunked linear-attention Triton kernels (`gla.triton_chunk`) vs the fp64 serial recurrence:
every decay kind (none, per head, per key dim), dense and packed variable-length inputs (empty
sequences, lengths not a multiple of the chunk), GQA groups, initial and final states, several K / V
blocks per head, values and gradients of q, k, v, the decays and the initial state (the loss reads
the final state too). Kernel outputs start as NaN, so anything left unwritten fails. On CPU it runs
under TRITON_INTERPRET=1 at small shapes; on CUDA the `gpu` tests run bf16 at real shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before Triton is imported
pytest.importorskip("triton")
from subquadratic.kernels.gla import gla_chunked, gla_recurrent, gla_varlen  # noqa: E402
from subquadratic.kernels.gla import triton_chunk as tc  # noqa: E402
from subquadratic.kernels.gla.triton_chunk import chunk_linear_attention, gla_varlen_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(x, ref):
    return ((x.double().cpu() - ref.double().cpu()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def loss_weights(shapes, device) -> list[torch.Tensor]:
    """The fixed random weights of `loss_of` for outputs of these shapes (None: no output)."""
    g = torch.Generator().manual_seed(123)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(device) for s in shapes if s is not None]


def loss_of(outs, weights=None):
    """A scalar that depends on every output element: sum(y * w) with fixed random weights w (made here,
    or given: the GPU tests make them before they forbid host synchronisation)."""
    ys = [y for y in outs if y is not None]
    weights = loss_weights([y.shape for y in ys], ys[0].device) if weights is None else weights
    return sum((y.double() * w).sum() for y, w in zip(ys, weights, strict=True))


def make(lead, HQ, H, K, V, kind, N, seed, shift=2.0):
    """Fresh fp64 inputs: q [*lead, HQ, K], k [*lead, H, K], v [*lead, H, V], the decays of `kind`
    (log sigmoid, shift -5: strong decay) and initial states [N, H, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(*lead, HQ, K), r(*lead, H, K) / K**0.5, r(*lead, H, V)
    g = {"none": None, "head": Fn.logsigmoid(r(*lead, H) + shift),
         "key": Fn.logsigmoid(r(*lead, H, K) + shift)}[kind]
    return [q, k, v, g, r(N, H, K, V)]


def oracle(q, k, v, g, h0, cu=None):
    """The serial recurrence in fp64 (`gla_recurrent`): each KV head's k, v, decay and state repeated
    over its G query heads; packed inputs one sequence at a time. Returns (o, final states)."""
    G = q.shape[-2] // k.shape[-2]
    g = torch.zeros_like(k) if g is None else (g[..., None].expand_as(k) if g.dim() < k.dim() else g)
    rep = lambda x: x.repeat_interleave(G, dim=-2)  # noqa: E731  (heads dim of [.., H, D])
    k, v, g = rep(k), rep(v), rep(g)
    h0 = None if h0 is None else h0.repeat_interleave(G, dim=1)
    if cu is None:
        o, S = gla_recurrent(q, k, v, g, h0)
        return o, S[:, ::G]
    os, Ss = [], []
    for s in range(cu.numel() - 1):
        a, b = int(cu[s]), int(cu[s + 1])
        o, S = gla_recurrent(q[None, a:b], k[None, a:b], v[None, a:b], g[None, a:b],
                             None if h0 is None else h0[s:s + 1])
        os.append(o[0])
        Ss.append(S[:, ::G])
    return torch.cat(os), torch.cat(Ss)


def run(fn, inputs, dtype, with_state):
    """Outputs and input gradients of loss_of(fn(...)) for the inputs cast to `dtype` on DEV (the
    decays and states stay fp32 for the kernels)."""
    hi = dtype == torch.float64
    xs = [None if x is None else x.detach().to(DEV, dtype if i < 3 or hi else torch.float32).clone().requires_grad_()
          for i, x in enumerate(inputs)]
    if not with_state:
        xs[4] = None
    outs = fn(*xs)
    loss_of(outs).backward()
    return list(outs), [x.grad for x in xs if x is not None]


def check(got, want, tol):
    (got_o, got_g), (ref_o, ref_g) = got, want
    for i, (a, b) in enumerate(zip(got_o, ref_o, strict=True)):
        assert torch.isfinite(a).all() and rel(a, b) <= tol, f"output {i}: {rel(a, b):.2e}"
    for i, (a, b) in enumerate(zip(got_g, ref_g, strict=True)):
        assert torch.isfinite(a).all() and rel(a, b) <= tol, f"grad {i}: {rel(a, b):.2e}"


DENSE = [  # kind, G, with_state, B, T, chunk
    ("none", 1, True, 2, 37, 16),
    ("none", 2, True, 1, 40, 16),
    ("none", 4, False, 2, 21, 16),
    ("head", 1, True, 2, 37, 16),
    ("head", 2, True, 1, 70, 32),
    ("head", 4, True, 1, 20, 16),
    ("key", 1, True, 2, 37, 16),
    ("key", 1, False, 1, 70, 64),
    ("none", 1, True, 1, 130, 128),
]


@pytest.mark.parametrize("kind,G,with_state,B,T,chunk", DENSE)
def test_dense_values_and_grads(kind, G, with_state, B, T, chunk):
    H, K, V = 2, 16, 32
    inputs = make((B, T), H * G, H, K, V, kind, B, seed=T + 7 * G + chunk)
    want = run(oracle, inputs, torch.float64, with_state)
    got = run(lambda q, k, v, g, h0: chunk_linear_attention(q, k, v, g, initial_state=h0, chunk_size=chunk),
              inputs, torch.float32, with_state)
    check(got, want, 1e-4)


@pytest.mark.parametrize("kind,G,lens,chunk,shift,with_state", [
    ("key", 1, [0, 37, 5, 16, 0], 16, 1.0, True),    # empty sequences, one sub-chunk per chunk
    ("key", 1, [45, 0, 33, 7], 32, -5.0, True),      # two sub-chunks, strong decay
    ("key", 1, [21, 3], 32, 0.0, False),             # zero initial states
    ("head", 2, [0, 37, 5, 16, 0], 16, -5.0, True),
    ("none", 2, [19, 0, 40], 16, 0.0, True),
])
def test_varlen_values_and_grads(kind, G, lens, chunk, shift, with_state):
    H = 2
    inputs = make((sum(lens),), H * G, H, 16, 32, kind, len(lens), seed=len(lens) + chunk, shift=shift)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    want = run(lambda *x: oracle(*x, cu), inputs, torch.float64, with_state)
    cud = cu.to(DEV)
    got = run(lambda q, k, v, g, h0: chunk_linear_attention(q, k, v, g, initial_state=h0, cu_seqlens=cud,
                                                            chunk_size=chunk), inputs, torch.float32, with_state)
    check(got, want, 1e-4)
    if kind == "key":  # SSE's entry point: the same values
        with torch.no_grad():
            xs = [x.float().to(DEV) for x in inputs]
            o, h = gla_varlen_triton(*xs[:4], cu_seqlens=cud, initial_state=xs[4] if with_state else None,
                                     chunk_size=chunk)
        assert rel(o, want[0][0]) <= 1e-4 and rel(h, want[0][1]) <= 1e-4


@pytest.mark.parametrize("piece", [2, 3])
@pytest.mark.parametrize("kind,G,lens,chunk,with_state", [
    ("key", 1, [0, 150, 5, 16, 0, 64], 16, True),     # empty sequences, one-piece and many-piece ones
    ("head", 2, [70, 0, 33], 16, True),
    ("none", 2, [130, 7], 32, False),
    ("key", 1, None, 16, True),                        # dense: B = 2 sequences of 100 tokens
    ("head", 4, None, 32, False),
])
def test_split_walk_values_and_grads(monkeypatch, piece, kind, G, lens, chunk, with_state):
    """Calls of more tokens than one piece walk pieces of `piece` chunks side by side and join them
    (`with_pieces`): values, final states and gradients as the oracle's, dense and packed, with
    sequences shorter than a piece, empty ones, and pieces cut short by their sequence's end."""
    monkeypatch.setattr(tc, "PIECE", piece)
    monkeypatch.setattr(tc, "SPLIT_DECAYS", ("none", "head", "key"))  # the kernels take every kind
    H = 2
    if lens is None:
        inputs = make((2, 100), H * G, H, 16, 32, kind, 2, seed=piece + chunk)
        want = run(oracle, inputs, torch.float64, with_state)
        fn = lambda q, k, v, g, h0: chunk_linear_attention(q, k, v, g, initial_state=h0, chunk_size=chunk)  # noqa: E731
    else:
        inputs = make((sum(lens),), H * G, H, 16, 32, kind, len(lens), seed=len(lens) + piece)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        want = run(lambda *x: oracle(*x, cu), inputs, torch.float64, with_state)
        cud = cu.to(DEV)
        fn = lambda q, k, v, g, h0: chunk_linear_attention(q, k, v, g, initial_state=h0, cu_seqlens=cud,  # noqa: E731
                                                           chunk_size=chunk)
    M = inputs[0].shape[0] * (inputs[0].shape[1] if lens is None else 1)
    assert M > chunk * piece  # the split walk runs
    check(run(fn, inputs, torch.float32, with_state), want, 1e-4)


@pytest.mark.parametrize("scale", [2.0, 0.5])
@pytest.mark.parametrize("kind,G,lens", [("head", 2, None), ("key", 1, None), ("head", 1, [70, 0, 33]),
                                          ("key", 1, [0, 150, 5])])
def test_g_scale_decays_by_a_multiple_of_g(monkeypatch, scale, kind, G, lens):
    """`g_scale` s: the op on the decays s g (HLA's second stage: 2 log alpha), values, final states and
    gradients (g's: s times the decays') as the oracle's on s g; the single walk (dense, one decay per head)
    and the split walk (pieces of 2 chunks: the rest)."""
    monkeypatch.setattr(tc, "PIECE", 2)
    if lens is not None:
        monkeypatch.setattr(tc, "SPLIT_DECAYS", ("none", "head", "key"))
    H, chunk = 2, 16
    lead = (2, 45) if lens is None else (sum(lens),)
    inputs = make(lead, H * G, H, 16, 32, kind, 2 if lens is None else len(lens), seed=int(scale * 10) + G)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    want = run(lambda q, k, v, g, h0: oracle(q, k, v, g * scale, h0, cu), inputs, torch.float64, True)
    cud = None if cu is None else cu.to(DEV)
    got = run(lambda q, k, v, g, h0: chunk_linear_attention(q, k, v, g, initial_state=h0, cu_seqlens=cud,
                                                            chunk_size=chunk, g_scale=scale),
              inputs, torch.float32, True)
    check(got, want, 1e-4)


def test_which_walks_split(monkeypatch):
    """Only per-key decay takes the split walk, and only past one piece."""
    seen, with_pieces = [], tc.with_pieces
    monkeypatch.setattr(tc, "with_pieces", lambda ch, M: seen.append(M) or ch)
    for kind, T in (("key", 40), ("key", 20), ("head", 40), ("none", 40)):
        q, k, v, g, _ = (None if x is None else x.float().to(DEV) for x in make((1, T), 2, 2, 16, 16, kind, 1, seed=2))
        chunk_linear_attention(q, k, v, g, chunk_size=16)
    assert seen == [40, 20]  # with_pieces itself keeps a call of one piece or fewer on the single walk
    assert with_pieces(tc.Chunks(16, 1, 2, T=20, NT=2), 20).pieces is None
    assert with_pieces(tc.Chunks(16, 2, 40, T=320, NT=20), 640).pieces.NP == 4  # two pieces per sequence


def test_per_key_decay_both_diagonal_forms():
    """The intra-chunk kernels take a sub-chunk's diagonal block as one dot when its decay span is
    at most 30 and pairwise otherwise: a chunk whose first sub-chunks decay weakly (span ~2) and whose
    last ones decay hard (span ~90, where the dot's exp(span) factor would not be exact) takes both
    forms in one launch; both match the oracle, values and gradients."""
    inputs = make((1, 64), 2, 2, 16, 32, "key", 1, seed=5)
    g = inputs[3]
    g[:, 32:] = Fn.logsigmoid(g[:, 32:].new_empty(g[:, 32:].shape).normal_(generator=torch.Generator().manual_seed(6))
                              - 6.0)
    assert (g[0, :16].sum(0).neg().max() < 30) and (g[0, 48:63].sum(0).neg().min() > 30)
    want = run(oracle, inputs, torch.float64, True)
    got = run(lambda q, k, v, g, h0: chunk_linear_attention(q, k, v, g, initial_state=h0, chunk_size=64),
              inputs, torch.float32, True)
    check(got, want, 1e-4)


@pytest.mark.parametrize("kind,G", [("none", 2), ("head", 1), ("key", 1)])
def test_several_blocks_per_head(monkeypatch, kind, G):
    """K = 32, V = 48 in blocks of 16: several K and V blocks in the walks, several V blocks in the
    output and backward kernels."""
    for name in ("BK_H", "BV_H", "BV_O", "BV_DQK"):
        monkeypatch.setattr(tc, name, 16)
    H = 2
    inputs = make((1, 40), H * G, H, 32, 48, kind, 1, seed=3)
    want = run(oracle, inputs, torch.float64, True)
    got = run(lambda q, k, v, g, h0: chunk_linear_attention(q, k, v, g, initial_state=h0, chunk_size=16),
              inputs, torch.float32, True)
    check(got, want, 1e-4)


def test_without_final_state_and_without_gradients():
    """output_final_state=False returns None and the gradients through o alone; forward under
    no_grad gives the same o."""
    inputs = make((2, 30), 4, 2, 16, 16, "head", 2, seed=11)
    want_o, _ = oracle(*inputs)
    xs = [x.float().to(DEV).requires_grad_() for x in inputs]
    o, st = chunk_linear_attention(*xs[:4], initial_state=xs[4], chunk_size=16, output_final_state=False)
    assert st is None and rel(o, want_o) <= 1e-4
    loss_of([o]).backward()
    ref = [x.detach().clone().requires_grad_() for x in inputs]
    loss_of([oracle(*ref)[0]]).backward()
    for a, b in zip(xs, ref, strict=True):
        assert rel(a.grad, b.grad) <= 1e-4
    with torch.no_grad():
        o2, _ = chunk_linear_attention(*xs[:4], initial_state=xs[4], chunk_size=16)
    assert torch.equal(o2, o.detach())


def test_saves_inputs_and_decays_only():
    """The backward's memory: a call with per-key decays saves q, k, v, the in-chunk cumulative decays
    (fp32, like k) and the initial state, and neither the chunk states nor the intra-chunk scores A
    (C fp32 per token and head), which the backward recomputes (values and gradients: the tests above)."""
    B, T, H, K, V, chunk = 1, 64, 2, 16, 16, 32
    inputs = make((B, T), H, H, K, V, "key", B, seed=5)
    xs = [x.float().to(DEV).requires_grad_() for x in inputs]
    saved: list[int] = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, _ = chunk_linear_attention(*xs[:4], initial_state=xs[4], chunk_size=chunk)
    per_token = T * H * 4  # fp32 elements per (token, head), times these bytes
    want = per_token * (K + K + V + K) + B * H * K * V * 4  # q, k, v, the cumulative decays; h0
    assert sum(saved) <= want, (sum(saved), want)
    loss_of([o]).backward()
    assert all(x.grad is not None for x in xs)


def test_empty_inputs_pass_the_state_through():
    q, k, v, g, h0 = (x.float().to(DEV) for x in make((0,), 2, 2, 16, 16, "key", 3, seed=1))
    o, st = chunk_linear_attention(q, k, v, g, initial_state=h0, cu_seqlens=torch.zeros(4, dtype=torch.int32,
                                                                                     device=DEV))
    assert o.shape == (0, 2, 16) and torch.equal(st, h0)


def test_inputs_the_kernels_refuse_are_named():
    q, k, v, g, _ = (x.float() for x in make((1, 8), 4, 2, 16, 16, "key", 1, seed=0))
    with pytest.raises(ValueError, match="per-key decay takes as many query heads"):
        chunk_linear_attention(q, k, v, g)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_linear_attention(q, k, v, None, chunk_size=24)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_linear_attention(q[:, :, :2], k, v, g, chunk_size=128)
    with pytest.raises(ValueError, match="inputs, got torch.float64"):
        chunk_linear_attention(q.double(), k, v)
    with pytest.raises(ValueError, match="g must be"):
        chunk_linear_attention(q, k, v, g[..., :3])
    with pytest.raises(ValueError, match="initial_state"):
        chunk_linear_attention(q, k, v, initial_state=torch.zeros(2, 2, 16, 16))
    with pytest.raises(ValueError, match="precision"):
        chunk_linear_attention(q, k, v, precision="fp32")


# ---------------------------------------------------------------------------
# GPU: real shapes in bf16
# ---------------------------------------------------------------------------


def torch_reference(q, k, v, g, h0, cu=None):
    """The PyTorch chunked forms (gla_chunked / gla_varlen) with GQA by repetition: a fast exact
    reference at real lengths."""
    G = q.shape[-2] // k.shape[-2]
    g = torch.zeros_like(k) if g is None else (g[..., None].expand_as(k) if g.dim() < k.dim() else g)
    rep = lambda x: x.repeat_interleave(G, dim=-2)  # noqa: E731
    h0 = h0.repeat_interleave(G, dim=1)
    if cu is None:
        o, S = gla_chunked(q, rep(k), rep(v), rep(g), h0)
    else:
        o, S = gla_varlen(q, rep(k), rep(v), rep(g), cu_seqlens=cu, initial_state=h0)
    return o, S[:, ::G]


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind,G", [("none", 1), ("none", 4), ("head", 1), ("head", 4), ("key", 1)])
def test_gpu_dense_bf16(kind, G, D):
    """bf16 at B2 T = 4096 (not a multiple of the chunk: 4096 - 37) against the PyTorch chunked form
    in fp64 on the same bf16-rounded inputs, q and k L2-normalised; values and gradients within
    1e-2; no host synchronisation."""
    B, T, H = 2, 4096 - 37, 2
    q, k, v, g, h0 = make((B, T), H * G, H, D, D, kind, B, seed=D + G, shift=3.0)
    q, k = Fn.normalize(q, dim=-1), Fn.normalize(k, dim=-1)
    inputs = [q.bfloat16(), k.bfloat16(), v.bfloat16(), g, h0]
    want = run(torch_reference, [None if x is None else x.double() for x in inputs], torch.float64, True)
    xs = [None if x is None else x.detach().to(DEV, torch.float32 if i >= 3 else torch.bfloat16).requires_grad_()
          for i, x in enumerate(inputs)]
    with torch.no_grad():  # the output shapes, for the loss weights made before host syncs are forbidden
        shapes = [None if y is None else y.shape for y in chunk_linear_attention(*xs[:4], initial_state=xs[4])]
    weights = loss_weights(shapes, DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = chunk_linear_attention(*xs[:4], initial_state=xs[4])
        loss = loss_of(outs, weights)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check((list(outs), [x.grad for x in xs if x is not None]), want, 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", ["key", "head"])
def test_gpu_varlen_bf16(kind, D):
    """bf16 packed sequences (five, one empty, ~4k tokens) against the fp64 PyTorch varlen form on
    the same bf16-rounded inputs; values and gradients within 1e-2; no host synchronisation."""
    lens = [1500, 0, 2048, 77, 471]
    q, k, v, g, h0 = make((sum(lens),), 4, 4, D, D, kind, len(lens), seed=D, shift=3.0)
    q, k = Fn.normalize(q, dim=-1), Fn.normalize(k, dim=-1)
    inputs = [q.bfloat16(), k.bfloat16(), v.bfloat16(), g, h0]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    want = run(lambda *x: torch_reference(*x, cu), [x.double() for x in inputs], torch.float64, True)
    xs = [x.detach().to(DEV, torch.float32 if i >= 3 else torch.bfloat16).requires_grad_()
          for i, x in enumerate(inputs)]
    with torch.no_grad():
        shapes = [None if y is None else y.shape
                  for y in chunk_linear_attention(*xs[:4], initial_state=xs[4], cu_seqlens=cu)]
    weights = loss_weights(shapes, DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = chunk_linear_attention(*xs[:4], initial_state=xs[4], cu_seqlens=cu)
        loss_of(outs, weights).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check((list(outs), [x.grad for x in xs]), want, 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_gpu_fp32_precision_reaches_the_dots():
    """fp32 inputs: "ieee" matches the fp64 reference to 1e-5, "tf32" to 1e-2 and measurably less
    well (the argument reaches the tensor cores)."""
    q, k, v, g, h0 = make((1, 2048), 8, 2, 128, 128, "head", 1, seed=5, shift=3.0)
    q, k = Fn.normalize(q, dim=-1), Fn.normalize(k, dim=-1)
    dev = [x.to(DEV) for x in (q, k, v, g, h0)]
    want, _ = torch_reference(*dev)
    errs = {}
    for prec in ("ieee", "tf32"):
        o, _ = chunk_linear_attention(*(x.float() for x in dev[:4]), initial_state=dev[4].float(), precision=prec)
        errs[prec] = rel(o, want)
    assert errs["ieee"] <= 1e-5 and errs["tf32"] <= 1e-2 and errs["tf32"] > 4 * errs["ieee"], errs


@pytest.mark.parametrize("lens", [[5], [0, 17, 64, 0, 3], [64] * 3 + [1], list(range(0, 300, 7)),
                                  [i % 97 for i in range(0, 5000, 3)]], ids=["1", "5", "4", "43", "1667"])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("spare", [0, 37])
def test_chunk_table_kernel_matches_the_torch_ops(lens, chunk, spare):
    """The chunk table in one launch: the PyTorch ops' table exactly, with empty sequences, a
    sequence of one token, many sequences (a tile of several slots per block), and packed tokens
    past the last sequence (M > cu[-1]); with the split walk's piece table from the same launch."""
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEV)
    M = int(cu[-1]) + spare
    got, want = tc.chunk_table(cu, M, chunk), tc.chunk_table_reference(cu, M, chunk)
    assert got.pieces is None
    tables = [(got, want)]
    # with the split walk's pieces of 4 chunks from the same launch: the table of 4 C-token chunks
    with_pieces = tc.chunk_table(cu, M, chunk, 4)
    if M > 4 * chunk:
        piece = with_pieces.pieces.table
        tables += [(with_pieces, want), (piece, tc.chunk_table_reference(cu, M, 4 * chunk))]
        assert with_pieces.pieces.NP == piece.NC
    else:
        assert with_pieces.pieces is None
    for a_table, b_table in tables:
        assert (a_table.C, a_table.N, a_table.NC) == (b_table.C, b_table.N, b_table.NC)
        for name in ("ccu", "bos", "n", "seq"):
            a, b = getattr(a_table, name), getattr(b_table, name)
            assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), name
