"""scripts/benchmarks/kernels/bench_window.py --quick runs end to end on the CPU interpreter: one row with every form
timed and the kernels' values on the banded form's."""

from __future__ import annotations

import json

import pytest

from .processes import run_script


def test_bench_window_quick_smoke(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "r.json"
    res = run_script("scripts.benchmarks.kernels.bench_window", "--quick", "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert data["meta"]["shapes"]["window"] == 32 and row["T"] == 150
    for form in ("kernel", "banded", "flash"):
        assert row[f"{form}_fwd_ms"] > 0 and row[f"{form}_fwd_bwd_ms"] > 0
    assert row["max_err_vs_banded"] <= 1e-4
    assert "| 150 |" in res.stdout
