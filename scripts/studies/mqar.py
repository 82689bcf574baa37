"""Q5: multi-query associative recall (MQAR) trained from scratch at equal recurrent state size, SSE
against the GLA-style baseline (SSE with one partition) and HLA (hla2), with a learning-rate sweep.

  python -m scripts.studies.mqar --device cuda --out DIR [--preset h200] [--steps 3000] [--batch-size 256]
                         [--lrs 1e-3,3e-3] [--models sse,gla,hla] [--jobs 6]
  python -m scripts.studies.mqar --quick --out DIR     # tiny shapes on the CPU: a smoke run

Each (model, learning rate) is one job: `mqar_contenders.mqar_compare` for that contender alone,
from the same seed, on the same training stream and the same held-out set as the others. Jobs run in
--jobs processes at once (these models are small, so one job leaves most of a GPU idle and is bound by
its host thread). As in Zoology, a model's score is its best held-out accuracy over the swept rates.
Writes DIR/mqar.json (every job) and DIR/mqar.md (the table), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from pathlib import Path

from scripts.studies.mqar_contenders import MQAR_MODELS, MQARSettings  # noqa: E402

#: "h200": the task of the 2026-11-30 replication (sequence 128, 16 pairs, vocabulary 256, 2 layers of
#: width 128, head dim 32), trained at a batch and length where the models can converge.
PRESETS = {
    "h200": lambda: MQARSettings.gpu(seq_len=128, num_kv_pairs=16, vocab_size=256, steps=3000, batch_size=256,
                                     test_examples=1024),
    "zoology": lambda: MQARSettings.gpu(steps=3000, batch_size=256),
    "tiny": lambda: MQARSettings.tiny(),
}


def run_job(name: str, settings: dict, device: str, seed: int) -> dict:
    import torch

    from scripts.studies.mqar_contenders import mqar_compare

    torch.set_num_threads(1)
    started = time.perf_counter()
    res = mqar_compare(MQARSettings(**settings), (name,), device=device, seed=seed)
    return {"model": name, "lr": settings["lr"], **res[name], "seconds": round(time.perf_counter() - started, 1)}


def table(jobs: list[dict], chance: float) -> str:
    lrs = sorted({j["lr"] for j in jobs})
    lines = ["| model | heads | state bytes / sequence | " + " | ".join(f"accuracy @ lr {lr:g}" for lr in lrs)
             + " | best | final loss at best |",
             "| --- " * (5 + len(lrs)) + "|"]
    for name in MQAR_MODELS:
        mine = {j["lr"]: j for j in jobs if j["model"] == name}
        if not mine:
            continue
        best = max(mine.values(), key=lambda j: j["accuracy"])
        any_ = next(iter(mine.values()))
        cells = [f"{mine[lr]['accuracy']:.3f}" if lr in mine else "-" for lr in lrs]
        lines.append(f"| {name} | {any_['num_heads']} | {any_['state_bytes']:,} | " + " | ".join(cells)
                     + f" | **{best['accuracy']:.3f}** | {best['final_loss']:.3f} |")
    lines.append(f"\nchance: {chance:.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    p.add_argument("--quick", action="store_true", help="the tiny preset on the CPU, 2 jobs (a smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: the preset's)")
    p.add_argument("--lrs", default="1e-3,3e-3", help="comma list of peak learning rates (default 1e-3,3e-3)")
    p.add_argument("--models", default=",".join(MQAR_MODELS), help=f"comma list from {','.join(MQAR_MODELS)}")
    p.add_argument("--jobs", type=int, default=6, help="processes at once (default 6)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    if args.quick:
        args.preset, args.device, args.jobs = "tiny", "cpu", 2
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MQAR_MODELS))
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)}; available: {', '.join(MQAR_MODELS)}")
    try:
        lrs = [float(x) for x in args.lrs.split(",") if x]
    except ValueError:
        p.error(f"--lrs: {args.lrs!r} is not a comma list of numbers")
    if not lrs or min(lrs) <= 0:
        p.error("--lrs: give at least one positive learning rate")
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    base = PRESETS[args.preset]()
    if args.steps:
        base = replace(base, steps=args.steps)
    if args.batch_size:
        base = replace(base, batch_size=args.batch_size)
    args.out.mkdir(parents=True, exist_ok=True)

    chance = 1.0 / (base.vocab_size - 1 - (base.vocab_size - 1) // 2)
    result = {"settings": asdict(base), "preset": args.preset, "lrs": lrs, "seed": args.seed,
              "device": args.device, "chance": chance, "jobs": []}
    try:
        import torch

        result["torch"] = torch.__version__
        if args.device.startswith("cuda") and torch.cuda.is_available():
            result["gpu"] = torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001  (versions are a courtesy)
        pass

    def save() -> str:  # after every job, so that a run cut short keeps what it measured
        result["jobs"].sort(key=lambda j: (MQAR_MODELS.index(j["model"]), j["lr"]))
        result["seconds"] = round(time.perf_counter() - started, 1)
        (args.out / "mqar.json").write_text(json.dumps(result, indent=1))
        md = table(result["jobs"], chance)
        (args.out / "mqar.md").write_text(md + "\n")
        return md

    work = [(m, lr) for m in models for lr in lrs]
    started = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # CUDA in forked children is not safe
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(work)), mp_context=ctx) as pool:
        futures = {pool.submit(run_job, m, asdict(replace(base, lr=lr)), args.device, args.seed): (m, lr)
                   for m, lr in work}
        for fut in as_completed(futures):
            job = fut.result()
            result["jobs"].append(job)
            md = save()
            print(f"[{time.perf_counter() - started:6.0f} s] {job['model']} lr {job['lr']:g}: accuracy "
                  f"{job['accuracy']:.3f}, final loss {job['final_loss']:.3f} ({job['seconds']} s)", flush=True)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
