"""P9: prefill and greedy decode speed on the CPU, SmolLM2-135M-Instruct converted with the default
settings against the dense source, measured in the same run (fp32, batch 1).

  python -m scripts.benchmarks.models.bench_cpu [--prompts 1024,4096] [--new-tokens 32] [--families spla,hla,sse,sse-h]

`sse` is pure SSE (`--to sse`; `sse-kv-source` the same with `--sse-kv-heads source`), `sse-h` the preset
keeping softmax every 6th layer and adding the 64-token window branch to the others (`sse-h-no-window`: the
same without it), `hla` keeps no softmax layer, `hla-h` the HLA preset (softmax every 6th layer, the window
branch).
For each prompt length it prints the prefill time, the decode tokens/s and both as ratios to the
dense model (higher is faster). The checkpoints go to a temporary folder (about 0.6 GB each, fp32),
the SmolLM2 folder to the demo's cache (`subquadratic.demo.assets`). Rounds alternate between the
models and the median is reported, so a busy machine slows every model alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from scripts.common.models import CONVERSIONS

#: the rows it takes: convert targets with their defaults, or a conversion row of `common.models.CONVERSIONS`
FAMILIES = ("spla", "hla", "hla-h", "sse", "sse-kv-source", "sse-h", "sse-h-no-window")


def prefill(model, ids):
    from subquadratic import CACHE_FIELD

    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
    return getattr(out, CACHE_FIELD), out.logits[:, -1:].argmax(-1)


def decode(model, cache, tok, n):
    from subquadratic import CACHE_FIELD

    with torch.no_grad():
        for _ in range(n):
            out = model(tok, use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})  # dense or ours
            cache = getattr(out, CACHE_FIELD)
            tok = out.logits[:, -1:].argmax(-1)
    return tok


def measure(model, ids, n):
    t0 = time.perf_counter()
    cache, tok = prefill(model, ids)
    t1 = time.perf_counter()
    decode(model, cache, tok, n)
    t2 = time.perf_counter()
    return t1 - t0, n / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="1024,4096", help="comma list of prompt lengths")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (median)")
    ap.add_argument("--families", default="spla,hla,sse", help=f"comma list of {', '.join(FAMILIES)}")
    args = ap.parse_args()
    unknown = [name for name in args.families.split(",") if name not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {', '.join(unknown)}; take from {', '.join(FAMILIES)}")

    from transformers import AutoModelForCausalLM

    import subquadratic  # noqa: F401  (registers the model types)
    from subquadratic.conversion import convert
    from subquadratic.demo.assets import smollm2_checkpoint

    src = smollm2_checkpoint()
    models = {"dense": AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families.split(","):
            to, options = CONVERSIONS.get(name, (name, {}))
            out = convert(str(src), str(Path(tmp) / name), to, options=options, progress=False)
            models[name] = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; SmolLM2-135M fp32, B1, "
          f"{args.new_tokens} decode steps, median of {args.rounds} rounds")
    print(f"{'prompt':>7} {'model':>6} {'prefill s':>10} {'decode tok/s':>13} {'prefill x':>10} {'decode x':>9}")
    gen = torch.Generator().manual_seed(0)
    for T in (int(x) for x in args.prompts.split(",")):
        ids = torch.randint(100, 40000, (1, T), generator=gen)
        runs = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, model in models.items():
                runs[name].append(measure(model, ids, args.new_tokens))
        med = {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
               for name, rs in runs.items()}
        for name, (pre, tps) in med.items():
            print(f"{T:>7} {name:>6} {pre:>10.3f} {tps:>13.2f} {med['dense'][0] / pre:>10.2f} "
                  f"{tps / med['dense'][1]:>9.2f}")


if __name__ == "__main__":
    main()
