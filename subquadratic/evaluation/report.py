"""Evaluation results as a markdown table, JSON, one PNG plot per metric (a line per model), and the
"## Evaluation" section of a model card.

A result (what `suite.evaluate` returns) is {"model": name, "tasks": {task: {length: metrics}},
"skipped": {task: why}, ...}; the table has one row per model and length, one column per metric
present, and a last column saying what the row rests on (windows, prompts, sequences).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..cards import replace_section

#: (task, metric, column title) in table order.
METRICS = (
    ("ppl", "ppl", "perplexity"),
    ("kl", "kl", "KL to reference"),
    ("passkey", "accuracy", "passkey acc"),
    ("passkey", "logprob", "passkey log p"),
    ("niah", "accuracy", "NIAH acc"),
    ("niah", "logprob", "NIAH log p"),
    ("mv-niah", "accuracy", "MV-NIAH acc"),
    ("vt", "accuracy", "VT acc"),
    ("copy", "ppl_second", "copy ppl (2nd)"),
    ("copy", "ratio", "copy ratio"),
    ("mqar", "accuracy", "MQAR acc"),
)
CARD_HEADING = "## Evaluation"
#: (task, one-line definition) for the card's note, in table order.
DEFINITIONS = (
    ("ppl", "perplexity: exp of the mean next-token NLL over non-overlapping windows of each length"),
    ("kl", "KL: mean next-token KL(reference || model) in nats over the same windows"),
    ("passkey", "passkey: greedy exact-match accuracy and mean log-probability of the key's tokens"),
    ("niah", "NIAH: the same for the queried needle among several"),
    ("mv-niah", "MV-NIAH: the share of a key's several values named (all asked for at once)"),
    ("vt", "VT: the share of a variable-assignment chain's names given for its value"),
    ("copy", "copy: perplexity of a passage's second occurrence (and its ratio to the first's), pooled over "
             "the distances between them"),
    ("mqar", "MQAR: in-context associative recall accuracy at the query positions"),
)


def _columns(results: list[dict]) -> list[tuple[str, str, str]]:
    return [m for m in METRICS if any(m[0] in r["tasks"] for r in results)]


def _fmt(metric: str, value) -> str:
    if value is None:
        return "-"
    digits = {"ppl": 3, "ppl_second": 3, "ratio": 3, "logprob": 3, "accuracy": 2}.get(metric, 4)
    return f"{value if round(value, digits) else 0.0:.{digits}f}"  # no "-0.0000" for a rounding-level KL


def _lengths(result: dict) -> list[int]:
    return sorted({int(L) for task in result["tasks"].values() for L in task})


def _value(result: dict, task: str, metric: str, L: int):
    per_len = result["tasks"].get(task, {})
    row = per_len.get(L, per_len.get(str(L)))  # str keys once read back from JSON
    return None if row is None else row.get(metric)


def _count(n: int, what: str) -> str:
    return f"1 {what} only" if n == 1 else f"{n} {what}s"


def basis(result: dict, L: int) -> str:
    """What the row of `result` at length L rests on: "8 windows, 6 passkey + 6 NIAH prompts, 8 MQAR
    sequences" (one window or prompt is said: "1 window only")."""
    parts = []
    windows = _value(result, "ppl", "windows", L) or _value(result, "kl", "windows", L)
    if windows:
        parts.append(_count(windows, "window"))
    prompts = [(n, title) for task, title in (("passkey", "passkey"), ("niah", "NIAH"), ("mv-niah", "MV-NIAH"),
                                              ("vt", "VT")) if (n := _value(result, task, "prompts", L))]
    if prompts:
        parts.append(" + ".join(f"{n} {title}" for n, title in prompts)
                     + (" prompt only" if len(prompts) == 1 and prompts[0][0] == 1 else " prompts"))
    if copies := _value(result, "copy", "by_distance", L):
        n = _value(result, "copy", "windows", L)
        parts.append(f"{_count(n, 'copy window')} x {len(copies)} distances")
    if examples := _value(result, "mqar", "examples", L):
        parts.append(_count(examples, "MQAR sequence"))
    return ", ".join(parts) or "-"


def markdown_table(results: list[dict]) -> str:
    """One row per (model, length), one column per metric any result has ("-" where one has none),
    and the "measured on" column (`basis`)."""
    cols = _columns(results)
    lines = ["| model | length | " + " | ".join(c[2] for c in cols) + " | measured on |",
             "| --- | ---: | " + " | ".join("---:" for _ in cols) + " | --- |"]
    for r in results:
        for L in _lengths(r):
            cells = [_fmt(metric, _value(r, task, metric, L)) for task, metric, _ in cols]
            lines.append(f"| {r['model']} | {L} | " + " | ".join(cells) + f" | {basis(r, L)} |")
    return "\n".join(lines)


