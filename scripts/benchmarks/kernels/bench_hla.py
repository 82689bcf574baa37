"""HLA Triton kernels on one GPU against fla's linear attention measured in the same run (bf16,
fresh random data, triton.testing.do_bench medians). Prints one table (peer, ours, ratio) and
writes it as JSON.

P4: hla2 chunked forward vs fla chunk_simple_gla forward (target <= 2x); hla2 forward+backward vs
fla chunk_gla forward+backward with the per-head gate expanded per dimension (target <= 1x);
B1 H16 d128 T 32k. P6: time(64k) / time(32k) of each (target <= 2.1). The crossover: hla2 against
SDPA flash causal attention on the same heads from 2k to 32k tokens, forward and forward+backward.
Also ahla, the normalised form, one chunked linear-attention stage alone, and the fused decode
step vs the PyTorch recurrence. Needs fla-core for the peer rows (they are skipped without it).

Measured 2026-12-01, one H200, torch 2.11, Triton 3.6, fla 0.6.0, B1 H16 d128 bf16, one run:
hla2 fwd 1.186 ms (32k) / 2.317 ms (64k) vs chunk_simple_gla fwd 0.533 ms (32k): 2.23x (P4 <= 2x
missed by 11%: hla2 is two chunked linear attentions, each 1.14x simple_gla's forward); hla2
fwd+bwd 4.801 ms (32k) / 9.471 ms (64k) vs chunk_gla fwd+bwd 7.258 ms: 0.66x (met); P6 1.95 (fwd)
and 1.97 (fwd+bwd); faster than SDPA flash from 8k tokens on, forward and forward+backward.
docs/benchmarks.md has the whole table.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as Fn
import triton

from scripts.common.bench import bench, crossover
from subquadratic.kernels.gla.triton_chunk import chunk_linear_attention
from subquadratic.kernels.hla import hla_recurrent
from subquadratic.kernels.hla.triton_chunk import hla_chunked_triton
from subquadratic.kernels.hla.triton_fused_recurrent import hla_recurrent_triton


def inputs(T, B=1, H=16, D=128, dtype=torch.bfloat16, grad=False):
    q = Fn.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).to(dtype)
    k = Fn.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device="cuda", dtype=dtype)
    la = Fn.logsigmoid(torch.randn(B, T, H, device="cuda") + 3)
    xs = [q, k, v, la]
    if grad:
        xs = [x.requires_grad_() for x in xs]
    return xs


def fwd_fn(fn, T, **kw):
    xs = inputs(T)

    def run():
        with torch.no_grad():
            fn(*xs, **kw)
    return run


def fwdbwd_fn(fn, T, **kw):
    xs = inputs(T, grad=True)
    do = torch.randn_like(xs[2])

    def run():
        o = fn(*xs, **kw)
        o = o[0] if isinstance(o, tuple) else o
        o.backward(do)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--T", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--chunk", type=int, default=64, help="chunk of our kernels (a power of two >= 16)")
    ap.add_argument("--crossover", type=int, nargs="*", default=[2048, 4096, 8192, 16384, 32768],
                    help="lengths at which hla2 is timed against SDPA flash (none: skip)")
    args = ap.parse_args()
    try:
        from fla.ops.gla import chunk_gla
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        chunk_gla = chunk_simple_gla = None

    def simple_gla(q, k, v, la):
        return chunk_simple_gla(q, k, v, g=la)

    def gla(q, k, v, la):
        return chunk_gla(q, k, v, g=la[..., None].expand_as(k))

    def la_stage(q, k, v, la, chunk_size=64):
        return chunk_linear_attention(q, k, v, la, chunk_size=chunk_size)

    main_cases = [  # id, what, peer, ours, kwargs of ours, backward
        ("P4", "hla2 fwd", simple_gla, hla_chunked_triton, {}, False),
        ("P4b", "hla2 fwd+bwd", gla, hla_chunked_triton, {}, True),
    ]
    extra_cases = [
        ("-", "one LA stage fwd", simple_gla, la_stage, {}, False),
        ("-", "one LA stage fwd+bwd", gla, la_stage, {}, True),
        ("-", "ahla fwd", simple_gla, hla_chunked_triton, {"variant": "ahla"}, False),
        ("-", "ahla fwd+bwd", gla, hla_chunked_triton, {"variant": "ahla"}, True),
        ("-", "hla2 normalised fwd", simple_gla, hla_chunked_triton, {"normalize": True}, False),
        ("-", "hla2 normalised fwd+bwd", gla, hla_chunked_triton, {"normalize": True}, True),
    ]
    names = {simple_gla: "fla chunk_simple_gla fwd", gla: "fla chunk_gla fwd+bwd"}

    def measure(fn, T, bwd, **kw):
        if fn not in names:  # ours: the chunk of --chunk
            kw = {"chunk_size": args.chunk, **kw}
        try:
            return bench((fwdbwd_fn if bwd else fwd_fn)(fn, T, **kw))
        except Exception as e:  # keep the table going
            print(f"{getattr(fn, '__name__', fn)} T={T}: failed: {e!r}", file=sys.stderr)
            return float("nan")
        finally:
            torch.cuda.empty_cache()

    # ours first (P4 rows at every T for P6), then the two peers at the first T, then the rest
    ours_t = {}
    for T in args.T:
        for _, what, _, ours, kw, bwd in main_cases:
            ours_t[(what, T)] = measure(ours, T, bwd, **kw)
            print(f"ours {what:24} T={T:6} {ours_t[(what, T)]:9.3f} ms", flush=True)
    T0 = args.T[0]
    peer_t = {}
    if chunk_gla is not None:
        for peer in (simple_gla, gla):
            peer_t[peer] = measure(peer, T0, peer is gla)
            print(f"peer {names[peer]:30} T={T0:6} {peer_t[peer]:9.3f} ms", flush=True)
    rows = []
    for cid, what, peer, _, _, _ in main_cases:
        p, o = peer_t.get(peer, float("nan")), ours_t[(what, T0)]
        rows.append(dict(id=cid, what=what, T=T0, peer=names[peer], peer_ms=p, ours_ms=o, ratio=o / p))
    for what in ("hla2 fwd", "hla2 fwd+bwd"):
        for T in args.T[1:]:
            r = ours_t[(what, T)] / ours_t[(what, T0)]
            rows.append(dict(id="P6", what=f"{what} time({T})/time({T0})", ratio=r))
    # decode: one token after a 256-token prefix, B1 H16 d128
    for variant in ("hla2", "ahla"):
        x1 = inputs(1)
        _, st = hla_chunked_triton(*inputs(256), variant=variant)
        with torch.no_grad():
            t_ours = bench(lambda x1=x1, st=st, variant=variant: hla_recurrent_triton(*x1, st, variant=variant))
            t_ref = bench(lambda x1=x1, st=st, variant=variant: hla_recurrent(*x1, st, variant=variant))
        rows.append(dict(id="-", what=f"{variant} decode step", T=1, peer="PyTorch hla_recurrent",
                         peer_ms=t_ref, ours_ms=t_ours, ratio=t_ours / t_ref))
        print(f"-    {variant} decode step B1 H16 d128: PyTorch {t_ref:.4f} ms  ours {t_ours:.4f} ms", flush=True)
    if args.crossover:
        def hla2(T, bwd):
            return (fwdbwd_fn if bwd else fwd_fn)(hla_chunked_triton, T, chunk_size=args.chunk)
        rows += crossover("hla2", hla2, args.crossover)
    for _, what, peer, ours, kw, bwd in extra_cases:
        o = measure(ours, T0, bwd, **kw)
        p = peer_t.get(peer, float("nan"))
        rows.append(dict(id="-", what=what, T=T0, peer=names[peer], peer_ms=p, ours_ms=o, ratio=o / p))
        print(f"ours {what:24} T={T0:6} {o:9.3f} ms", flush=True)
    print(f"\ntorch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, "
          "B1 H16 d128 bf16 (decode: one token)")
    print(f"{'id':4} {'what':34} {'T':>6} {'peer':30} {'peer ms':>9} {'ours ms':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['id']:4} {r['what']:34} {r.get('T', ''):>6} {r.get('peer', ''):30} "
              f"{r.get('peer_ms', float('nan')):9.4f} {r.get('ours_ms', float('nan')):9.4f} {r['ratio']:6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
