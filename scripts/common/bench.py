"""Shared timing pieces of the kernel benchmarks (`scripts.benchmarks.kernels`, run as modules), and
`spla_plan`: the SPLA kernels a benchmark names, as a plan."""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as Fn
import triton


def bench(fn, warmup: int = 10, rep: int = 100) -> float:
    """Median ms of fn() by triton.testing.do_bench; without CUDA (the --quick smoke runs on the CPU
    interpreter) the median wall time of three calls after one."""
    if not torch.cuda.is_available():
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def flash_run(T: int, bwd: bool, B: int = 1, H: int = 16, D: int = 128, dtype=torch.bfloat16):
    """SDPA causal attention (the flash kernel on bf16 CUDA inputs) on fresh random [B, H, T, D] inputs:
    the forward, or forward + backward."""
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=bwd) for _ in range(3))
    do = torch.randn_like(q)

    def run():
        if bwd:
            Fn.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
        else:
            with torch.no_grad():
                Fn.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


def crossover(name: str, make, lengths: list[int]) -> list[dict]:
    """Ours (`make(T, bwd)` returns the callable to time) against SDPA flash at each length, forward and
    forward + backward, B1 H16 d128 bf16; prints each pair and returns rows, then one row per direction
    with the shortest length from which ours is faster at every measured length (None: never)."""
    rows = []
    for bwd in (False, True):
        what = "fwd+bwd" if bwd else "fwd"
        wins = []
        for T in lengths:
            try:
                peer, ours = bench(flash_run(T, bwd)), bench(make(T, bwd))
            except Exception as e:  # noqa: BLE001 (keep the table going)
                print(f"crossover {name} {what} T={T}: failed: {e!r}", file=sys.stderr)
                peer = ours = float("nan")
            finally:
                torch.cuda.empty_cache()
            wins.append(ours < peer)
            rows.append(dict(id="X", what=f"{name} {what} vs SDPA flash", T=T, peer=f"SDPA flash causal {what}",
                             peer_ms=peer, ours_ms=ours, ratio=ours / peer))
            print(f"crossover {name:5} {what:8} T={T:6} flash {peer:9.3f} ms  ours {ours:9.3f} ms", flush=True)
        cross = next((T for i, T in enumerate(lengths) if all(wins[i:])), None)
        rows.append(dict(id="X", what=f"{name} {what}: faster than flash from T =",
                         T="never" if cross is None else str(cross), ratio=float("nan")))
    return rows


def spla_plan(q, k, params, grad: bool = False, **fields):
    """The plan `spla_attention(..., backend="triton")` makes for q [B, Tq, HQ, D] and k [B, S, H, D]
    (`grad`: the call needs gradients), with `fields` set (`kernels.spla.SPLAPlan`): form="token",
    splits=2, launch=Launch(topk_bn=512), ... Run it as `spla_attention(..., plan=plan)`."""
    from subquadratic.kernels.spla import plan_spla

    return plan_spla(q.shape, k.shape, q.dtype, q.device, params, backend="triton", grad=grad, **fields)
