"""`subquadratic adapt` sharded over two GPUs with FSDP2, against the same run on one GPU.

A small dense Llama-style model is pretrained on the machine's Python sources (the pipeline of
scripts/studies/replicate.py), converted to SPLA and SSE-H, and each conversion is adapted twice with the same
seed and the same global batch: on one GPU (data-parallel of one), and on two GPUs through
`accelerate launch --config_file configs/accelerate/fsdp.yaml` (full sharding, bf16, activation
checkpointing). Both adapted folders are then loaded on one GPU and scored on held-out files. OUT gets
results.json and results.md: the loss curves compared step by step, the final perplexities, tokens/s
per GPU, the scaling efficiency (two-GPU tokens/s over twice the one-GPU figure) and each GPU's peak
memory, with the commands that ran.

    python -m scripts.studies.fsdp_two_gpus --out results/fsdp [--work DIR] [--steps 200] [--batch 8]

A `--work` folder prepared by an earlier call is reused (no second pretraining), and the families
already in OUT/results.json are kept, so `--families spla` and `--families sse-h` can run as two calls.
`--dry-run` runs the same pipeline at tiny scale on a CPU, with two gloo processes that run
data-parallel (accelerate shards only on GPUs): a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import accelerate
import torch

from scripts.common.fsdp import accelerate_launch, child_env, read_log, run_child, shell_line, throughput  # noqa: E402
from scripts.studies import replicate  # noqa: E402  (corpus, tokenizer, pretraining)
from scripts.studies.replicate import log  # noqa: E402
from subquadratic.conversion import convert  # noqa: E402
from subquadratic.evaluation import evaluate  # noqa: E402

FAMILIES = {"spla": dict(stage1_share=0.0, lr=1e-4), "sse-h": dict(stage1_share=0.25, lr=3e-4)}


def prepare(scale: replicate.Scale, work: Path, device: torch.device, steps: int, batch: int) -> dict:
    """The dense model, the adaptation slice of the corpus, the held-out text and the conversions.

    A WORK folder that already holds them (a previous call with the same WORK) is reused as it is."""
    saved = work / "prepared.json"
    if saved.exists():
        prep = json.loads(saved.read_text())
        log(f"reusing {work}")
        return {k: {f: Path(v) for f, v in v.items()} if k == "students" else (v if k == "pretrain" else Path(v))
                for k, v in prep.items()}
    train, held, sizes = replicate.build_corpus(work, scale.corpus_bytes, min_bytes=8 * scale.seq_len)
    tokenizer = replicate.train_tokenizer(train, scale.vocab)
    dense = work / "dense"
    pre = replicate.pretrain(scale, train, tokenizer, dense, device)
    log(f"pretrained: {pre['tokens']:,} tokens in {pre['seconds']} s")
    need = steps * batch * scale.seq_len * sizes["train_bytes"] / pre["corpus_tokens"]
    data = replicate.adaptation_subset(train, 2 * need)
    students = {}
    for family in FAMILIES:
        options = dict(scale.spla) if family == "spla" else dict(softmax_every=4)
        students[family] = convert(str(dense), str(work / "converted" / family), family, options=options,
                                   overwrite=True, progress=False)
    prep = {"dense": dense, "data": data, "held": held, "students": students, "pretrain": pre}
    saved.write_text(json.dumps(prep, default=str))
    return prep


def adapt_command(family: str, prep: dict, out: Path, gpus: int, steps: int, batch: int, seq_len: int,
                  cuda: bool) -> tuple[list[str], dict]:
    recipe = FAMILIES[family]
    args = ["adapt", str(prep["students"][family]), "--teacher", str(prep["dense"]), "--data", str(prep["data"]),
            "-o", str(out), "--overwrite", "--max-steps", str(steps),
            "--stage1-steps", str(int(recipe["stage1_share"] * steps)), "--lr", str(recipe["lr"]),
            "--loss", "kl", "--seq-len", str(seq_len), "--batch-size", str(batch // gpus), "--seed", "0",
            "--gradient-checkpointing", "--save-every", str(10**6), "--no-progress",
            "--num-proc", str(min(16, os.cpu_count() or 1))]
    if cuda:
        args += ["--mixed-precision", "bf16"]
    env = child_env(cuda)
    if gpus == 1:
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        return [sys.executable, "-m", "subquadratic", *args], env
    return [*accelerate_launch(gpus), "-m", "subquadratic", *args], env  # on CPU: data-parallel over gloo


def run_adapt(cmd: list[str], env: dict, out: Path) -> dict:
    run = run_child(cmd, env, out.with_name(out.name + ".log"))
    if run.status != "ok":
        raise SystemExit(f"adaptation failed ({run.status}: {shell_line(cmd, env)}):\n{run.tail}")
    return {"wall_seconds": run.seconds, "log": read_log(out)}


def compare_losses(la: list[float], lb: list[float]) -> dict:
    """The two runs' loss curves, step by step."""
    rel = [abs(y - x) / max(abs(x), 1e-12) for x, y in zip(la, lb, strict=True)]
    tail = max(1, len(la) // 10)
    return {"mean_rel_diff": sum(rel) / len(rel), "max_rel_diff": max(rel),
            "final_one": sum(la[-tail:]) / tail, "final_two": sum(lb[-tail:]) / tail,
            "first_one": la[0], "first_two": lb[0]}


def perplexity(folder: Path, tokenizer_dir: Path, held: Path, seq_len: int, device: torch.device,
               windows: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    r = evaluate(model, tokenizer, name=folder.name, tasks=("ppl",), seq_lens=[seq_len], data=str(held),
                 max_windows=windows)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return next(iter(r["tasks"]["ppl"].values()))["ppl"]


def report(results: dict) -> str:
    s = results["settings"]
    lines = [f"# FSDP on {results['gpus']} GPUs vs one ({results['device']}, {results['date']})", "",
             f"{s['steps']} steps of a global batch of {s['batch']} x {s['seq_len']} tokens (one GPU: {s['batch']} "
             f"rows; two GPUs: {s['batch'] // 2} rows each), KL distillation from the dense model, {s['precision']}, "
             f"activation checkpointing, seed 0; two GPUs: {s['two_gpus']}. Versions: {results['versions']}.", "",
             "| family | GPUs | loss, first step | loss, last 10% | mean / max step-wise rel. diff | ppl @ "
             f"{s['seq_len']} | tokens/s per GPU | scaling efficiency | peak memory per GPU (GiB) | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for family, r in results["families"].items():
        c = r["losses"]
        for gpus, key in ((1, "one"), (2, "two")):
            run = r[key]
            diff = f"{100 * c['mean_rel_diff']:.2f}% / {100 * c['max_rel_diff']:.2f}%" if gpus == 2 else ""
            eff = f"{100 * r['scaling_efficiency']:.0f}%" if gpus == 2 else ""
            mem = ", ".join(f"{m:.1f}" for m in run["peak_memory_gib"]) if run["peak_memory_gib"] else "-"
            lines.append(f"| {family} | {gpus} | {c[f'first_{key}']:.4f} | {c[f'final_{key}']:.4f} | {diff} | "
                         f"{run['ppl']:.3f} | {run['tokens_per_s_per_gpu']:,.0f} | {eff} | {mem} | "
                         f"{run['wall_seconds']} |")
    lines += ["", "Commands:", ""]
    for family, r in results["families"].items():
        lines += [f"- {family}, one GPU: `{r['one']['command']}`", f"- {family}, two GPUs: `{r['two']['command']}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for results.json and results.md")
    p.add_argument("--work", default=None, help="folder for the corpus and the models (default: a temporary one)")
    p.add_argument("--steps", type=int, default=200, help="adaptation steps (default 200)")
    p.add_argument("--batch", type=int, default=8, help="global batch in rows (default 8; even)")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--dry-run", action="store_true", help="tiny scale on a CPU, two gloo processes")
    args = p.parse_args()
    if args.batch % 2:
        p.error(f"--batch must be even (two GPUs share it), got {args.batch}")
    cuda = not args.dry_run
    if cuda and torch.cuda.device_count() < 2:
        p.error(f"two GPUs are needed, {torch.cuda.device_count()} visible; --dry-run checks the script on a CPU")
    scale = replicate.SCALES["tiny" if args.dry_run else "h200"]
    device = torch.device("cuda" if cuda else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="fsdp-"))
    results = {"gpus": 2, "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
               "date": time.strftime("%Y-%m-%d"), "versions": {"torch": torch.__version__, **replicate._versions(),
                                                   "accelerate": accelerate.__version__},
               "settings": {"steps": args.steps, "batch": args.batch, "seq_len": scale.seq_len,
                            "precision": "bf16 autocast" if cuda else "float32",
                            "two_gpus": "FSDP2, configs/accelerate/fsdp.yaml" if cuda
                            else "two CPU processes, data-parallel (dry run)"}, "families": {}}
    previous = out / "results.json"
    if previous.exists():  # an earlier call ran other families into the same OUT: keep them
        results["families"] = json.loads(previous.read_text()).get("families", {})
    prep = prepare(scale, work, device, args.steps, args.batch)
    results["pretrain"] = {k: v for k, v in prep["pretrain"].items() if k != "losses"}
    for family in args.families:
        r = {}
        for gpus, key in ((1, "one"), (2, "two")):
            folder = work / "adapted" / f"{family}-{key}"
            cmd, env = adapt_command(family, prep, folder, gpus, args.steps, args.batch, scale.seq_len, cuda)
            run = run_adapt(cmd, env, folder)
            entries = run.pop("log")
            warmup = min(10, len(entries) // 4) + 1  # compilation, autotuning, caches warming
            run.update(command=shell_line(cmd, env), tokens_per_s_per_gpu=throughput(entries, gpus, warmup),
                       peak_memory_gib=entries[-1].get("peak_memory_gib"), losses=[e["loss"] for e in entries],
                       ppl=perplexity(folder, prep["dense"], prep["held"], scale.seq_len, device, scale.ppl_windows))
            r[key] = run
            log(f"{family} on {gpus}: {run['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, ppl {run['ppl']:.3f}")
        r["losses"] = compare_losses(r["one"]["losses"], r["two"]["losses"])
        r["scaling_efficiency"] = r["two"]["tokens_per_s_per_gpu"] / r["one"]["tokens_per_s_per_gpu"]
        results["families"][family] = r
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(report(results))
    log(f"wrote {out / 'results.md'}")


if __name__ == "__main__":
    main()
