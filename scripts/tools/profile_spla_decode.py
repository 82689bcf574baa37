"""Where the time of one cached decode step goes, SPLA vs a dense Llama layer stack of the same
shapes (random bf16 weights, one GPU): wall time per step, and the host-side operators that cost
the most (torch.profiler, CPU self time), to tell launch and bookkeeping overhead from GPU work.

  python -m scripts.tools.profile_spla_decode [--layers 2] [--context 32768] [--steps 20]
"""

from __future__ import annotations

import argparse
import time

import torch


def shapes(layers: int) -> dict:
    return dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=1 << 20)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_time(model, context: int, steps: int, field: str, device: str) -> tuple[float, object]:
    x = torch.randint(1, 32000, (1, context), device=device)
    with torch.no_grad():
        out = None
        for c0 in range(0, context, 8192):
            kw = {} if out is None else {field: getattr(out, field)}
            out = model(x[:, c0:c0 + 8192], use_cache=True, **kw)
        cache = getattr(out, field)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(3):  # warm-up (compiles every kernel variant)
            out = model(tok, use_cache=True, **{field: cache})
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(tok, use_cache=True, **{field: cache})
        sync(device)
        ms = (time.perf_counter() - t0) / steps * 1e3
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(5):
                out = model(tok, use_cache=True, **{field: cache})
            sync(device)
    return ms, prof


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from subquadratic import CACHE_FIELD, SPLAConfig, SPLAForCausalLM

    torch.manual_seed(0)
    dt = torch.bfloat16 if args.device == "cuda" else torch.float32
    dense = LlamaForCausalLM(LlamaConfig(**shapes(args.layers), attn_implementation="sdpa")).to(args.device, dt).eval()
    spla = SPLAForCausalLM(SPLAConfig(**shapes(args.layers))).to(args.device, dt).eval()
    for name, model in (("dense", dense), ("spla", spla)):
        ms, prof = step_time(model, args.context, args.steps, CACHE_FIELD, args.device)
        print(f"\n{name}: {ms:.3f} ms per decode step, {args.layers} layers, context {args.context}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