def position_table(results: list[dict]) -> str:
    """Perplexity (and KL where measured) by position in the window, at each model's longest length
    with a per-position breakdown (`ppl.position_bounds`: [0, L/4), [L/4, L/2), [L/2, L)): whether a
    model degrades in the later positions (past the length it was trained at) or not. "" when no
    result has one."""
    rows = []
    for r in results:
        for L in reversed(_lengths(r)):
            ppl = _value(r, "ppl", "by_position", L)
            if ppl:
                rows.append((r, L, ppl, _value(r, "kl", "by_position", L) or []))
                break
    if not rows:
        return ""
    spans = [f"{p['start']}-{p['end']}" for p in rows[0][2]]
    with_kl = any(kl for *_, kl in rows)
    head = [f"ppl {s}" for s in spans] + ([f"KL {s}" for s in spans] if with_kl else [])
    lines = ["| model | length | " + " | ".join(head) + " |", "| --- | ---: |" + " ---: |" * len(head)]
    for r, L, ppl, kl in rows:
        cells = [_fmt("ppl", p["ppl"]) for p in ppl] + [_fmt("kl", k["kl"]) for k in kl]
        cells += ["-"] * (len(head) - len(cells))
        lines.append(f"| {r['model']} | {L} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(results: list[dict], path: str | Path) -> Path:
    """All results as one JSON list (lengths become string keys), replaced whole (a run that writes
    it after each task leaves a complete file at every moment)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from .errors import EvaluationError

        raise EvaluationError("plots need matplotlib: pip install matplotlib (or pip install "
                              "'subquadratic[eval]'), or leave out --plot-dir") from None
    return plt


def plot_name(task: str, metric: str) -> str:
    """The file of a metric's plot: "ppl.png", "kl.png", "passkey_accuracy.png", ..."""
    return (task if metric == task else f"{task}_{metric}") + ".png"


def _labels(results: list[dict]) -> list[str]:
    """Each model's legend label: its folder name, or the name as given where two folder names clash."""
    short = [Path(str(r["model"]).rstrip("/")).name or str(r["model"]) for r in results]
    return [s if short.count(s) == 1 else str(r["model"]) for s, r in zip(short, results, strict=True)]


def metric_figures(results: list[dict]) -> list[tuple[str, object]]:
    """[(file name, matplotlib Figure)]: one figure per metric that any model has, one line per model
    that has it (the metric against the context length, log2 axis), labelled in a legend."""
    plt = require_matplotlib()
    figures = []
    for task, metric, title in _columns(results):
        fig, ax = plt.subplots(figsize=(5.0, 3.4))
        for r, label in zip(results, _labels(results), strict=True):
            pts = [(L, v) for L in _lengths(r) if (v := _value(r, task, metric, L)) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        figures.append((plot_name(task, metric), fig))
    return figures


def copy_figure(results: list[dict]):
    """("copy_by_distance.png", Figure): the perplexity of the second occurrence against the distance
    to the first, one line per model at its longest length with a copy measure (dashed: the first
    occurrence's); None when no result has one."""
    rows = []
    for r, label in zip(results, _labels(results), strict=True):
        for L in reversed(_lengths(r)):
            if by := _value(r, "copy", "by_distance", L):
                rows.append((label, L, sorted((int(d), v) for d, v in by.items())))
                break
    if not rows:
        return None
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(5.0, 3.4))
    for label, L, pts in rows:
        line, = ax.plot([d for d, _ in pts], [v["ppl_second"] for _, v in pts], marker="o", label=f"{label} @ {L}")
        ax.plot([d for d, _ in pts], [v["ppl_first"] for _, v in pts], linestyle="--", color=line.get_color(),
                alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title("copy: ppl of the 2nd occurrence (dashed: 1st)")
    ax.set_xlabel("distance to the first occurrence (tokens)")
    ax.set_ylabel("perplexity")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return "copy_by_distance.png", fig


def plot_results(results: list[dict], folder: str | Path) -> list[Path]:
    """One PNG per metric into `folder` (`metric_figures`, named by `plot_name`): every model of
    `results` overlaid, so a converted model and its dense source are compared in one figure."""
    plt = require_matplotlib()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    figures = metric_figures(results)
    if (copy := copy_figure(results)) is not None:
        figures.append(copy)
    for name, fig in figures:
        fig.savefig(folder / name, dpi=100)
        plt.close(fig)
        paths.append(folder / name)
    return paths


def card_section(results: list[dict], note: str | None = None) -> str:
    """The "## Evaluation" section: what was measured, then the table."""
    settings = results[0].get("settings", {})
    data = settings.get("data")
    lines = [CARD_HEADING, ""]
    present = {t for r in results for t in r["tasks"]}
    measures = [text for task, text in DEFINITIONS if task in present]
    lines.append(note or (
        "Measured with `subquadratic eval`" + (f" on `{Path(data).name}`" if data else "")
        + (f" (at most {settings['max_windows']} windows per length)" if settings.get("max_windows") else "")
        + ". " + "; ".join(measures) + "."
    ))
    lines += ["", markdown_table(results), ""]
    if positions := position_table(results):
        lines += ["By position in the window (tokens predicted from that far in):", "", positions, ""]
    left_out = dict.fromkeys(f"{task} {why}" for r in results for task, why in r.get("skipped", {}).items())
    if left_out:
        lines += ["Left out: " + "; ".join(left_out) + ".", ""]
    return "\n".join(lines)


def write_card_evaluation(model_dir: str | Path, results: dict | list[dict], note: str | None = None) -> Path:
    """Write (or replace) the "## Evaluation" section of `model_dir`/README.md with the table of
    `results` (one result or a list, e.g. the model and its dense source); the rest of the card is
    kept. A card without the section gets it at the end; a folder without a card gets a card of
    only that section. Returns the card's path."""
    results = [results] if isinstance(results, dict) else list(results)
    card = Path(model_dir) / "README.md"
    text = replace_section(card.read_text() if card.is_file() else "", CARD_HEADING, card_section(results, note))
    card.write_text(text)
    return card
