"""The table and the model card's Evaluation section."""

from __future__ import annotations

from subquadratic.evaluation import markdown_table, write_card_evaluation

RESULT = {"model": "m", "tasks": {"ppl": {64: {"ppl": 12.3456}, 128: {"ppl": 11.0}},
                                  "passkey": {128: {"accuracy": 0.5, "logprob": -1.25}}},
          "settings": {"data": "/x/held.jsonl", "max_windows": 4}}


def test_table_has_a_row_per_length_and_a_dash_where_a_task_skipped_it():
    lines = markdown_table([RESULT]).splitlines()
    assert lines[0] == "| model | length | perplexity | passkey acc | passkey log p |"
    assert lines[2:] == ["| m | 64 | 12.346 | - | - |", "| m | 128 | 11.000 | 0.50 | -1.250 |"]


def test_card_section_is_added_then_replaced_keeping_the_rest(tmp_path):
    card = tmp_path / "README.md"
    card.write_text("---\ntags: [x]\n---\n\n# Model\n\nintro\n\n## Evaluation\n\nold table\n\n## How to load\n\ncode\n")
    write_card_evaluation(tmp_path, RESULT)
    text = card.read_text()
    assert "old table" not in text and text.count("## Evaluation") == 1
    assert text.startswith("---\ntags: [x]\n---\n\n# Model\n\nintro\n\n## Evaluation\n")
    assert text.endswith("## How to load\n\ncode\n") and "| m | 128 | 11.000 | 0.50 | -1.250 |" in text
    assert "on `held.jsonl` (at most 4 windows per length)" in text
    write_card_evaluation(tmp_path, RESULT)
    assert card.read_text() == text
    card.write_text("# Model\n")
    write_card_evaluation(tmp_path, [RESULT, {**RESULT, "model": "n"}])
    assert card.read_text().startswith("# Model\n\n## Evaluation\n") and "| n | 64 |" in card.read_text()
