"""What a user gets on the CPU: `generate()` and `adapt` of SmolLM2-135M-Instruct converted with each
target's defaults, against the dense model, measured interleaved in one process (fp32, batch 1 for
generation).

  python -m scripts.benchmarks.models.bench_cpu_paths [--families spla,hla-h,sse-h] [--prompts 256,2048]
                                                      [--new-tokens 16] [--rounds 3] [--rows 2x256] [--out r.json]
  python -m scripts.benchmarks.models.bench_cpu_paths --quick     # a tiny random Llama: a smoke run

generate: for each prompt length, after an untimed call of each model, rounds alternate between the
models; each round is one greedy `generate(max_new_tokens=N + 1)` (`min_new_tokens` set, so every
model decodes as many), timed at the end of each step: the prefill is the time to the first new
token, the decode speed N over the time from there to the last. The fastest
round of each model is printed (on a CPU shared with other jobs a slower round is their load), with
its ratio to the dense model (higher is faster); every round is in the JSON. A 256-token prompt
and 16 new tokens stay inside SPLA's 1024-token budget; a 2048-token prompt is beyond it.

adapt: `subquadratic adapt`'s steps (`adaptation.adapt`: KL to the dense teacher, every parameter
trained, AdamW; the hybrids' first --stage1 steps attention transfer) on rows of --rows tokens, the
seconds of each step from its `adapt_log.jsonl` (the first step apart), against a dense training
step on rows of the same layout from the same text (forward with the next-token loss, backward,
AdamW), timed before and after each family's run. Printed: the fastest step of each stage and its
ratio to the fastest dense step (lower is faster); every step is in the JSON.

The conversions (`conversion.convert`: SSE-H and HLA-H then keep softmax at evenly spaced layers,
as many as `subquadratic convert`'s measured choice, so the same cost) go to --work (kept and reused
when given, else a temporary folder, about 0.6 GB each); the SmolLM2 folder to the demo's cache
(`subquadratic.demo.assets`).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

#: the targets it converts to (any of `subquadratic convert --to`)
FAMILIES = ("spla", "hla-h", "sse-h", "hla", "sse")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def generate_times(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(seconds to the first new token, decode tokens/s over the `new_tokens` after it) of one greedy
    generate() call, from the times each step ends (a stopping criterion that records them)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Stamps(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    stamps, n = Stamps(), new_tokens + 1
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                             max_new_tokens=n, min_new_tokens=n, stopping_criteria=StoppingCriteriaList([stamps]))
    assert out.shape[1] == ids.shape[1] + n and len(stamps.times) == n
    return stamps.times[0] - t, new_tokens / (stamps.times[-1] - stamps.times[0])


def bench_generate(models: dict, lengths: list[int], new_tokens: int, rounds: int, vocab: int) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for T in lengths:
        ids = torch.randint(100 if vocab > 1000 else 1, vocab, (1, T), generator=gen)
        runs: dict[str, list] = {name: [] for name in models}
        for model in models.values():  # untimed: the first call of a shape pays one-time costs
            generate_times(model, ids, 2)
        for r in range(rounds):
            for name, model in models.items():
                runs[name].append(generate_times(model, ids, new_tokens))
            log(f"generate from {T} tokens: round {r + 1} of {rounds}")
        med = {n: (min(x[0] for x in v), max(x[1] for x in v)) for n, v in runs.items()}  # the fastest rounds
        for name, (pre, tps) in med.items():
            rows.append({"prompt": T, "model": name, "prefill_s": round(pre, 3), "decode_tok_s": round(tps, 2),
                         "prefill_x": round(med["dense"][0] / pre, 2), "decode_x": round(tps / med["dense"][1], 2),
                         "rounds": [[round(a, 3), round(b, 2)] for a, b in runs[name]]})
    return rows


def dense_step_seconds(dense: Path, rows: torch.Tensor, steps: int) -> list[float]:
    """Seconds of `steps` dense training steps (forward with the next-token loss, backward, AdamW) on `rows`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        model(input_ids=rows, labels=rows).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(time.perf_counter() - t)
    return out


