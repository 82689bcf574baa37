"""SSE Triton kernels on one GPU against fla's chunk_gla measured in the same run (bf16, fresh
random data, triton.testing.do_bench medians). Prints one table (peer, ours, ratio) and writes it
as JSON with --out.

P5: SSE (N = 4, K = 1, GLA base) forward+backward vs fla chunk_gla forward+backward on the same
heads, B1 H16 d128, at every --T (target <= 1.5x from 2k to 64k); also forward vs chunk_gla forward. P6: time(64k) /
time(32k) of ours (target <= 2.1). The crossover: SSE against SDPA flash causal attention on the
same heads from 2k to 32k tokens, forward and forward+backward. Also the varlen GLA op alone on one
dense segment per row (the like-for-like kernel comparison with chunk_gla), the PyTorch
`sse_varlen` at the first T, and the decode step vs `sse_recurrent`. fla-core is optional (peer
rows are NaN without it).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as Fn
import triton

from scripts.common.bench import bench, crossover
from subquadratic.kernels.gla.triton_chunk import gla_varlen_triton
from subquadratic.kernels.sse import SSEState, router_topk, sse_recurrent, sse_varlen
from subquadratic.kernels.sse.triton_sse import sse_decode_triton, sse_triton

N_PARTS, TOPK = 4, 1


def sse_inputs(T, B=1, H=16, D=128, dtype=torch.bfloat16, grad=False):
    dev = "cuda"
    q1, q2 = (Fn.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dtype) for _ in range(2))
    k1, k2 = (Fn.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dtype) for _ in range(2))
    v = torch.randn(B, T, H, D, device=dev, dtype=dtype)
    g1, g2 = (Fn.logsigmoid(torch.randn(B, T, H, D, device=dev) + 3) / 16 for _ in range(2))
    logits = torch.randn(B, T, N_PARTS, device=dev)
    xs = [q1, k1, q2, k2, v, g1, g2, logits]
    if grad:
        xs = [x.requires_grad_() for x in xs]
    return xs


def sse_run(fn, T, bwd, **kw):
    xs = sse_inputs(T, grad=bwd)
    do = torch.randn_like(xs[4])

    def run():
        probs, sel = router_topk(xs[7], TOPK)
        if bwd:
            o, _ = fn(*xs[:7], probs, sel, **kw)
            o.backward(do)
        else:
            with torch.no_grad():
                fn(*xs[:7], probs, sel, **kw)
    return run


def gla_run(fn, T, bwd):
    q, k, _, _, v, g, _, _ = sse_inputs(T, grad=bwd)
    do = torch.randn_like(v)

    def run():
        if bwd:
            o = fn(q, k, v, g)
            o = o[0] if isinstance(o, tuple) else o
            o.backward(do.reshape(o.shape))  # the varlen op returns packed [B * T, H, D]
        else:
            with torch.no_grad():
                fn(q, k, v, g)
    return run


def ours_gla(q, k, v, g):
    B, T, H, D = q.shape
    cu = torch.arange(B + 1, device=q.device) * T
    f = lambda x: x.reshape(B * T, H, x.shape[-1])  # noqa: E731
    return gla_varlen_triton(f(q), f(k), f(v), f(g), cu_seqlens=cu)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--T", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--crossover", type=int, nargs="*", default=[2048, 4096, 8192, 16384, 32768],
                    help="lengths at which SSE is timed against SDPA flash (none: skip)")
    ap.add_argument("--no-pytorch", action="store_true", help="skip the PyTorch sse_varlen row")
    args = ap.parse_args()
    try:
        from fla.ops.gla import chunk_gla
    except ImportError:
        chunk_gla = None

    def fla_gla(q, k, v, g):
        return chunk_gla(q, k, v, g=g)

    def measure(make):
        try:
            return bench(make())
        except Exception as e:  # keep the table going
            print(f"failed: {e!r}", file=sys.stderr)
            return float("nan")
        finally:
            torch.cuda.empty_cache()

    kw = {"topk": TOPK}
    ours = {}
    for T in args.T:
        for what, bwd in (("fwd", False), ("fwd+bwd", True)):
            ours[("sse", what, T)] = measure(lambda T=T, bwd=bwd: sse_run(sse_triton, T, bwd, **kw))
            ours[("gla", what, T)] = measure(lambda T=T, bwd=bwd: gla_run(ours_gla, T, bwd))
            print(f"ours T={T:6} {what:8} SSE n{N_PARTS}k{TOPK} {ours[('sse', what, T)]:9.3f} ms   "
                  f"varlen GLA {ours[('gla', what, T)]:9.3f} ms", flush=True)
    T0 = args.T[0]
    rows = []
    for T in args.T:  # the peer at every length (P5's target holds at each)
        peer = {}
        for what, bwd in (("fwd", False), ("fwd+bwd", True)):
            peer[what] = measure(lambda T=T, bwd=bwd: gla_run(fla_gla, T, bwd)) if chunk_gla else float("nan")
            print(f"peer fla chunk_gla {what:8} T={T:6} {peer[what]:9.3f} ms", flush=True)
        for cid, what in (("P5", "fwd+bwd"), ("-", "fwd")):
            o = ours[("sse", what, T)]
            rows.append(dict(id=cid, what=f"SSE n{N_PARTS}k{TOPK} {what}", T=T, peer=f"fla chunk_gla {what}",
                             peer_ms=peer[what], ours_ms=o, ratio=o / peer[what]))
        for what in ("fwd", "fwd+bwd"):
            o = ours[("gla", what, T)]
            rows.append(dict(id="-", what=f"varlen GLA (dense) {what}", T=T, peer=f"fla chunk_gla {what}",
                             peer_ms=peer[what], ours_ms=o, ratio=o / peer[what]))
    for T in args.T[1:]:
        for kind in ("sse", "gla"):
            for what in ("fwd", "fwd+bwd"):
                r = ours[(kind, what, T)] / ours[(kind, what, T0)]
                rows.append(dict(id="P6", what=f"{kind} {what} time({T})/time({T0})", ratio=r))
    if not args.no_pytorch:
        for what, bwd in (("fwd", False), ("fwd+bwd", True)):
            t_ref = measure(lambda bwd=bwd: sse_run(sse_varlen, T0, bwd))
            o = ours[("sse", what, T0)]
            rows.append(dict(id="-", what=f"SSE {what} vs PyTorch", T=T0, peer="sse_varlen (PyTorch)",
                             peer_ms=t_ref, ours_ms=o, ratio=o / t_ref))
    if args.crossover:
        rows += crossover(f"SSE n{N_PARTS}k{TOPK}", lambda T, bwd: sse_run(sse_triton, T, bwd, **kw), args.crossover)
    # decode: one token, B1 H16 d128, N4 K1, from a random fp32 state
    x1 = sse_inputs(1)
    probs, sel = router_topk(x1[7], TOPK)
    st = SSEState(torch.randn(1, 16, 128, 128, device="cuda"), torch.randn(1, N_PARTS, 16, 128, 128, device="cuda"))
    with torch.no_grad():
        t_ours = bench(lambda: sse_decode_triton(*x1[:7], probs, sel, st, inplace=True))
        t_ref = bench(lambda: sse_recurrent(*x1[:7], probs, sel, st, inplace=True))
    rows.append(dict(id="-", what="decode step (inplace)", T=1, peer="sse_recurrent (PyTorch)", peer_ms=t_ref,
                     ours_ms=t_ours, ratio=t_ours / t_ref))
    print(f"\ntorch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, "
          f"B1 H16 d128 bf16, N={N_PARTS} K={TOPK} (decode: one token)")
    print(f"{'id':4} {'what':34} {'T':>6} {'peer':24} {'peer ms':>9} {'ours ms':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['id']:4} {r['what']:34} {r.get('T', ''):>6} {r.get('peer', ''):24} "
              f"{r.get('peer_ms', float('nan')):9.3f} {r.get('ours_ms', float('nan')):9.3f} {r['ratio']:6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(),
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
