"""Model cards say what the converted checkpoint is: every field filled from the converted config
(SPLA's forced blocks and selection, kept softmax layers and their windows), nothing left blank."""

from __future__ import annotations

import pytest

from subquadratic.conversion import convert


def _card(src, out, to, **options) -> str:
    folder = convert(str(src), str(out), to, options=options, progress=False)
    text = (folder / "README.md").read_text()
    assert "{{" not in text and "}}" not in text
    assert "pypi.org" not in text  # not published there yet
    return text


def test_spla_card_describes_the_settings(dense_checkpoint, tmp_path):
    _, src = dense_checkpoint("llama")
    text = _card(src, tmp_path / "a", "spla")
    assert "the first block and the 2 most recent blocks always included" in text
    assert "second-order Taylor score" in text and "16 blocks x 64 tokens = 1024 tokens" in text
    text = _card(src, tmp_path / "b", "spla", num_sink_blocks=0, num_local_blocks=3, top_k_blocks=8,
                 block_size=16, selection="mean")
    assert "the 3 most recent blocks always included" in text and "first block" not in text
    assert "first-order score" in text and "8 blocks x 16 tokens = 128 tokens" in text
    assert "sliding window" not in text


def test_spla_card_says_a_source_window_is_not_kept(dense_checkpoint, tmp_path):
    _, src = dense_checkpoint("mistral", sliding_window=6)
    assert "sliding window of 6 tokens" in _card(src, tmp_path / "o", "spla")


@pytest.mark.parametrize(("to", "options"), [("sse-h", {"softmax_layers": "1"}), ("hla", {"softmax_layers": "1"})])
def test_hybrid_cards_name_kept_layers_and_windows(dense_checkpoint, tmp_path, to, options):
    _, src = dense_checkpoint("mistral", sliding_window=6)
    assert "softmax layers are: 1 (sliding window 6)" in _card(src, tmp_path / "o", to, **options)