def adapt_steps(dense: Path, converted: Path, text: Path, out: Path, layout: tuple[int, int], steps: int,
                stage1: int) -> dict[int, list[float]]:
    """Seconds of each step of `adapt` after the first, by stage: {1: [...], 2: [...]}."""
    from subquadratic.adaptation import AdaptConfig, adapt

    rows, length = layout
    cfg = AdaptConfig(student=str(converted), output_dir=str(out), data=[str(text)], teacher=str(dense),
                      max_steps=steps, stage1_steps=stage1, loss="kl", train="full", seq_len=length, batch_size=rows,
                      save_every=10 ** 6, progress=False, overwrite=True, cpu=True)
    adapt(cfg)
    logged = [json.loads(line) for line in (out / "adapt_log.jsonl").read_text().splitlines()]
    by_stage: dict[int, list[float]] = {}
    for a, b in zip(logged, logged[1:], strict=False):
        by_stage.setdefault(b["stage"], []).append(b["seconds"] - a["seconds"])
    return by_stage


def bench_adapt(dense: Path, folders: dict, text: Path, tokenizer, layout: tuple[int, int], steps: int,
                stage1: int, dense_steps: int, work: Path) -> list[dict]:
    rows, length = layout
    ids = tokenizer(text.read_text(), return_tensors="pt").input_ids[0]
    if ids.numel() < rows * length:
        raise SystemExit(f"the training text holds {ids.numel()} tokens, fewer than one step's {rows} x {length}")
    batch = ids[: rows * length].view(rows, length)
    out = []
    for name, folder in folders.items():
        hybrid = name != "spla"
        before = dense_step_seconds(dense, batch, dense_steps)[1:]
        log(f"dense training step: {[round(s, 2) for s in before]} s")
        stages = adapt_steps(dense, folder, text, work / f"adapted-{name}", layout, steps, stage1 if hybrid else 0)
        after = dense_step_seconds(dense, batch, dense_steps)[1:]
        log(f"{name} adapt steps: {json.dumps({k: [round(s, 2) for s in v] for k, v in stages.items()})}; dense "
            f"after: {[round(s, 2) for s in after]} s")
        ref = min(before + after)
        row = {"family": name, "rows": rows, "seq_len": length, "dense_step_s": round(ref, 3),
               "dense_steps": [round(s, 3) for s in before + after]}
        for stage, secs in sorted(stages.items()):
            best = min(secs)
            row[f"stage{stage}_s"], row[f"stage{stage}_x"] = round(best, 3), round(best / ref, 2)
            row[f"stage{stage}_steps"] = [round(s, 3) for s in secs]
        out.append(row)
    return out


def environment(commit_of: Path) -> dict:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "-C", str(commit_of), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"date": time.strftime("%Y-%m-%d"), "cpu": cpu, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": commit}


