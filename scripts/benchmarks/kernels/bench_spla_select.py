"""SPLA prefill selection on one GPU: the streamed selection (`select_indices_stream`), the one-launch
tile selection it replaces (`select_indices_fast`) and SDPA flash's causal forward on the same heads,
in the same run (bf16, fresh random data, triton.testing.do_bench medians). Prints one table per
case, the recall of each selection against the exact fp64 Taylor selection (`select_blocks` math,
on a subsample of queries), then a summary table; optionally writes the rows as JSON.

  python -m scripts.benchmarks.kernels.bench_spla_select [--lengths 8192 32768 131072] [--dims 128 64] [--out rows.json]
  python -m scripts.benchmarks.kernels.bench_spla_select --sweep    # launch settings of the streamed selection at 32k
  python -m scripts.benchmarks.kernels.bench_spla_select --quick    # CPU smoke run: tiny shapes in Triton's interpreter

Shapes: B1 HQ32 H8, 64-token blocks, top 16 (1 sink, 2 local). The inputs are iid random, so the
group scores of a row lie close together: the hard case for the recall of 16-bit operands.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--recall-queries", type=int, default=256, help="queries per case for the recall (0: none)")
    ap.add_argument("--precision", default="bf16", help="score operands of the streamed selection")
    ap.add_argument("--merge", default=None,
                    help="top-k merge of the streamed selection: insert or bitonic (default: the library's, by length)")
    ap.add_argument("--no-old", action="store_true", help="skip select_indices_fast")
    ap.add_argument("--sweep", action="store_true",
                    help="time launch settings of the streamed selection at each of --lengths x --dims")
    ap.add_argument("--sweep-only", action="store_true", help="with --sweep: the sweep alone, no cases")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run in Triton's interpreter, tiny shapes")
    ap.add_argument("--out", help="write the rows as JSON here")
    return ap.parse_args()


ARGS = parse()
if ARGS.quick:  # the interpreter must be chosen before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from subquadratic.kernels.spla import (  # noqa: E402
    BlockStats,
    SPLAParams,
    select_indices_fast,
    select_indices_stream,
    selection_recall,
)

if ARGS.quick:
    DEV = "cpu"
    SHAPE = dict(B=1, HQ=4, H=2, bs=16, top=6)
else:
    if not torch.cuda.is_available():
        sys.exit("bench_spla_select.py times CUDA kernels and found no CUDA device; use --quick for the CPU smoke run")
    DEV = "cuda"
    SHAPE = dict(B=1, HQ=32, H=8, bs=64, top=16)


def timed(fn) -> float:
    """Median ms: triton.testing.do_bench on CUDA, one wall-clock run in --quick mode."""
    if DEV == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def flash_fn(q, k, v):
    """SDPA's causal forward on q [B, HQ, T, D], k, v [B, H, T, D] (GQA), the flash kernel on CUDA."""
    def run():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    if DEV != "cuda":
        return run, "SDPA (CPU)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            run()

    try:
        flash()
        return flash, "SDPA flash"
    except RuntimeError as e:  # a torch whose flash kernel refuses GQA: repeat the KV heads (same cost)
        print(f"  flash with enable_gqa refused ({str(e).splitlines()[0][:80]}); repeating the KV heads")
        G = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)

        def flash_mha():
            with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
        return flash_mha, "SDPA flash (KV heads repeated)"


def case(T: int, D: int, n_recall: int, precision: str, old: bool, merge: str | None = None) -> dict:
    B, HQ, H, bs, top = (SHAPE[k] for k in ("B", "HQ", "H", "bs", "top"))
    g = torch.Generator(device=DEV).manual_seed(T + D)
    q = torch.randn(B, HQ, T, D, device=DEV, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, H, T, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # the op's [B, T, heads, D] layout (views)
    pos = torch.arange(T, device=DEV).expand(B, T).contiguous()
    stats = BlockStats.empty(B, H, D, DEV).add(kt, pos, bs)
    cfg = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=1, num_local_blocks=2)
    row = dict(T=T, D=D, B=B, HQ=HQ, H=H, NB=stats.num_blocks, precision=precision, merge=merge)
    sub = torch.randperm(T, generator=torch.Generator().manual_seed(T))[:n_recall].sort().values.to(DEV)

    def recall(idx):
        r = selection_recall(qt[:, sub], stats, pos[:, sub], idx[:, sub], cfg)
        return r if r["valid"] and r["forced_exact"] else {**r, "blocks": float("nan"), "mass": float("nan")}

    ours = lambda: select_indices_stream(qt, stats, pos, cfg, precision=precision, merge=merge)  # noqa: E731
    idx = ours()
    row["stream_ms"] = timed(ours)
    if n_recall:
        r = recall(idx)
        row.update(stream_recall_blocks=r["blocks"], stream_recall_mass=r["mass"], stream_valid=r["valid"])
    del idx
    if old:
        prev = lambda: select_indices_fast(qt, stats, pos, cfg, prec="tf32x3")  # noqa: E731
        idx = prev()
        row["fast_ms"] = timed(prev)
        if n_recall:
            r = recall(idx)
            row.update(fast_recall_blocks=r["blocks"], fast_recall_mass=r["mass"])
        del idx
    flash, row["flash"] = flash_fn(q, k, v)
    row["flash_ms"] = timed(flash)
    return row


#: the launch settings the sweep times: (merge, rows, block_chunk, warps, stages)
SWEEP = [(m, r, bn, w, 2) for m in ("insert", "bitonic") for r in (64, 128, 256) for bn in (32, 64, 128)
         for w in (4, 8)] + [("insert", 128, 64, w, s) for w in (4, 8) for s in (1, 3)]


