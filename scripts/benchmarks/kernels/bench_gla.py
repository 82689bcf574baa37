"""The chunked linear-attention kernels of `kernels/gla` on one GPU, against fla measured in the same
run (bf16, fresh random data, triton.testing.do_bench medians), and SPLA's causal linear term on
them against its former PyTorch form. Prints one table (peer, ours, ratio, and the floor that
bytes and flops set on an H200) and writes it as JSON with --out.

  python -m scripts.benchmarks.kernels.bench_gla [--T 32768 65536] [--breakdown] [--out results.json]
  python -m scripts.benchmarks.kernels.bench_gla --quick       # tiny shapes on the CPU interpreter (a smoke run)

Rows, B1 H16 d128 unless said:
- each decay kind of `chunk_linear_attention`, forward and forward+backward: none vs fla
  chunk_simple_gla without a gate, per-head vs chunk_simple_gla (forward; fla 0.6 refuses its gated
  backward on Hopper with Triton < 3.7.1, so forward+backward is against chunk_gla with the gate
  expanded per dim), per-key vs chunk_gla; per-key also in the packed varlen form SSE calls;
  time(64k) / time(32k) of each (P6: linear in T);
- SPLA's causal linear term (`kernels/spla/triton_parallel.causal_linear_term`), B1 HQ32 H8 d128,
  32k new tokens, phi(q), phi(k) given: on the kernels (bf16 operands) vs the chunked PyTorch
  einsums in fp32 it replaced (`old_causal_linear_term` below), forward and forward+backward.
fla-core is optional (its columns are NaN without it). --breakdown adds each kernel's device time
(torch profiler) for one call of every kind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as Fn

if not torch.cuda.is_available():  # --quick: the Triton kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from scripts.common.bench import bench  # noqa: E402
from subquadratic.kernels.gla.triton_chunk import chunk_linear_attention, gla_varlen_triton  # noqa: E402
from subquadratic.kernels.spla.triton_parallel import causal_linear_term  # noqa: E402

#: H200 anchors (docs/benchmarks.md): device copy 4.3 TB/s counting reads and writes, bf16 matmul
#: 680 TFLOP/s on large shapes. A row's floor is max(bytes / bandwidth, flops / peak).
BANDWIDTH = 4.3e12
PEAK = 680e12


def old_causal_linear_term(phiq, phik, v, sbar, valid, chunk: int = 64):
    """The former PyTorch form of the term (fp32 einsums over chunks), kept here as the baseline:
    phiq [B, H, G, T, D], phik, v [B, H, T, D], valid [B, T] -> (o [B, H, G, T, D], new Sbar)."""
    B, H, G, T, D = phiq.shape
    phik = phik * valid[:, None, :, None]
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:
        phiq, phik, v = (Fn.pad(x, (0, 0, 0, pad)) for x in (phiq, phik, v))
    qc, kc, vc = phiq.view(B, H, G, n, chunk, D), phik.view(B, H, n, chunk, D), v.view(B, H, n, chunk, D)
    kv = torch.einsum("bhncd,bhnce->bhnde", kc, vc)
    states = torch.cumsum(kv, dim=2) - kv + sbar[:, :, None]
    inter = torch.einsum("bhgncd,bhnde->bhgnce", qc, states)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    a = torch.einsum("bhgncd,bhnsd->bhgncs", qc, kc) * causal
    intra = torch.einsum("bhgncs,bhnse->bhgnce", a, vc)
    return (inter + intra).reshape(B, H, G, n * chunk, D)[..., :T, :], sbar + kv.sum(2)


def floor_ms(T, B, HQ, H, K, V, kind, bwd, C=64, in_bytes=2, out_bytes=2) -> float:
    """The H200 floor of one call (ms): its compulsory traffic (inputs, outputs, the chunk states
    written once and read once per pass) at BANDWIDTH, or its tensor-core flops at PEAK."""
    M, NC = B * T, B * math.ceil(T / C)
    qkv = M * (HQ * K + H * K + H * V) * in_bytes
    g = {"none": 0, "head": M * H * 4, "key": M * H * K * 4}[kind]
    o = M * HQ * V * out_bytes
    states = NC * H * K * V * in_bytes
    byts = qkv + 2 * g + o + 2 * states                          # forward: read inputs, write o, h twice
    flops = 2 * NC * C * (H * K * V + HQ * (K * V + C * K + C * V))
    if bwd:  # again the walk; the reverse walk (q, do); dv (k, q, do); dq, dk (q, k, v, do, h, dh)
        byts += qkv + 2 * states + 2 * o + qkv + 2 * g + 4 * states + M * (HQ * K + H * K + H * V) * in_bytes
        flops *= 3
    return max(byts / BANDWIDTH, flops / PEAK) * 1e3


def la_inputs(T, B, HQ, H, D, kind, dtype, dev, grad=False):
    q = Fn.normalize(torch.randn(B, T, HQ, D, device=dev), dim=-1).to(dtype)
    k = Fn.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device=dev, dtype=dtype)
    g = {"none": None, "head": Fn.logsigmoid(torch.randn(B, T, H, device=dev) + 3),
         "key": Fn.logsigmoid(torch.randn(B, T, H, D, device=dev) + 3) / 16}[kind]
    xs = [q, k, v, g]
    return [x.requires_grad_() if grad and x is not None else x for x in xs]


def timed(fn, xs, bwd):
    """A callable running fn(*xs) without gradients, or forward + backward on a fixed random do."""
    if not bwd:
        def run():
            with torch.no_grad():
                fn(*xs)
        return run
    o = fn(*xs)
    o = o[0] if isinstance(o, tuple) else o
    do = torch.randn_like(o)

    def run():
        out = fn(*xs)
        (out[0] if isinstance(out, tuple) else out).backward(do)
    return run


def measure(make, bwd):
    try:
        return bench(timed(*make(), bwd))
    except Exception as e:  # noqa: BLE001 (keep the table going)
        print(f"failed: {e!r}", file=sys.stderr)
        return float("nan")
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def fla_peers():
    try:
        from fla.ops.gla import chunk_gla
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return {}
    return {
        "none": ("fla chunk_simple_gla (no gate)", lambda q, k, v, g: chunk_simple_gla(q, k, v)),
        "head": ("fla chunk_simple_gla", lambda q, k, v, g: chunk_simple_gla(q, k, v, g=g)),
        "head_bwd": ("fla chunk_gla (gate per dim)",
                     lambda q, k, v, g: chunk_gla(q, k, v, g=g[..., None].expand_as(k))),
        "key": ("fla chunk_gla", lambda q, k, v, g: chunk_gla(q, k, v, g=g)),
    }


def ours(q, k, v, g):
    return chunk_linear_attention(q, k, v, g)


def ours_varlen(q, k, v, g):  # one segment per row, packed, as SSE calls it
    B, T = q.shape[:2]
    cu = torch.arange(B + 1, device=q.device, dtype=torch.int32) * T
    o, _ = gla_varlen_triton(*(x.flatten(0, 1) for x in (q, k, v, g)), cu_seqlens=cu)
    return o


def kernel_rows(lengths, B, H, D, dtype, dev, peers):
    rows, ours_t = [], {}
    cases = [("none", ours), ("head", ours), ("key", ours), ("key varlen", ours_varlen)]
    for T in lengths:
        for name, fn in cases:
            kind = name.split()[0]
            for bwd in (False, True):
                make = lambda T=T, kind=kind, fn=fn, bwd=bwd: (fn, la_inputs(T, B, H, H, D, kind, dtype, dev, bwd))  # noqa: E731
                t = measure(make, bwd)
                ours_t[(name, bwd, T)] = t
                what = f"{name} decay {'fwd+bwd' if bwd else 'fwd'}"
                print(f"ours {what:28} T={T:6} {t:9.3f} ms", flush=True)
    T0 = lengths[0]
    for name, _ in cases:
        kind = name.split()[0]
        for bwd in (False, True):
            what = f"{name} decay {'fwd+bwd' if bwd else 'fwd'}"
            key = f"{kind}_bwd" if bwd and kind == "head" else kind
            peer_name, peer = peers.get(key, ("fla (not installed)", None))
            p = float("nan") if peer is None else measure(
                lambda peer=peer, kind=kind, bwd=bwd: (peer, la_inputs(T0, B, H, H, D, kind, dtype, dev, bwd)), bwd)
            o = ours_t[(name, bwd, T0)]
            fl = floor_ms(T0, B, H, H, D, D, kind, bwd)
            rows.append(dict(id="-", what=what, T=T0, peer=peer_name, peer_ms=p, ours_ms=o, ratio=o / p,
                             floor_ms=fl))
            for T in lengths[1:]:
                rows.append(dict(id="P6", what=f"{what} time({T})/time({T0})", ratio=ours_t[(name, bwd, T)] / o))
    return rows


def spla_rows(T, B, HQ, H, D, dtype, dev):
    """The causal linear term, new vs old, forward and forward+backward, phi(q), phi(k) given."""
    G = HQ // H

    def new(grad):
        phiq = torch.softmax(torch.randn(B, T, HQ, D, device=dev), -1).to(dtype)
        phik = torch.softmax(torch.randn(B, T, H, D, device=dev), -1).to(dtype)
        v = torch.randn(B, T, H, D, device=dev, dtype=dtype)
        xs = [x.requires_grad_(grad) for x in (phiq, phik, v)]
        sbar, valid = torch.zeros(B, H, D, D, device=dev), torch.ones(B, T, dtype=torch.bool, device=dev)
        return (lambda a, b, c: causal_linear_term(a, b, c, sbar, valid)), xs

    def old(grad):
        phiq = torch.softmax(torch.randn(B, H, G, T, D, device=dev), -1)
        phik = torch.softmax(torch.randn(B, H, T, D, device=dev), -1)
        v = torch.randn(B, H, T, D, device=dev)
        xs = [x.requires_grad_(grad) for x in (phiq, phik, v)]
        sbar, valid = torch.zeros(B, H, D, D, device=dev), torch.ones(B, T, dtype=torch.bool, device=dev)
        return (lambda a, b, c: old_causal_linear_term(a, b, c, sbar, valid, min(64, T))), xs

    rows = []
    for bwd in (False, True):
        t_old, t_new = measure(lambda bwd=bwd: old(bwd), bwd), measure(lambda bwd=bwd: new(bwd), bwd)
        what = f"SPLA causal linear term HQ{HQ} H{H} {'fwd+bwd' if bwd else 'fwd'}"
        fl = floor_ms(T, B, HQ, H, D, D, "none", bwd, out_bytes=4)
        rows.append(dict(id="-", what=what, T=T, peer="former PyTorch form (fp32 einsums)", peer_ms=t_old,
                         ours_ms=t_new, ratio=t_new / t_old, floor_ms=fl))
        print(f"{what:44} T={T:6} old {t_old:9.3f} ms  new {t_new:9.3f} ms  floor {fl:.3f} ms", flush=True)
    # the two forms agree (fp32 inputs; the kernels exact): the check the smoke run asserts on
    gen = torch.Generator().manual_seed(0)
    Tc = min(T, 300)
    phiq = torch.softmax(torch.randn(B, Tc, HQ, D, generator=gen), -1).to(dev)
    phik = torch.softmax(torch.randn(B, Tc, H, D, generator=gen), -1).to(dev)
    v, sbar = torch.randn(B, Tc, H, D, generator=gen).to(dev), torch.randn(B, H, D, D, generator=gen).to(dev)
    valid = (torch.rand(B, Tc, generator=gen) > 0.2).to(dev)
    o_new, s_new = causal_linear_term(phiq, phik, v, sbar, valid, "ieee")
    o_old, s_old = old_causal_linear_term(phiq.view(B, Tc, H, G, D).permute(0, 2, 3, 1, 4), phik.transpose(1, 2),
                                          v.transpose(1, 2), sbar, valid)
    err = max(((o_new - o_old.permute(0, 3, 1, 2, 4).reshape(o_new.shape)).norm() / o_old.norm()).item(),
              ((s_new - s_old).norm() / s_old.norm()).item())
    rows.append(dict(id="-", what="SPLA causal linear term: new vs old, relative difference (fp32)", T=Tc, ratio=err))
    print(f"new vs old causal linear term, fp32, T={Tc}: relative difference {err:.2e}", flush=True)
    return rows


def breakdown(T, B, H, D, dtype, dev):
    """Device time of each kernel in one forward + backward call of every decay kind."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for kind in ("none", "head", "key"):
        run = timed(ours, la_inputs(T, B, H, H, D, kind, dtype, dev, True), True)
        run()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:10]:
            ms = e.device_time_total / 1e3
            rows.append(dict(id="breakdown", what=f"{kind}: {e.key[:60]}", T=T, ours_ms=ms))
            print(f"  {kind:5} {e.key[:60]:60} {ms:8.4f} ms", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--T", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--breakdown", action="store_true", help="per-kernel device times (torch profiler)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes; on a machine without CUDA, the interpreter")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.quick and dev != "cuda":
        raise SystemExit("needs a CUDA GPU; use --quick for a CPU smoke run")
    if args.quick:  # fp32: the interpreter has no bf16 dots
        lengths, B, H, D, HQ, Hs, dtype = [24, 48], 1, 2, 16, 4, 2, torch.float32
        T_spla, peers = 48, {}
    else:
        lengths, B, H, D, HQ, Hs, dtype = args.T, 1, 16, 128, 32, 8, torch.bfloat16
        T_spla, peers = 32768, fla_peers()
    torch.manual_seed(0)
    rows = kernel_rows(lengths, B, H, D, dtype, dev, peers)
    rows += spla_rows(T_spla, B, HQ, Hs, D, dtype, dev)
    if args.breakdown and dev == "cuda":
        rows += breakdown(lengths[0], B, H, D, dtype, dev)
    print(f"\n{'id':4} {'what':58} {'T':>6} {'peer ms':>9} {'ours ms':>9} {'ratio':>7} {'floor ms':>9}  peer")
    for r in rows:
        if r["id"] == "breakdown":
            continue
        f = lambda x: "" if x is None else f"{x:9.3f}"  # noqa: E731
        print(f"{r['id']:4} {r['what'][:58]:58} {str(r.get('T', '')):>6} {f(r.get('peer_ms')):>9} "
              f"{f(r.get('ours_ms')):>9} {r['ratio']:7.3g} {f(r.get('floor_ms')):>9}  {r.get('peer', '')}")
    if args.out:
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                "quick": args.quick}
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