def parse_layout(text: str) -> tuple[int, int]:
    rows, _, length = text.lower().partition("x")
    if not rows.isdigit() or not length.isdigit() or int(rows) < 1 or int(length) < 2:
        raise SystemExit(f"--rows: {text!r} is not ROWSxLENGTH (e.g. 2x256)")
    return int(rows), int(length)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="spla,hla-h,sse-h", help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--prompts", default="256,2048", help="comma list of prompt lengths of generate()")
    ap.add_argument("--new-tokens", type=int, default=16, help="decoded tokens timed per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of generate() (the fastest is reported)")
    ap.add_argument("--rows", default="2x256", help="adapt's rows per step, ROWSxLENGTH")
    ap.add_argument("--steps", type=int, default=4, help="adapt steps per family (the first is not counted)")
    ap.add_argument("--stage1", type=int, default=2, help="of them attention transfer, for the hybrids")
    ap.add_argument("--dense-steps", type=int, default=3, help="dense training steps before and after each "
                                                                "family's adapt (the first not counted)")
    ap.add_argument("--skip", choices=("generate", "adapt"), action="append", default=[], help="leave a part out")
    ap.add_argument("--work", default=None, help="folder for the conversions, kept and reused (default: temporary)")
    ap.add_argument("--out", default=None, help="write the figures and the environment as JSON")
    ap.add_argument("--quick", action="store_true", help="a tiny random Llama, short prompts and rows (smoke run)")
    args = ap.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if unknown := [f for f in families if f not in FAMILIES]:
        ap.error(f"unknown families {', '.join(unknown)}; take from {', '.join(FAMILIES)}")
    layout = parse_layout(args.rows)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import subquadratic  # noqa: F401  (registers the model types)
    from subquadratic.conversion import convert

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-cpu-paths-"))
    work.mkdir(parents=True, exist_ok=True)
    text = work / "train.txt"
    if args.quick:  # a tiny random Llama with a tokenizer learned from the package's own sources
        from scripts.studies.real_quality import SCALES, tiny_dense

        sources = sorted(Path(subquadratic.__file__).parent.rglob("*.py"))
        text.write_text("\n\n".join(p.read_text() for p in sources))
        (work / "train.jsonl").write_text("".join(json.dumps({"text": p.read_text()}) + "\n" for p in sources))
        dense = tiny_dense(SCALES["tiny"], work / "dense", work / "train.jsonl")
        args.prompts, args.new_tokens, args.rounds, layout, args.steps, args.dense_steps = "24,96", 4, 1, (2, 64), 3, 2
    else:
        from subquadratic.demo.assets import smollm2_checkpoint

        dense = smollm2_checkpoint()
        sources = sorted(Path(subquadratic.__file__).parent.rglob("*.py"))
        text.write_text("\n\n".join(p.read_text() for p in sources))  # the adapt text: the package's sources
    folders = {}
    for name in families:
        folder = work / name
        if not (folder / "config.json").is_file():
            convert(str(dense), str(folder), name, progress=False)
        folders[name] = folder
    env = environment(Path(__file__).resolve().parent)
    log(json.dumps(env))
    result: dict = {"environment": env, "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work")}}
    if "generate" not in args.skip:
        models = {"dense": AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()}
        for name, folder in folders.items():
            models[name] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        vocab = min(40000, models["dense"].config.vocab_size)
        lengths = [int(x) for x in args.prompts.split(",")]
        result["generate"] = bench_generate(models, lengths, args.new_tokens, args.rounds, vocab)
        del models
        print(f"\ngenerate(), greedy, batch 1, {args.new_tokens} tokens decoded, fastest of {args.rounds} rounds")
        print("| prompt | model | prefill s | decode tok/s | prefill x dense | decode x dense |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in result["generate"]:
            print(f"| {r['prompt']} | {r['model']} | {r['prefill_s']:.3f} | {r['decode_tok_s']:.2f} | "
                  f"{r['prefill_x']:.2f} | {r['decode_x']:.2f} |")
    if "adapt" not in args.skip:
        tokenizer = AutoTokenizer.from_pretrained(dense)
        result["adapt"] = bench_adapt(dense, folders, text, tokenizer, layout, args.steps, args.stage1,
                                      args.dense_steps, work)
        print(f"\nadapt against a dense training step, {layout[0]} x {layout[1]} tokens per step")
        print("| family | dense step s | attention transfer s (x dense) | KL step s (x dense) |")
        print("| --- | --- | --- | --- |")
        for r in result["adapt"]:
            cells = [f"{r[f'stage{s}_s']:.2f} ({r[f'stage{s}_x']:.2f}x)" if f"stage{s}_s" in r else "-" for s in (1, 2)]
            print(f"| {r['family']} | {r['dense_step_s']:.2f} | {' | '.join(cells)} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
