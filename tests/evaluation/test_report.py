"""The table (a row per model and length, saying what each row rests on), the model card's
Evaluation section, and the plots: one figure per metric, a line per model, no empty panel."""

from __future__ import annotations

import pytest

from subquadratic.evaluation import markdown_table, metric_figures, plot_results, position_table, write_card_evaluation
from subquadratic.evaluation.report import card_section

RESULT = {"model": "m", "tasks": {"ppl": {64: {"ppl": 12.3456, "windows": 4}, 128: {"ppl": 11.0, "windows": 1}},
                                  "passkey": {128: {"accuracy": 0.5, "logprob": -1.25, "prompts": 6}}},
          "skipped": {"passkey": "at 64 (a prompt needs 100 tokens)"},
          "settings": {"data": "/x/held.jsonl", "max_windows": 4}}


def test_table_has_a_row_per_length_a_dash_where_a_task_skipped_it_and_what_each_row_rests_on():
    lines = markdown_table([RESULT]).splitlines()
    assert lines[0] == "| model | length | perplexity | passkey acc | passkey log p | measured on |"
    assert lines[2:] == ["| m | 64 | 12.346 | - | - | 4 windows |",
                         "| m | 128 | 11.000 | 0.50 | -1.250 | 1 window only, 6 passkey prompts |"]
    both = {"model": "n", "tasks": {"kl": {64: {"kl": 0.1, "windows": 8}}, "mqar": {64: {"accuracy": 0.2,
                                                                                        "examples": 8}},
                                    "passkey": {64: {"accuracy": 1.0, "logprob": -1.0, "prompts": 1}},
                                    "niah": {64: {"accuracy": 0.0, "logprob": -2.0, "prompts": 3}}}}
    assert markdown_table([both]).splitlines()[2].endswith(
        "| 8 windows, 1 passkey + 3 NIAH prompts, 8 MQAR sequences |")


def _by_position(key: str, values: list[float]) -> list[dict]:
    spans = ((0, 32), (32, 64), (64, 128))[:len(values)]
    return [{"start": a, "end": b, key: v} for (a, b), v in zip(spans, values, strict=True)]


def test_positions_table_at_each_models_longest_length_with_a_breakdown():
    assert position_table([RESULT]) == ""  # no breakdown measured
    dense = {"model": "dense", "tasks": {"ppl": {64: {"ppl": 9.0, "by_position": _by_position("ppl", [1, 2])},
                                                 "128": {"ppl": 8.0,
                                                         "by_position": _by_position("ppl", [9.5, 8.25, 7.125])}}}}
    ours = {"model": "ours", "tasks": {"ppl": {128: {"ppl": 9.0, "by_position": _by_position("ppl", [10, 9, 8.5])}},
                                       "kl": {128: {"kl": 0.2, "by_position": _by_position("kl", [0.1, 0.2, 0.25])}}}}
    lines = position_table([dense, ours]).splitlines()
    assert lines[0] == "| model | length | ppl 0-32 | ppl 32-64 | ppl 64-128 | KL 0-32 | KL 32-64 | KL 64-128 |"
    assert lines[2:] == ["| dense | 128 | 9.500 | 8.250 | 7.125 | - | - | - |",
                         "| ours | 128 | 10.000 | 9.000 | 8.500 | 0.1000 | 0.2000 | 0.2500 |"]
    assert "By position in the window" in card_section([dense, ours])
    assert "By position" not in card_section([RESULT])


def test_card_section_is_added_then_replaced_keeping_the_rest(tmp_path):
    card = tmp_path / "README.md"
    card.write_text("---\ntags: [x]\n---\n\n# Model\n\nintro\n\n## Evaluation\n\nold table\n\n## How to load\n\ncode\n")
    write_card_evaluation(tmp_path, RESULT)
    text = card.read_text()
    assert "old table" not in text and text.count("## Evaluation") == 1
    assert text.startswith("---\ntags: [x]\n---\n\n# Model\n\nintro\n\n## Evaluation\n")
    assert text.endswith("## How to load\n\ncode\n") and "| m | 128 | 11.000 | 0.50 | -1.250 |" in text
    assert "on `held.jsonl` (at most 4 windows per length)" in text
    assert "Left out: passkey at 64 (a prompt needs 100 tokens)." in text
    write_card_evaluation(tmp_path, RESULT)
    assert card.read_text() == text
    card.write_text("# Model\n")
    write_card_evaluation(tmp_path, [RESULT, {**RESULT, "model": "n"}])
    assert card.read_text().startswith("# Model\n\n## Evaluation\n") and "| n | 64 |" in card.read_text()


def test_each_metric_gets_one_figure_with_a_line_per_model(tmp_path):
    pytest.importorskip("matplotlib")
    dense = {"model": "runs/SmolLM2", "tasks": {"ppl": {512: {"ppl": 10.0}, 1024: {"ppl": 9.0}},
                                                 "mqar": {512: {"accuracy": 0.5}, 1024: {"accuracy": 0.4}}}}
    spla = {"model": "runs/SmolLM2-spla/", "tasks": {"ppl": {512: {"ppl": 10.0}, 1024: {"ppl": 9.5}},
                                                      "kl": {512: {"kl": 0.0}, 1024: {"kl": 0.02}},
                                                      "mqar": {512: {"accuracy": 0.5}}}}
    figures = dict(metric_figures([dense, spla]))
    assert list(figures) == ["ppl.png", "kl.png", "mqar_accuracy.png"]  # only the metrics present
    for name, fig in figures.items():
        (ax,) = fig.axes  # one panel per figure: none empty
        lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend == list(lines) and ax.get_xscale() == "log"
        if name == "ppl.png":  # the dense model and its conversion overlaid
            assert lines == {"SmolLM2": ([512, 1024], [10.0, 9.0]), "SmolLM2-spla": ([512, 1024], [10.0, 9.5])}
        elif name == "kl.png":  # only the model that has the metric
            assert lines == {"SmolLM2-spla": ([512, 1024], [0.0, 0.02])}
        else:
            assert lines == {"SmolLM2": ([512, 1024], [0.5, 0.4]), "SmolLM2-spla": ([512], [0.5])}
    paths = plot_results([dense, spla], tmp_path / "plots")
    assert [p.name for p in paths] == list(figures)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
