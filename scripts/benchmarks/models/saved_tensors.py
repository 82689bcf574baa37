"""Where a training step's memory goes: the tensors autograd saves for the backward pass during one
forward of a 1B-class Llama (Llama-3.2-1B shapes, random bf16 weights) and of its conversions, grouped
by the module that saved them (a decoder layer's mixer, MLP, norms; the embedding and head), each
storage counted once, beside the step's peak memory. Complements `bench_model --train-lengths`, which
gives the peak alone.

  python -m scripts.benchmarks.models.saved_tensors [--length 8192] [--families sse-h,hla-h,spla] [--out r.json]
  python -m scripts.benchmarks.models.saved_tensors --quick     # tiny model on CPU: a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from scripts.common.models import LLAMA_1B, TINY, dense_and_conversions, free, load_converted, log


def caller() -> str:
    """The innermost function of the package (or of Transformers, else any) on the stack, as file:function."""
    frame = sys._getframe(2)
    other = None
    while frame is not None:
        path = frame.f_code.co_filename
        if "/subquadratic/" in path or "/transformers/" in path:
            return f"{Path(path).parent.name}/{Path(path).name}:{frame.f_code.co_name}"
        other = other or f"{Path(path).name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return other or "?"


def saved_by_module(model, ids: torch.Tensor) -> tuple[dict[str, int], int]:
    """({module kind: bytes saved for backward}, peak bytes of the forward + backward) of one training
    forward and backward of `model` on `ids`; a module's kind is its class name and its path with the
    layer index removed (`model.layers.*.self_attn`), with the function of the package that saved it
    (`caller`); a storage saved twice counted once."""
    stack: list[str] = []
    hooks = []
    for name, mod in model.named_modules():
        if not name:
            continue
        kind = ".".join("*" if part.isdigit() else part for part in name.split(".")) + f" ({type(mod).__name__})"
        hooks.append(mod.register_forward_pre_hook(lambda m, a, kind=kind: stack.append(kind)))
        hooks.append(mod.register_forward_hook(lambda m, a, o: stack.pop() and None))  # None: output kept
    seen: set[tuple[int, int]] = set()
    saved: dict[str, int] = defaultdict(int)

    def pack(t: torch.Tensor):
        try:
            key = (t.untyped_storage().data_ptr(), t.device.index or 0)
            size = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            return t
        if key not in seen and size:
            seen.add(key)
            # the innermost module (a layer's mixer, say) and the package function that saved it
            saved[f"{stack[-1] if stack else '(top)'} <- {caller()}"] += size
        return t

    device = ids.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=ids).loss
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    model.zero_grad(set_to_none=True)
    return dict(saved), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--families", default="sse-h,hla-h,spla")
    ap.add_argument("--top", type=int, default=12, help="module kinds listed per model")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quick = args.quick or not torch.cuda.is_available()
    device = torch.device("cpu" if quick else "cuda")
    dtype = torch.float32 if quick else torch.bfloat16
    shape, T = (TINY, 256) if quick else (LLAMA_1B, args.length)
    families = [f for f in args.families.split(",") if f]
    res = {"length": T, "device": torch.cuda.get_device_name() if not quick else "cpu", "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dense = dense_and_conversions(work, shape, T, device, dtype, families)
        ids = torch.randint(1, shape["vocab_size"], (1, T), device=device)
        for name in ["dense", *families]:
            model = dense if name == "dense" else load_converted(work / name, device, dtype)
            model.train()
            log(f"{name}: one training step at T={T}")
            saved, peak = saved_by_module(model, ids)
            total = sum(saved.values())
            res["models"][name] = {"saved_bytes": total, "peak_bytes": peak, "by_module": saved}
            print(f"\n{name}: saved {total / 2**30:.2f} GiB, peak {peak / 2**30:.2f} GiB")
            for kind, size in sorted(saved.items(), key=lambda kv: -kv[1])[:args.top]:
                print(f"  {size / 2**30:8.3f} GiB  {kind}")
            if name != "dense":
                del model
            free(device)
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
