"""Every task on one model: the plan of a run (which task runs at which length, what is left out and
why, how many tokens each part forwards: `plan`), what `subquadratic eval` runs per model
(`evaluate`), and the evaluation `convert --eval-data` writes into a converted model's card
(`evaluate_conversion`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checks import device_problem
from ..data import DTYPE_CHOICES, load_stream, torch_dtype
from .copying import PASSAGE, copy_distances, copying, min_copy_length
from .errors import EvaluationError
from .kl import next_token_kl
from .mqar import mqar_eval
from .ppl import perplexity, progress_meter
from .retrieval import DEPTHS, FORWARDS_PER_PROMPT, KEYS, min_length, retrieval

TASKS = ("ppl", "passkey", "niah", "mv-niah", "vt", "copy", "mqar", "kl")
#: the retrieval tasks (`retrieval.retrieval`) and their needles per prompt: `num_needles` of the run
#: for niah and mv-niah, a chain of VT_CHAIN assignments for vt, one passkey
RETRIEVAL_TASKS = ("passkey", "niah", "mv-niah", "vt")
#: variables in a variable-tracking chain (two hops)
VT_CHAIN = 3
#: tasks that read the held-out text (--data)
TEXT_TASKS = ("ppl", "kl", "copy")
#: the tasks `evaluate` runs unless told; `subquadratic eval` runs ppl only with --data and adds kl
#: with --reference.
DEFAULT_TASKS = ("ppl", "passkey", "niah", "mqar")
#: the context lengths `subquadratic eval` measures unless told
DEFAULT_LENGTHS = (1024, 2048)
#: MQAR sequences per length (`mqar_eval`'s `examples`) unless told
MQAR_EXAMPLES = 8
#: the shortest MQAR sequence: one stored pair and one query slot
MQAR_MIN_LENGTH = 4


def resolve_device(device: str) -> torch.device:
    """"auto": CUDA when available, else the CPU; otherwise the named device."""
    if (problem := device_problem(device)) is not None:
        raise EvaluationError(problem)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise EvaluationError(f"device {device} asked for but CUDA is not available; use --device cpu")
    return d


def load_tokenizer(path: str | Path):
    """The tokenizer of a checkpoint folder; a folder without one is an EvaluationError."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(Path(path).expanduser())
    except Exception as e:  # no tokenizer files
        raise EvaluationError(f"{path} has no loadable tokenizer ({type(e).__name__}); save the tokenizer of "
                              "its source model into the folder (tokenizer.save_pretrained)") from None


def load_model(path: str | Path, *, device: str = "cpu", dtype: str = "auto"):
    """(model in eval mode on `device`, tokenizer) of a local checkpoint folder, dense or ours."""
    from transformers import AutoModelForCausalLM

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise EvaluationError(f"{path} has no config.json; give a checkpoint folder")
    if dtype not in DTYPE_CHOICES:
        raise EvaluationError(f"unknown dtype {dtype!r}; use {', '.join(DTYPE_CHOICES)}")
    tokenizer = load_tokenizer(path)
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


@dataclass(frozen=True)
class Job:
    """One task at one length: `units` windows (ppl, kl), prompts (passkey, niah) or sequences (mqar),
    and the `tokens` its forward passes take in (what a progress bar counts)."""

    task: str
    length: int
    units: int
    tokens: int


def plan(
    tokenizer,
    tasks: Iterable[str],
    seq_lens: Iterable[int],
    *,
    stream_tokens: int | None = None,
    max_windows: int | None = 8,
    trials: int = 2,
    template: str = "prose",
    num_needles: int = 4,
    mqar_examples: int = MQAR_EXAMPLES,
) -> tuple[list[Job], dict[str, str]]:
    """The jobs of a run, task by task and each task's lengths in ascending order, and for each task
    left out at some length, why: {"passkey": "at 128 (a prompt needs 248 tokens)"}. `stream_tokens`
    is the length of the held-out token stream (ppl, kl, copy)."""
    jobs: list[Job] = []
    skipped: dict[str, str] = {}

    def windows_at(L: int) -> int:  # the held-out windows of L tokens a text task reads
        n = (stream_tokens or 0) // L
        return n if max_windows is None else min(n, max_windows)

    for task in check_tasks(tasks):
        short, why = [], ""
        for L in sorted(set(seq_lens)):
            if task in ("ppl", "kl"):
                n = windows_at(L)
                why = f"the data holds {stream_tokens or 0} tokens"
                job = Job(task, L, n, (2 if task == "kl" else 1) * n * L) if n else None
            elif task == "copy":
                n = windows_at(L)
                dists = copy_distances(L)
                job = Job(task, L, n, n * len(dists) * L) if n and dists else None
                if job is None:  # the reason of the shortest length left out
                    why = why or (f"the data holds {stream_tokens or 0} tokens" if dists
                                  else f"a passage and its copy need {min_copy_length()} tokens")
            elif task in RETRIEVAL_TASKS:
                need = min_length(tokenizer, task, template, needles_of(task, num_needles))
                why = f"a prompt needs {need} tokens"
                units = trials * len(DEPTHS)
                job = Job(task, L, units, FORWARDS_PER_PROMPT * units * L) if L >= need else None
            else:  # mqar
                why = f"a sequence needs {MQAR_MIN_LENGTH} tokens"
                job = Job(task, L, mqar_examples, mqar_examples * L) if L >= MQAR_MIN_LENGTH else None
            if job is None:
                short.append(L)
            else:
                jobs.append(job)
        if short:
            skipped[task] = f"at {', '.join(map(str, short))} ({why})"
    return jobs, skipped


