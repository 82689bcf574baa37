"""scripts/tools/plot_attention.py runs headless on a tiny SPLA model beyond its budget and on a hybrid's
state layer (a one-line refusal), and plots the blocks the layer's selection took."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from subquadratic import SPLAConfig, SPLAForCausalLM
from tests.adaptation.conftest import VOCAB, corpus_files, train_tokenizer

pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parent.parent


def run(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "scripts.tools.plot_attention", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=180)


def test_plot_attention_draws_the_selected_blocks(tmp_path):
    files, held = corpus_files(tmp_path / "corpus")
    tok = train_tokenizer(files)
    cfg = SPLAConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, block_size=8, top_k_blocks=4,
                     mixer_types=["spla", "full_attention"], pad_token_id=0, eos_token_id=1)
    folder = tmp_path / "spla"
    SPLAForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    out = tmp_path / "layer0.png"
    res = run(folder, "--file", held, "--max-tokens", 96, "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "96 tokens, budget 4 blocks of 8; the last query read 4 of 12 blocks" in res.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    softmax = run(folder, "--file", held, "--max-tokens", 32, "--layer", 1, "--out", tmp_path / "layer1.png")
    assert softmax.returncode == 0 and (tmp_path / "layer1.png").is_file(), softmax.stderr[-2000:]
