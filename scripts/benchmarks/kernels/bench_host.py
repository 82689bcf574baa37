"""Host time per call of what a forward launches: an aten op, a Triton kernel of four arguments, the
chunked linear-attention kernels (`chunk_linear_attention`, with autotuned and with fixed launch
settings), and a one-layer model of each family against a one-layer Llama. Calls run back to back
with no synchronisation inside the timed loop on shapes too small to keep the GPU busy, so the time
per call is the host's: what bounds a call whose kernels finish faster than they are launched (the
hybrids' first token at 8k). Prints one line per row and writes them as JSON.

  python -m scripts.benchmarks.kernels.bench_host [--out r.json]
  python -m scripts.benchmarks.kernels.bench_host --quick     # CPU smoke run (no Triton rows)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from scripts.common.models import LLAMA_1B, versions


def host_us(fn, calls: int) -> float:
    """Microseconds of host time per call of fn (three untimed calls first)."""
    for _ in range(3):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return us


def triton_rows(dev: torch.device, calls: int) -> dict[str, float]:
    import triton
    import triton.language as tl

    import subquadratic.kernels.triton_utils as tu
    from subquadratic.kernels.gla.triton_chunk import chunk_linear_attention

    @triton.jit
    def add_one(X, Y, n, B: tl.constexpr):
        i = tl.arange(0, B)
        tl.store(Y + i, tl.load(X + i, mask=i < n) + 1, mask=i < n)

    x = torch.randn(64, device=dev)
    y = torch.empty_like(x)
    rows = {"triton kernel, 4 arguments": host_us(lambda: add_one[(1,)](x, y, 64, 64), calls)}
    q, k = (torch.randn(1, 64, 32, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
    g = -torch.rand(1, 64, 32, 64, device=dev)
    for tuned in (True, False):
        how = "autotuned" if tuned else "fixed settings"
        with tu.autotuning(tuned):
            rows[f"chunk_linear_attention, per-key decay, {how}"] = host_us(lambda: chunk_linear_attention(q, k, k, g),
                                                                            calls)
            rows[f"chunk_linear_attention, no decay, {how}"] = host_us(lambda: chunk_linear_attention(q, k, k), calls)
    return rows


def layer_rows(dev: torch.device, dtype: torch.dtype, shape: dict, T: int, calls: int) -> dict[str, float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from subquadratic import HLAForCausalLM, SSEForCausalLM
    from subquadratic.families.hla.configuration import HLAConfig
    from subquadratic.families.sse.configuration import SSEConfig

    shape = dict(shape, num_hidden_layers=1)
    ids = torch.randint(0, shape["vocab_size"], (1, T), device=dev)
    window = dict(sse_sliding_window=64, sse_window_sinks=4, sse_window_merge="sum")
    models = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**shape)),
              "sse, window 64 + 4 sinks": lambda: SSEForCausalLM(SSEConfig(**shape, **window)),
              "sse, no window": lambda: SSEForCausalLM(SSEConfig(**shape)),
              "hla": lambda: HLAForCausalLM(HLAConfig(**shape))}
    rows = {}
    for name, make in models.items():
        torch.manual_seed(0)
        model = make().to(dev, dtype).eval()
        with torch.no_grad():
            rows[f"one-layer model forward, {name}, {T} tokens"] = host_us(
                lambda m=model: m(ids, use_cache=False, logits_to_keep=1), calls)
        del model
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU, no Triton rows (a smoke run)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.quick
    dev = torch.device("cuda" if cuda else "cpu")
    shape = LLAMA_1B if cuda else dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5)
    calls = a.calls if not a.quick else 5
    x = torch.randn(64, device=dev)
    rows = {"aten add": host_us(lambda: x + 1, calls)}
    if cuda:
        rows.update(triton_rows(dev, calls))
    rows.update(layer_rows(dev, torch.bfloat16 if cuda else torch.float32, shape, 64 if cuda else 16,
                           max(10, calls // 2) if cuda else calls))
    for name, us in rows.items():
        print(f"{name:60s} {us:9.1f} us")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": versions(dev), "host_us": rows}, f, indent=1)


if __name__ == "__main__":
    main()
