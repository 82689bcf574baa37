"""GPU time of each kernel in one call of a linear-time op (HLA, SSE, the GLA ops under them, and the
fla peers), from torch.profiler: where a call's time goes, kernel by kernel and in the PyTorch ops
around the kernels. Inputs are those of scripts/benchmarks/kernels/bench_hla.py and
scripts/benchmarks/kernels/bench_sse.py (bf16, B1 H16 d128, fresh random data).

    python -m scripts.tools.profile_kernels --op sse --T 32768 [--bwd] [--rows 25]

ops: hla2, ahla (hla_triton: the chunked kernels), sse (sse_attention on the Triton kernels, N = 4,
K = 1), gla-varlen (our varlen GLA on one segment per row), fla-gla, fla-simple-gla (fla-core,
optional), window (`window_attention` at a window branch's shapes: Llama-3.2-1B heads 32 / 8, d 64,
W 64, 4 sinks; scripts/benchmarks/kernels/bench_window.py's inputs).
"""

from __future__ import annotations

import argparse

import torch

from scripts.benchmarks.kernels import bench_hla, bench_sse  # noqa: E402
from scripts.common.profile import kernel_table  # noqa: E402


def make(op: str, T: int, bwd: bool):
    """A no-argument callable running one call of `op` (forward, or forward and backward)."""
    from subquadratic.kernels.hla import hla_triton
    from subquadratic.kernels.sse import sse_attention

    if op in ("hla2", "ahla"):  # T > 1: the chunked kernels
        return (bench_hla.fwdbwd_fn if bwd else bench_hla.fwd_fn)(hla_triton, T, variant=op)
    if op == "sse":
        return bench_sse.sse_run(lambda *a, **kw: sse_attention(*a, backend="triton", **kw), T, bwd,
                                 topk=bench_sse.TOPK)
    if op == "gla-varlen":
        return bench_sse.gla_run(bench_sse.ours_gla, T, bwd)
    if op == "window":
        from scripts.benchmarks.kernels import bench_window
        from subquadratic.kernels.window_attention import window_attention

        xs = [x.detach().requires_grad_(bwd) for x in bench_window.make(T, 32, 8, 64, torch.device("cuda"),
                                                                          torch.bfloat16)]
        do = torch.randn(1, T, 32, 64, device="cuda", dtype=torch.bfloat16)

        def run():
            with torch.set_grad_enabled(bwd):
                o = window_attention(*xs, 64, 0.125, 4)
                if bwd:
                    o.backward(do)
        return run
    if op == "fla-gla":
        from fla.ops.gla import chunk_gla

        return bench_sse.gla_run(lambda q, k, v, g: chunk_gla(q, k, v, g=g), T, bwd)
    if op == "fla-simple-gla":
        from fla.ops.simple_gla import chunk_simple_gla

        return (bench_hla.fwdbwd_fn if bwd else bench_hla.fwd_fn)(
            lambda q, k, v, la: chunk_simple_gla(q, k, v, g=la), T)
    raise SystemExit(f"unknown --op {op!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", nargs="+", default=["sse"],
                    choices=["hla2", "ahla", "sse", "gla-varlen", "fla-gla", "fla-simple-gla", "window"])
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--bwd", action="store_true", help="profile forward + backward (default: forward)")
    ap.add_argument("--calls", type=int, default=5, help="calls profiled after three warm-up calls")
    ap.add_argument("--rows", type=int, default=25, help="kernels listed, by total GPU time")
    ap.add_argument("--host", type=int, default=0, help="also list this many host functions / ops by CPU time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_kernels.py needs a CUDA GPU")
    for op in args.op:
        run = make(op, args.T, args.bwd)
        for _ in range(3):
            run()
        table, _ = kernel_table(run, args.calls, args.rows, f"{op} T={args.T} {'fwd+bwd' if args.bwd else 'fwd'}",
                                args.host)
        print("\n" + table, flush=True)
        del run
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
