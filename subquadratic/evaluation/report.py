"""Evaluation results as a markdown table, JSON, one PNG plot per model, and the "## Evaluation"
section of a model card.

A result (what `suite.evaluate` returns) is {"model": name, "tasks": {task: {length: metrics}}, ...};
the table has one row per model and length and one column per metric present.
"""

from __future__ import annotations

import json
import re
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
    ("mqar", "accuracy", "MQAR acc"),
)
CARD_HEADING = "## Evaluation"
#: (task, one-line definition) for the card's note, in table order.
DEFINITIONS = (
    ("ppl", "perplexity: exp of the mean next-token NLL over non-overlapping windows of each length"),
    ("kl", "KL: mean next-token KL(reference || model) in nats over the same windows"),
    ("passkey", "passkey: greedy exact-match accuracy and mean log-probability of the key's tokens"),
    ("niah", "NIAH: the same for the queried needle among several"),
    ("mqar", "MQAR: in-context associative recall accuracy at the query positions"),
)


def _columns(results: list[dict]) -> list[tuple[str, str, str]]:
    return [m for m in METRICS if any(m[0] in r["tasks"] for r in results)]


def _fmt(metric: str, value) -> str:
    if value is None:
        return "-"
    digits = {"ppl": 3, "logprob": 3, "accuracy": 2}.get(metric, 4)
    return f"{value:.{digits}f}"


def _lengths(result: dict) -> list[int]:
    return sorted({int(L) for task in result["tasks"].values() for L in task})


def _value(result: dict, task: str, metric: str, L: int):
    per_len = result["tasks"].get(task, {})
    row = per_len.get(L, per_len.get(str(L)))  # str keys once read back from JSON
    return None if row is None else row.get(metric)


def markdown_table(results: list[dict]) -> str:
    """One row per (model, length), one column per metric any result has; "-" where one has none."""
    cols = _columns(results)
    lines = ["| model | length | " + " | ".join(c[2] for c in cols) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in cols) + " |"]
    for r in results:
        for L in _lengths(r):
            cells = [_fmt(metric, _value(r, task, metric, L)) for task, metric, _ in cols]
            lines.append(f"| {r['model']} | {L} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(results: list[dict], path: str | Path) -> Path:
    """All results as one JSON list (lengths become string keys)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
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


def plot_name(model: str) -> str:
    """A file name for the plot of `model` (its folder name, unsafe characters replaced)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model.rstrip("/")).name or model) + ".png"


def plot_result(result: dict, path: str | Path) -> Path:
    """One PNG for one model: a panel per metric, the metric against the context length."""
    plt = require_matplotlib()
    cols = _columns([result])
    ncols = min(4, len(cols))
    nrows = -(-len(cols) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.8 * nrows), squeeze=False)
    for ax in axes.flat[len(cols):]:
        ax.set_visible(False)
    for ax, (task, metric, title) in zip(axes.flat, cols, strict=False):
        pts = [(L, v) for L in _lengths(result) if (v := _value(result, task, metric, L)) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, alpha=0.3)
    fig.suptitle(result["model"])
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_results(results: list[dict], folder: str | Path) -> list[Path]:
    """`plot_result` for each model into `folder`, named by `plot_name`."""
    return [plot_result(r, Path(folder) / plot_name(r["model"])) for r in results]


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
