"""Every task on one model: what `subquadratic eval` runs per model, and the evaluation `convert
--eval-data` writes into a converted model's card."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from ..data import DTYPE_CHOICES, load_stream, torch_dtype
from .errors import EvaluationError
from .kl import next_token_kl
from .mqar import mqar_eval
from .ppl import perplexity
from .retrieval import min_length, niah, passkey

TASKS = ("ppl", "passkey", "niah", "mqar", "kl")


def resolve_device(device: str) -> torch.device:
    """"auto": CUDA when available, else the CPU; otherwise the named device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except RuntimeError:
        raise EvaluationError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise EvaluationError(f"device {device} asked for but CUDA is not available; use --device cpu")
    return d


def load_model(path: str | Path, *, device: str = "cpu", dtype: str = "auto"):
    """(model in eval mode on `device`, tokenizer) of a local checkpoint folder, dense or ours."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise EvaluationError(f"{path} has no config.json; give a checkpoint folder")
    if dtype not in DTYPE_CHOICES:
        raise EvaluationError(f"unknown dtype {dtype!r}; use {', '.join(DTYPE_CHOICES)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # no tokenizer files
        raise EvaluationError(f"{path} has no loadable tokenizer ({type(e).__name__}); save the tokenizer of "
                              "its source model into the folder (tokenizer.save_pretrained)") from None
    weights = dtype if dtype == "auto" else torch_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=weights).to(resolve_device(device)).eval()
    return model, tokenizer


def default_lengths(config) -> list[int]:
    """Lengths for a model card: inside and at twice a sparse budget (`config.budget_tokens`, where the
    family has one), else 1024 and 2048; capped at `max_position_embeddings`."""
    budget = getattr(config, "budget_tokens", None) or 1024
    cap = getattr(config, "max_position_embeddings", None) or 2 * budget
    return sorted({min(budget, cap), min(2 * budget, cap)})


def check_tasks(tasks: Iterable[str]) -> list[str]:
    tasks = [t.strip() for t in tasks if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise EvaluationError(f"unknown task(s) {', '.join(bad) or '(none)'}; choose from {','.join(TASKS)}")
    return tasks


def evaluate(
    model,
    tokenizer,
    *,
    name: str,
    tasks: Iterable[str] = ("ppl", "passkey", "niah", "mqar"),
    seq_lens: Iterable[int],
    data: str | Path | torch.Tensor | None = None,
    reference=None,
    max_windows: int | None = 8,
    batch_size: int = 1,
    trials: int = 2,
    template: str = "prose",
    num_needles: int = 4,
    text_field: str = "text",
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Run `tasks` on `model` at each length: {"model": name, "tasks": {task: {L: metrics}}, "settings"}.

    `data` (a file path or a token stream [N]) is needed by ppl and kl, `reference` (a model with the
    same tokenizer) by kl. Other arguments go to the task functions."""
    tasks = check_tasks(tasks)
    seq_lens = sorted(set(seq_lens))
    if not seq_lens or min(seq_lens) < 2:
        raise EvaluationError(f"context lengths must be >= 2 tokens, got {seq_lens}")
    if "kl" in tasks and reference is None:
        raise EvaluationError("task kl needs a reference model: pass --reference DIR (the dense source)")
    for task, needles in (("passkey", 1), ("niah", num_needles)):
        shortest = min_length(tokenizer, task, template, needles) if task in tasks else 0
        if seq_lens[-1] < shortest:  # fail before any work; shorter lengths are left out of that task
            raise EvaluationError(f"every length is too short for a {task} prompt (at least {shortest} tokens "
                                  "with this tokenizer); add a longer --seq-len or leave the task out of --tasks")
    ids = None
    if {"ppl", "kl"} & set(tasks):
        if data is None:
            raise EvaluationError("tasks ppl and kl need held-out text: pass --data FILE")
        ids = data if isinstance(data, torch.Tensor) else load_stream(data, tokenizer, text_field)
    common = dict(max_windows=max_windows, batch_size=batch_size, progress=progress)
    out: dict[str, dict] = {}
    for task in tasks:
        if task == "ppl":
            out[task] = perplexity(model, ids, seq_lens, **common)
        elif task == "kl":
            out[task] = next_token_kl(model, reference, ids, seq_lens, **common)
        elif task == "passkey":
            out[task] = passkey(model, tokenizer, seq_lens, template=template, trials=trials, seed=seed,
                                progress=progress)
        elif task == "niah":
            out[task] = niah(model, tokenizer, seq_lens, template=template, num_needles=num_needles,
                             trials=trials, seed=seed, progress=progress)
        elif task == "mqar":
            vocab = min(model.config.vocab_size, len(tokenizer))
            out[task] = mqar_eval(model, seq_lens, vocab, seed=seed, progress=progress)
    settings = {"data": None if data is None or isinstance(data, torch.Tensor) else str(data),
                "seq_lens": seq_lens, "max_windows": max_windows, "trials": trials, "template": template,
                "num_needles": num_needles, "seed": seed}
    return {"model": name, "tasks": out, "settings": settings}


def evaluate_conversion(
    model_dir: str | Path,
    source_dir: str | Path,
    data: str | Path,
    *,
    seq_lens: Iterable[int] | None = None,
    max_windows: int | None = 8,
    device: str = "cpu",
    name: str = "this model",
    progress: bool = False,
) -> list[dict]:
    """Perplexity and KL to the source of a converted folder, and the source's perplexity, on `data`
    (at `default_lengths` of the converted config unless `seq_lens` is given): the results that
    `convert --eval-data` writes into the card, [converted, source]."""
    model, tokenizer = load_model(model_dir, device=device)
    source, _ = load_model(source_dir, device=device)
    lengths = list(seq_lens) if seq_lens else default_lengths(model.config)
    ids = load_stream(data, tokenizer)
    common = dict(seq_lens=lengths, data=ids, max_windows=max_windows, progress=progress)
    ours = evaluate(model, tokenizer, name=name, tasks=("ppl", "kl"), reference=source, **common)
    dense = evaluate(source, tokenizer, name=f"{Path(source_dir).name} (dense source)", tasks=("ppl",), **common)
    for r in (ours, dense):
        r["settings"]["data"] = str(data)
    return [ours, dense]
