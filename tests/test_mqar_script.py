"""scripts/studies/mqar.py: the --quick smoke run trains every (model, learning rate) job of the tiny MQAR task in
processes of its own and writes one table with every contender at the same state size; bad input is one
line and a non-zero exit."""

from __future__ import annotations

import json

from .processes import run_script


def test_mqar_quick_runs_every_job_at_equal_state(tmp_path):
    res = run_script("scripts.studies.mqar", "--quick", "--out", tmp_path, "--lrs", "3e-3,1e-2", "--steps", "5")
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "mqar.json").read_text())
    assert sorted((j["model"], j["lr"]) for j in result["jobs"]) == [
        (m, lr) for m in ("gla", "hla", "sse") for lr in (3e-3, 1e-2)]
    assert len({j["state_bytes"] for j in result["jobs"]}) == 1  # equal state size, measured
    assert result["settings"]["steps"] == 5
    for j in result["jobs"]:
        assert 0.0 <= j["accuracy"] <= 1.0 and j["final_loss"] > 0
    md = (tmp_path / "mqar.md").read_text()
    assert "| sse | 2 |" in md and "accuracy @ lr 0.01" in md


def test_mqar_rejects_unknown_models(tmp_path):
    res = run_script("scripts.studies.mqar", "--quick", "--out", tmp_path, "--models", "sse,mamba")
    assert res.returncode == 2
    assert "unknown mamba" in res.stderr and not (tmp_path / "mqar.json").exists()