def sweep(T: int = 32768, D: int = 128) -> list[dict]:
    """Median ms of the streamed selection per launch setting (`SWEEP`: merge, rows, block_chunk,
    warps, stages) at T tokens of head dim D, the default settings first."""
    B, HQ, H, bs, top = (SHAPE[k] for k in ("B", "HQ", "H", "bs", "top"))
    T = T if DEV == "cuda" else 128
    D = D if DEV == "cuda" else 32
    q = torch.randn(B, T, HQ, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, D, device=DEV, dtype=torch.bfloat16)
    pos = torch.arange(T, device=DEV).expand(B, T).contiguous()
    stats = BlockStats.empty(B, H, D, DEV).add(k, pos, bs)
    cfg = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=1, num_local_blocks=2)
    rows = [dict(T=T, D=D, default=True, stream_ms=timed(lambda: select_indices_stream(q, stats, pos, cfg)))]
    print(f"  T={T} D={D} default settings: {rows[0]['stream_ms']:8.3f} ms", flush=True)
    for m, rr, bn, w, s in SWEEP if DEV == "cuda" else SWEEP[:2]:
        kw = dict(merge=m, rows=rr, block_chunk=bn, num_warps=w, num_stages=s)
        try:
            ms = timed(lambda kw=kw: select_indices_stream(q, stats, pos, cfg, **kw))
        except Exception as e:  # noqa: BLE001 (a setting that does not compile: report, go on)
            print(f"  {kw}: failed: {str(e).splitlines()[0][:100]}", flush=True)
            ms = float("nan")
        print(f"  merge={m:7} rows={rr:4} block_chunk={bn:3} warps={w} stages={s}: {ms:8.3f} ms", flush=True)
        rows.append(dict(T=T, D=D, **kw, stream_ms=ms))
    return rows


def fmt(x, spec: str) -> str:
    """x in `spec` ("9.3f"), or "-" as wide where it is missing or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return format("-", ">" + spec.split(".")[0])
    return format(x, spec)


def table(rows: list[dict]) -> str:
    head = (f"{'D':>4} {'T':>7} {'NB':>5} | {'stream ms':>9} {'/flash':>7} {'recall':>7} {'mass':>8} | "
            f"{'fast ms':>9} {'/flash':>7} {'recall':>7} | {'flash ms':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['D']:>4} {r['T']:>7}  failed: {r['error'][:90]}")
            continue
        fl = r.get("flash_ms", float("nan"))
        lines.append(
            f"{r['D']:>4} {r['T']:>7} {r['NB']:>5} | {fmt(r.get('stream_ms'), '9.3f')} "
            f"{fmt(r.get('stream_ms', math.nan) / fl, '7.3f')} {fmt(r.get('stream_recall_blocks'), '7.4f')} "
            f"{fmt(r.get('stream_recall_mass'), '8.5f')} | {fmt(r.get('fast_ms'), '9.3f')} "
            f"{fmt(r.get('fast_ms', math.nan) / fl, '7.3f')} {fmt(r.get('fast_recall_blocks'), '7.4f')} | "
            f"{fmt(fl, '9.3f')}")
    return "\n".join(lines)


def main() -> None:
    lengths = [128, 256] if ARGS.quick else ARGS.lengths
    dims = [32, 16] if ARGS.quick else ARGS.dims
    n_recall = min(ARGS.recall_queries, 64) if ARGS.quick else ARGS.recall_queries
    device = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (Triton interpreter)"
    now = datetime.datetime.now().isoformat(timespec="seconds")
    print(f"# SPLA selection, {now}, {device}, torch {torch.__version__}, "
          f"B{SHAPE['B']} HQ{SHAPE['HQ']} H{SHAPE['H']}, blocks of {SHAPE['bs']}, top {SHAPE['top']}, "
          f"stream operands {ARGS.precision}, merge {ARGS.merge or 'default'}", flush=True)
    rows, sweep_rows = [], []
    if ARGS.sweep:
        print("\nlaunch settings of select_indices_stream (median ms)")
        for D in dims:
            for T in lengths:
                part = sweep(T, D)
                best = min(part[1:], key=lambda r: r["stream_ms"] if r["stream_ms"] == r["stream_ms"] else math.inf)
                keys = ("merge", "rows", "block_chunk", "num_warps", "num_stages")
                setting = ", ".join(f"{k}={best[k]}" for k in keys)
                print(f"  T={part[0]['T']} D={part[0]['D']}: default {part[0]['stream_ms']:.3f} ms, "
                      f"best {best['stream_ms']:.3f} ms ({setting})", flush=True)
                sweep_rows += part
    for D in dims if not (ARGS.sweep and ARGS.sweep_only) else []:
        for T in lengths:
            try:
                row = case(T, D, n_recall, ARGS.precision, not ARGS.no_old, ARGS.merge)
            except Exception as e:  # noqa: BLE001 (keep the table going: a failed case is a row saying so)
                row = dict(T=T, D=D, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                print(f"case D={D} T={T} failed: {row['error']}", file=sys.stderr, flush=True)
            finally:
                if DEV == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
    if rows:
        print("\nsummary (ms are medians; /flash = ratio to SDPA flash's causal forward on the same heads; recall "
              "and mass: of the exact fp64 Taylor selection's free blocks, on "
              f"{n_recall} queries per case)")
        print(table(rows))
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            json.dump(dict(rows=rows, sweep=sweep_rows, args=vars(ARGS)), f, indent=1)
        print(f"wrote {ARGS.out}")
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
