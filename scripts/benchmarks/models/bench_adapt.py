"""What `subquadratic adapt` costs per step: seconds and peak GPU memory of a few steps of each family's
conversion on each row layout, through the package's `adapt()` (KL to the dense model, every parameter
trained, bf16 autocast on the GPU), and, with --memory-snapshot, where the memory at the peak goes.

  python -m scripts.benchmarks.models.bench_adapt --checkpoint DIR [--random-weights] [--families spla,sse-h,hla-h]
                                [--layouts 8x2048,2x8192,4x8192] [--steps 6] [--gradient-checkpointing both]
                                [--memory-snapshot] [--out r.json]
  python -m scripts.benchmarks.models.bench_adapt --quick     # a tiny random Llama on the CPU: a smoke run

--checkpoint is a dense Hugging Face folder with its tokenizer (SmolLM2-135M de-quantised, say);
--random-weights keeps only its config and tokenizer and draws fresh weights (speed and memory do not
depend on the weights; the folder then needs no weight files). The training text is the Python sources
of the installed packages (`real_quality.py`'s training split). Each (family, layout) converts once with
the defaults of `subquadratic convert --to FAMILY` and adapts for --steps steps, the first --stage1 of
them attention transfer (hybrids; SPLA's recipe has none); a layout RxL is R rows of L tokens per step.

Per step, from `adapt_log.jsonl`: the seconds (the first step compiles and autotunes kernels and is
reported apart), and the peak of `torch.cuda.max_memory_allocated` (reset before each run) at the
end of attention transfer and at the end. --memory-snapshot records the allocator's history over the
run (`torch.cuda.memory._record_memory_history`), replays it to the moment of the largest total of live
blocks and groups the blocks live then by the innermost frame of this package (else Transformers', else
torch's Python) that allocated them: what holds the memory at the peak, by line of code.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

import subquadratic  # noqa: E402, F401  (registers the families)
from scripts.studies.real_quality import RECIPES, SCALES, package_sources, split_sources, tiny_dense, write_train  # noqa: E402
from subquadratic.adaptation import AdaptConfig, adapt  # noqa: E402
from subquadratic.conversion import convert  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_layout(text: str) -> tuple[int, int]:
    rows, _, length = text.lower().partition("x")
    if not rows.isdigit() or not length.isdigit() or int(rows) < 1 or int(length) < 2:
        raise SystemExit(f"--layouts: {text!r} is not ROWSxLENGTH (e.g. 2x8192)")
    return int(rows), int(length)


def training_text(path: Path, nbytes: int, packages: tuple[str, ...]) -> Path:
    """`real_quality.py`'s training split of the packages' Python sources, about `nbytes` of it, as jsonl."""
    train, _ = split_sources(package_sources(packages), 50)
    info = write_train(train, path, nbytes, 4_096)
    log(f"training text: {info['files']} files, {info['bytes'] / 1e6:.1f} MB")
    return path


def dense_folder(args, work: Path) -> Path:
    """The dense checkpoint: --checkpoint, its config and tokenizer with fresh weights (--random-weights),
    or (--quick) `real_quality.py`'s tiny random Llama with a byte-level BPE learnt from the text."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = work / "dense"
    if args.quick:
        return tiny_dense(SCALES["tiny"], folder, args.text)
    src = Path(args.checkpoint)
    if not (src / "config.json").is_file():
        raise SystemExit(f"--checkpoint {src} has no config.json; give a dense Hugging Face folder")
    if not args.random_weights:
        return src
    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(src).save_pretrained(folder)
    return folder


def owner(frames: list[dict]) -> str:
    """The innermost frame of this package's code (else Transformers', else torch's Python) as file:line."""
    for part in ("subquadratic/", "transformers/", "torch/"):
        for f in frames:
            name = f.get("filename", "")
            if part in name and "memory.py" not in name and "_tensor.py" not in name:
                short = name[name.index(part):] if part != "torch/" else name[name.rindex("torch/"):]
                return f"{short}:{f.get('line')} ({f.get('name')})"
    return "(no Python frame)"


def peak_breakdown(snapshot: dict, top: int = 15) -> dict:
    """Replays the allocator trace of `snapshot` (device 0) to the largest total of live blocks and
    groups the blocks live then by `owner` of their allocation: {"peak_gib", "by_owner": [[owner, gib]]}."""
    trace = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for ev in trace:
        action, addr, size = ev["action"], ev["addr"], ev["size"]
        if action == "alloc":
            live[addr] = (size, owner(ev.get("frames", [])))
            total += size
            if total > best:
                best, best_live = total, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:
            total -= live.pop(addr)[0]
    groups: dict[str, int] = defaultdict(int)
    for size, who in best_live.values():
        groups[who] += size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    return {"peak_gib": round(best / 2**30, 3), "events": len(trace),
            "by_owner": [[who, round(size / 2**30, 3)] for who, size in ranked[:top]]}


