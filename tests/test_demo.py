"""The demo's printed settings line: one short line per family, naming what was chosen."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from subquadratic.conversion import convert
from subquadratic.demo import settings_line
from subquadratic.registry import convert_target


@pytest.mark.parametrize(("to", "said"), [
    ("spla", "budget 16 blocks x 64 tokens = 1024 tokens"),
    ("sse-h", "softmax layers:"),
    ("hla", "softmax layers: none"),
])
def test_the_settings_line_is_short_and_says_the_settings(dense_checkpoint, tmp_path, to, said):
    _, src = dense_checkpoint("llama", num_hidden_layers=6)
    out = convert(str(src), str(tmp_path / to), to, progress=False)
    family, _ = convert_target(to)
    line = settings_line(family, AutoConfig.from_pretrained(out))
    assert said in line and "\n" not in line and len(line) <= 100, line