def needles_of(task: str, num_needles: int) -> int:
    """Needles per prompt of a retrieval task: one passkey, a VT_CHAIN-variable chain, else `num_needles`."""
    return {"passkey": 1, "vt": VT_CHAIN}.get(task, num_needles)


def skipped_line(skipped: dict[str, str]) -> str:
    """One line naming what a run left out and why: "skipped: passkey at 128 (a prompt needs 248 tokens)"."""
    return "skipped: " + "; ".join(f"{task} {why}" for task, why in skipped.items())


def evaluate(
    model,
    tokenizer,
    *,
    name: str,
    tasks: Iterable[str] = DEFAULT_TASKS,
    seq_lens: Iterable[int],
    data: str | Path | torch.Tensor | None = None,
    reference=None,
    max_windows: int | None = 8,
    batch_size: int = 1,
    trials: int = 2,
    template: str = "prose",
    num_needles: int = 4,
    mqar_examples: int = MQAR_EXAMPLES,
    text_field: str = "text",
    seed: int = 0,
    progress=False,
    on_result: Callable[[dict], None] | None = None,
) -> dict:
    """Run `tasks` on `model` at each length that fits them: {"model": name, "tasks": {task: {L:
    metrics}}, "skipped": {task: why}, "settings"}.

    `data` (a file path or a token stream [N]) is needed by ppl and kl, `reference` (a model with the
    same tokenizer) by kl. A task is left out at the lengths too short for it (`plan`; the reason goes
    to "skipped"); an error only if nothing is left to run. `progress`: False, True (one bar over
    the whole call) or a bar shared by a longer run (`ppl.progress_meter`). `on_result(result)` runs
    after each task at each length, with the result so far (the command line writes its JSON there,
    so an interrupted run keeps what it measured). Other arguments go to the task functions."""
    tasks = check_tasks(tasks)
    seq_lens = sorted(set(seq_lens))
    if not seq_lens or min(seq_lens) < 2:
        raise EvaluationError(f"context lengths must be >= 2 tokens, got {seq_lens}")
    if "kl" in tasks and reference is None:
        raise EvaluationError("task kl needs a reference model: pass --reference DIR (the dense source)")
    if {"niah", "mv-niah"} & set(tasks) and not 1 <= num_needles <= len(KEYS):
        raise EvaluationError(f"--needles must be in 1..{len(KEYS)}, got {num_needles}")
    ids = None
    if set(TEXT_TASKS) & set(tasks):
        if data is None:
            raise EvaluationError(f"tasks {', '.join(TEXT_TASKS)} need held-out text: pass --data FILE")
        ids = data if isinstance(data, torch.Tensor) else load_stream(data, tokenizer, text_field)
    jobs, skipped = plan(tokenizer, tasks, seq_lens, stream_tokens=None if ids is None else ids.numel(),
                         max_windows=max_windows, trials=trials, template=template, num_needles=num_needles,
                         mqar_examples=mqar_examples)
    if not jobs:
        raise EvaluationError(f"nothing to evaluate: {skipped_line(skipped)}; give a longer --seq-len")
    settings = {"data": None if data is None or isinstance(data, torch.Tensor) else str(data),
                "seq_lens": seq_lens, "max_windows": max_windows, "trials": trials, "template": template,
                "num_needles": num_needles, "mqar_examples": mqar_examples, "seed": seed, "copy_passage": PASSAGE}
    result = {"model": name, "tasks": {}, "skipped": skipped, "settings": settings}
    label = Path(str(name).rstrip("/")).name or str(name)
    windowed = dict(max_windows=max_windows, batch_size=batch_size)
    prompts = dict(template=template, trials=trials, seed=seed)
    with progress_meter(progress, sum(j.tokens for j in jobs), label) as meter:
        for job in jobs:
            if hasattr(meter, "set_description"):
                meter.set_description(f"{label}: {job.task} @ {job.length}")
            L = [job.length]
            if job.task == "ppl":
                out = perplexity(model, ids, L, progress=meter, **windowed)
            elif job.task == "kl":
                out = next_token_kl(model, reference, ids, L, progress=meter, **windowed)
            elif job.task == "copy":
                out = copying(model, ids, L, progress=meter, **windowed)
            elif job.task in RETRIEVAL_TASKS:
                out = retrieval(model, tokenizer, L, task=job.task, num_needles=needles_of(job.task, num_needles),
                                progress=meter, **prompts)
            else:
                vocab = min(model.config.vocab_size, len(tokenizer))
                out = mqar_eval(model, L, vocab, examples=mqar_examples, seed=seed, progress=meter)
            result["tasks"].setdefault(job.task, {}).update(out)
            if on_result is not None:
                on_result(result)
    return result


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
    """Perplexity and KL to the source of a converted folder and the source's perplexity, on `data`, and
    both models' passkey retrieval (recall beside perplexity), at `default_lengths` of the converted
    config unless `seq_lens` is given: the results that `convert --eval-data` writes into the card,
    [converted, source]."""
    model, tokenizer = load_model(model_dir, device=device)
    source, _ = load_model(source_dir, device=device)
    lengths = list(seq_lens) if seq_lens else default_lengths(model.config)
    ids = load_stream(data, tokenizer)
    common = dict(seq_lens=lengths, data=ids, max_windows=max_windows, progress=progress)
    ours = evaluate(model, tokenizer, name=name, tasks=("ppl", "kl", "passkey"), reference=source, **common)
    dense = evaluate(source, tokenizer, name=f"{Path(source_dir).name} (dense source)", tasks=("ppl", "passkey"),
                     **common)
    for r in (ours, dense):
        r["settings"]["data"] = str(data)
    return [ours, dense]