def run_case(dense: Path, converted: Path, family: str, layout: tuple[int, int], args, work: Path,
             checkpointing: bool) -> dict:
    rows, length = layout
    recipe = RECIPES["spla" if family == "spla" else "linear"]
    lr, share = recipe["lr"], recipe["stage1_share"]
    stage1 = 0 if not share else (args.stage1 if args.stage1 is not None else round(share * args.steps))
    cuda = torch.cuda.is_available() and not args.quick
    out = work / "adapted" / f"{family}-{rows}x{length}{'-ckpt' if checkpointing else ''}"
    cfg = AdaptConfig(student=str(converted), output_dir=str(out), data=[str(args.text)], teacher=str(dense),
                      max_steps=args.steps, stage1_steps=stage1, loss="kl", train="full", seq_len=length,
                      batch_size=rows, lr=lr, stage1_lr=1e-3, mixed_precision="bf16" if cuda else "no",
                      gradient_checkpointing=checkpointing, save_every=10 ** 6, progress=False, overwrite=True,
                      num_proc=min(8, args.num_proc))
    record = args.memory_snapshot and cuda
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if record:
        torch.cuda.memory._record_memory_history(max_entries=args.snapshot_entries)
    t = time.perf_counter()
    adapt(cfg)
    wall = time.perf_counter() - t
    entry: dict = {"family": family, "rows": rows, "seq_len": length, "tokens_per_step": rows * length,
                   "gradient_checkpointing": checkpointing, "steps": args.steps, "stage1_steps": stage1,
                   "wall_seconds": round(wall, 1)}
    if record:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        entry["snapshot"] = peak_breakdown(snap)
    logged = [json.loads(line) for line in (out / "adapt_log.jsonl").read_text().splitlines()]
    secs = [b["seconds"] - a["seconds"] for a, b in zip(logged, logged[1:], strict=False)]
    entry["first_step_seconds"] = logged[0]["seconds"]
    for stage in (1, 2):
        per = [s for s, line in zip(secs, logged[1:], strict=False) if line["stage"] == stage]
        if per:
            entry[f"stage{stage}_seconds_per_step"] = round(sorted(per)[len(per) // 2], 3)
        mem = [line["peak_memory_gib"][0] for line in logged if line["stage"] == stage and "peak_memory_gib" in line]
        if mem:
            entry[f"stage{stage}_peak_gib"] = max(mem)
    shutil.rmtree(out, ignore_errors=True)
    return entry


def table(results: list[dict]) -> str:
    lines = ["| family | layout | checkpointing | s / step (transfer) | s / step (KL) | peak GiB (transfer) | "
             "peak GiB (KL) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for e in results:
        if "error" in e:
            lines.append(f"| {e['family']} | {e['rows']} x {e['seq_len']} | {e['gradient_checkpointing']} | "
                         f"{e['error']} | | | |")
            continue
        cells = [str(e.get(k, "-")) for k in ("stage1_seconds_per_step", "stage2_seconds_per_step",
                                              "stage1_peak_gib", "stage2_peak_gib")]
        ckpt = "yes" if e["gradient_checkpointing"] else "no"
        lines.append(f"| {e['family']} | {e['rows']} x {e['seq_len']} | {ckpt} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="dense Hugging Face folder with its tokenizer")
    ap.add_argument("--random-weights", action="store_true",
                    help="the checkpoint's config and tokenizer, fresh weights")
    ap.add_argument("--families", default="spla,sse-h,hla-h")
    ap.add_argument("--layouts", default="8x2048,2x8192", help="comma list of ROWSxLENGTH per step")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stage1", type=int, default=None, help="attention-transfer steps of the hybrids "
                                                             "(default: the recipe's quarter)")
    ap.add_argument("--gradient-checkpointing", choices=("no", "yes", "both"), default="no")
    ap.add_argument("--memory-snapshot", action="store_true", help="where the memory at the peak goes (GPU)")
    ap.add_argument("--snapshot-entries", type=int, default=400_000)
    ap.add_argument("--packages", default="torch,transformers,numpy")
    ap.add_argument("--work", default=None)
    ap.add_argument("--num-proc", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny random Llama on the CPU, short rows (smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.families, args.layouts, args.steps = args.families or "spla,sse-h,hla-h", "2x128", 2
        args.packages = "numpy"
    elif not args.checkpoint:
        raise SystemExit("give --checkpoint DIR (a dense Hugging Face folder with its tokenizer) or --quick")
    layouts = [parse_layout(x) for x in args.layouts.split(",") if x.strip()]
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    ckpt = {"no": [False], "yes": [True], "both": [False, True]}[args.gradient_checkpointing]
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-adapt-"))
    work.mkdir(parents=True, exist_ok=True)
    most = max(r * L for r, L in layouts) * args.steps
    args.text = training_text(work / "train.jsonl", 6 * most, tuple(args.packages.split(",")))
    dense = dense_folder(args, work)
    results: list[dict] = []
    for family in families:
        converted = convert(str(dense), str(work / "converted" / family), family, overwrite=True, progress=False)
        for layout in layouts:
            for c in ckpt:
                log(f"{family}: {args.steps} steps of {layout[0]} x {layout[1]}{' with checkpointing' if c else ''}")
                try:
                    entry = run_case(dense, converted, family, layout, args, work, c)
                except Exception as e:  # out of memory, say: recorded, and the run goes on
                    traceback.print_exc()
                    entry = {"family": family, "rows": layout[0], "seq_len": layout[1], "gradient_checkpointing": c,
                             "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
                    if torch.cuda.is_available():
                        torch.cuda.memory._record_memory_history(enabled=None)
                        torch.cuda.empty_cache()
                log(json.dumps({k: v for k, v in entry.items() if k != "snapshot"}))
                for who, gib in entry.get("snapshot", {}).get("by_owner", []):
                    log(f"    {gib:8.3f} GiB  {who}")
                results.append(entry)
                if args.out:
                    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name()
                                                          if torch.cuda.is_available() else "cpu",
                                                          "torch": torch.__version__, "results": results},
                                                         indent=1) + "\n")
    print(table(results))
    return results


if __name__ == "__main__":
    main()
