"""What each host-side speed-up is worth, in one process: time to first token and a training step of the
SSE-H and HLA-H conversions of a Llama-3.2-1B-shaped model (random bf16 weights), with the speed-ups all
on ("new"), all off ("old"), and each one off alone, the settings alternating call by call so that the
host's speed, which drifts within a process and between processes, weighs on every setting alike. The
dense model runs in the same process as the peer.

  python -m scripts.benchmarks.models.bench_toggles [--lengths 4096,8192,16384] [--train-length 8192] [--repeats 6]
      [--out r.json]
  python -m scripts.benchmarks.models.bench_toggles --quick    # tiny model on CPU: a smoke run

The speed-ups (each a setting a user never needs to touch; on by default):
  fast-launch  Triton launches through the kept compiled kernel (`kernels.triton_launch`);
  rms-norm     the decoder's RMSNorm and the residual add before it as one kernel (`kernels.rms_norm`; a
               field of the fused ops' plans, `modeling.fused.FusedPlan`);
  router       SSE's router softmax and top-K as one kernel (`kernels.sse.router`; a field of SSE's plans);
  packed-grad  (training) the input projections as one matmul with gradients (`modeling.projections`);
  swiglu-grad  (training) the MLP's SiLU product forward and backward as kernels (`kernels.swiglu`; a field
               of the same plans).
Per first token: the median host time the call took to return before its synchronisation and the
median wall time; per training step: the median wall time; with a GPU, the device time of one call of
each (the kernels' summed time, `common.profile.kernel_table`) for new and old.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from scripts.benchmarks.models.bench_model import train_call
from scripts.common.models import LLAMA_1B, TINY, dense_and_conversions, load_converted, log, sync, versions
from scripts.common.profile import kernel_table
from subquadratic.modeling import projections

try:
    from subquadratic.kernels import triton_launch
except ImportError:  # no Triton (a CPU smoke run): no launches to speed up
    triton_launch = None

SPEEDUPS = ("fast-launch", "rms-norm", "router")
TRAINING_SPEEDUPS = ("packed-grad", "swiglu-grad")
FAST_LAUNCH = triton_launch is not None and triton_launch.ENABLED


@contextlib.contextmanager
def setting(off: tuple[str, ...], model):
    """Within the block the speed-ups named in `off` are off and the others on (SSE's router, the norms' and
    the MLP's kernels: fields of `model`'s plans); after it, all on."""
    with contextlib.ExitStack() as stack:
        if triton_launch is not None:
            stack.enter_context(triton_launch.fast_launch(FAST_LAUNCH and "fast-launch" not in off))
        stack.enter_context(projections.packing_with_grad("packed-grad" not in off))
        plans = getattr(model, "set_plan", None)  # a subquadratic model's (not the dense peer's)
        if plans is not None:
            plans("sse", **({"router": "torch"} if "router" in off else {}))
            plans("fused", **({"rms_norm": "torch"} if "rms-norm" in off else {}),
                  **({"silu_mul": "torch"} if "swiglu-grad" in off else {}))
        try:
            yield
        finally:
            if plans is not None:
                plans("sse")
                plans("fused")


def settings(family: str, training: bool = False) -> dict[str, tuple[str, ...]]:
    """The settings measured for a family: new, old, and each speed-up that applies to it off alone
    (`training`: with the training-only ones)."""
    own = [s for s in SPEEDUPS if s != "router" or family.startswith("sse")]
    if training:
        own += TRAINING_SPEEDUPS
    return {"new": (), "old": tuple(own), **{f"no-{s}": (s,) for s in own}}


def alternate(calls: dict, repeats: int, device: torch.device, model) -> dict:
    """Median (host s, wall s) of each named call of `model` over `repeats` rounds, the order reversed every
    round."""
    names = list(calls)
    times: dict = {n: [] for n in names}
    for i in range(repeats):
        for n in names if i % 2 else names[::-1]:
            with setting(calls[n][1], model):
                sync(device)
                t0 = time.perf_counter()
                calls[n][0]()
                t1 = time.perf_counter()
                sync(device)
            times[n].append((t1 - t0, time.perf_counter() - t0))
    return {n: dict(host_ms=1e3 * statistics.median(a for a, _ in v), wall_ms=1e3 * statistics.median(b for _, b in v))
            for n, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096,8192,16384", help="comma list of prompt lengths")
    ap.add_argument("--train-length", type=int, default=8192, help="the training step's row length (0: none)")
    ap.add_argument("--repeats", type=int, default=6, help="timed rounds (median)")
    ap.add_argument("--families", default="sse-h,hla-h")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU, short lengths (smoke run)")
    args = ap.parse_args()
    if args.quick:
        device, dtype, shape, lengths, train_len = torch.device("cpu"), torch.float32, TINY, [64, 128], 64
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_toggles.py needs a CUDA GPU; use --quick for a CPU smoke run")
        device, dtype, shape = torch.device("cuda"), torch.bfloat16, LLAMA_1B
        lengths, train_len = [int(x) for x in args.lengths.split(",") if x], args.train_length
    families = [f for f in args.families.split(",") if f]
    work = Path(tempfile.mkdtemp())
    longest = max([*lengths, train_len])
    dense = dense_and_conversions(work, shape, -(-longest // 1024) * 1024, device, dtype, families)
    ids = torch.randint(1, shape["vocab_size"], (1, longest), generator=torch.Generator().manual_seed(1)).to(device)
    results: dict = dict(meta=dict(versions(device), model=shape, lengths=lengths, train_length=train_len,
                                   repeats=args.repeats), rows=[])

    def row(**r) -> None:
        results["rows"].append(r)
        log(json.dumps(r))
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))

    models = {"dense": dense, **{f: load_converted(work / f, device, dtype) for f in families}}
    for name, model in models.items():
        named = {"new": ()} if name == "dense" else settings(name)
        for T in lengths:
            x = ids[:, :T]

            def first_token(model=model, x=x):
                with torch.no_grad():
                    return model(x, use_cache=True, logits_to_keep=1).logits

            for off in named.values():  # compile and autotune each setting's kernels first
                with setting(off, model):
                    first_token()
            times = alternate({n: (first_token, off) for n, off in named.items()}, args.repeats, device, model)
            for n, t in times.items():
                gpu = None
                if device.type == "cuda" and n in ("new", "old"):
                    with setting(named[n], model):
                        gpu = kernel_table(first_token, calls=1)[1]
                row(model=name, measure="ttft", T=T, setting=n, gpu_ms=gpu, **t)
        if train_len:
            model.train()
            step = train_call(model, ids[:, :train_len])
            trained = {"new": ()} if name == "dense" else settings(name, training=True)
            for off in trained.values():
                with setting(off, model):
                    step()
            for n, t in alternate({n: (step, off) for n, off in trained.items()}, max(2, args.repeats // 2),
                                  device, model).items():
                gpu = None
                if device.type == "cuda" and n in ("new", "old"):
                    with setting(trained[n], model):
                        gpu = kernel_table(step, calls=1)[1]
                row(model=name, measure="train", T=train_len, setting=n, gpu_ms=gpu, wall_ms=t["wall_ms"])
            model.eval()
        model.cpu()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dense_ms = {(r["measure"], r["T"]): r["wall_ms"] for r in results["rows"] if r["model"] == "dense"}
    print("| model | measure | T | setting | host ms | wall ms | GPU ms | dense wall ms | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results["rows"]:
        d = dense_ms.get((r["measure"], r["T"]))
        host = f"{r['host_ms']:.1f}" if "host_ms" in r else "-"
        gpu = f"{r['gpu_ms']:.1f}" if r.get("gpu_ms") is not None else "-"
        print(f"| {r['model']} | {r['measure']} | {r['T']} | {r['setting']} | {host} | {r['wall_ms']:.1f} | {gpu} "
              f"| {d:.1f} | {d / r['wall_ms']:.2f}x |")


if __name__ == "__main__":
    main()
