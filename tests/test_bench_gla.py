"""scripts/benchmarks/kernels/bench_gla.py --quick runs end to end on the CPU interpreter: every row is there, times are
positive, and SPLA's causal linear term on the kernels agrees with the PyTorch form it replaced."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_bench_gla_quick_smoke(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "scripts.benchmarks.kernels.bench_gla", "--quick", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if not __import__("torch").cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    timed = {r["what"]: r for r in rows if r["id"] == "-" and "ours_ms" in r}
    for kind in ("none", "head", "key", "key varlen"):
        for what in ("fwd", "fwd+bwd"):
            r = timed[f"{kind} decay {what}"]
            assert r["ours_ms"] > 0 and r["floor_ms"] > 0 and math.isnan(r["peer_ms"])  # no fla peer in --quick
    assert sum(r["id"] == "P6" for r in rows) == 8
    spla = [r for r in rows if r["what"].startswith("SPLA causal linear term HQ4 H2")]
    assert len(spla) == 2 and all(r["ours_ms"] > 0 and r["peer_ms"] > 0 for r in spla)
    diff = [r for r in rows if "relative difference" in r["what"]]
    assert len(diff) == 1 and diff[0]["ratio"] <= 1e-5
