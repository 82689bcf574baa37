"""Sliding-window attention with sinks (the hybrids' window branch): the Triton kernels
(`kernels.window_attention`) against the banded PyTorch form (`modeling.base.banded_window_attention`,
what the model ran before them) and SDPA's flash attention over the full causal past (what a dense
layer costs), forward and forward + backward, with the kernels' largest error against the banded form.

  python -m scripts.benchmarks.kernels.bench_window [--lengths 4096,16384,32768] [--heads 32,8] [--dim 64] [--window 64]
                                 [--sinks 4] [--out r.json]
  python -m scripts.benchmarks.kernels.bench_window --quick     # CPU smoke run (the kernels in Triton's interpreter)

Inputs: B1, bf16 on CUDA (fp32 on the CPU), q [B, HQ, T, D] and k, v [B, H, T, D] as views of
[B, T, heads, D] (the model's layout), fresh random data; `common.bench.bench` medians (do_bench on CUDA)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if not torch.cuda.is_available():  # the kernels run in Triton's interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as Fn  # noqa: E402

from scripts.common.bench import bench  # noqa: E402
from scripts.common.models import log, versions  # noqa: E402
from subquadratic.kernels.window_attention import window_attention  # noqa: E402
from subquadratic.modeling.base import banded_window_attention  # noqa: E402


def make(T: int, HQ: int, H: int, D: int, device, dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, T, HQ, D, device=device, dtype=dtype, generator=g).transpose(1, 2)
    k, v = (torch.randn(1, T, H, D, device=device, dtype=dtype, generator=g).transpose(1, 2) for _ in range(2))
    return q, k, v


def timed_forms(T: int, HQ: int, H: int, D: int, W: int, sinks: int, device, dtype) -> dict:
    q, k, v = make(T, HQ, H, D, device, dtype)
    pos = torch.arange(T, device=device)[None]
    scale = D ** -0.5
    forms = {
        "kernel": lambda q, k, v: window_attention(q, k, v, W, scale, sinks),
        "banded": lambda q, k, v: banded_window_attention(q, k, v, pos, pos, W, scale, sinks=sinks),
        "flash": lambda q, k, v: Fn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=HQ != H),
    }
    row = dict(T=T)
    with torch.no_grad():
        got, want = forms["kernel"](q, k, v), forms["banded"](q, k, v)
        row["max_err_vs_banded"] = float((got.float() - want.float()).abs().max())
    do = torch.randn_like(got)
    for name, fn in forms.items():
        def fwd(fn=fn):
            with torch.no_grad():
                fn(q, k, v)
        xs = [x.detach().requires_grad_() for x in (q, k, v)]

        def fwd_bwd(fn=fn, name=name, xs=xs):
            o = fn(*xs)
            (o if name != "flash" else o.transpose(1, 2)).backward(do)
        try:
            row[f"{name}_fwd_ms"] = bench(fwd)
            row[f"{name}_fwd_bwd_ms"] = bench(fwd_bwd)
        except Exception as e:  # noqa: BLE001 (out of memory, say: record it and go on)
            log(f"{name} at T={T}: failed: {e!r}")
            row[f"{name}_fwd_ms"] = row[f"{name}_fwd_bwd_ms"] = float("nan")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| T | kernel fwd | banded fwd | flash fwd (full causal) | kernel f+b | banded f+b | flash f+b | "
             "banded / kernel f+b | max err vs banded |", "| --- " * 9 + "|"]
    for r in rows:
        lines.append(f"| {r['T']} | {r['kernel_fwd_ms']:.3f} | {r['banded_fwd_ms']:.3f} | {r['flash_fwd_ms']:.3f} | "
                     f"{r['kernel_fwd_bwd_ms']:.3f} | {r['banded_fwd_bwd_ms']:.3f} | {r['flash_fwd_bwd_ms']:.3f} | "
                     f"{r['banded_fwd_bwd_ms'] / r['kernel_fwd_bwd_ms']:.2f}x | {r['max_err_vs_banded']:.2e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096,16384,32768")
    ap.add_argument("--heads", default="32,8", help="query heads, KV heads")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU interpreter (a smoke run)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    HQ, H = (int(x) for x in a.heads.split(","))
    lengths = [int(x) for x in a.lengths.split(",")]
    D, W = a.dim, a.window
    if a.quick:
        lengths, HQ, H, D, W = [150], 4, 2, 16, 32
    rows = []
    for T in lengths:
        log(f"T={T}")
        rows.append(timed_forms(T, HQ, H, D, W, a.sinks, device, dtype))
        log(f"  {rows[-1]}")
    print(markdown(rows))
    if a.out:
        meta = dict(versions(device), shapes=dict(B=1, HQ=HQ, H=H, D=D, window=W, sinks=a.sinks, dtype=str(dtype)))
        with open(a.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if not all(r["max_err_vs_banded"] <= (2e-2 if cuda else 1e-4) for r in rows):
        sys.exit("the kernels' values are off the banded form's")


if __name__ == "__main__":
    main()
