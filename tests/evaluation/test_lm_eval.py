"""Converted checkpoints load in lm-eval's Hugging Face backend (`lm_eval --model hf`), shown on a
two-choice task read from a local file (tests/evaluation/lm_eval_task), offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"


@pytest.mark.slow
def test_lm_eval_hf_backend_runs_a_local_task_on_a_converted_model(checkpoints, tmp_path):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds")}
    r = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf",
         "--model_args", f"pretrained={checkpoints['spla']},trust_remote_code=True",
         "--tasks", "tiny_colors", "--include_path", str(TASK_DIR), "--device", "cpu", "--batch_size", "1",
         "--output_path", str(tmp_path / "out")],
        cwd=TASK_DIR, capture_output=True, text=True, timeout=600, env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("results*.json")]
    assert len(results) == 1
    acc = results[0]["results"]["tiny_colors"]["acc,none"]
    assert 0.0 <= acc <= 1.0 and results[0]["n-samples"]["tiny_colors"]["effective"] == 6
