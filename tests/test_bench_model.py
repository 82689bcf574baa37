"""scripts/bench_model.py --quick runs end to end on CPU (tiny model) and reports every M1 / M2 row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_model_quick_smoke(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_model.py"), "--quick", "--repeats", "1", "--out", str(out),
           "--profile", "128", "--profile-host", "5", "--profile-out", str(tmp_path / "prof.txt")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    keys = {(r["measure"], r["T"], r["family"]) for r in rows}
    families = ("spla", "sse-h", "hla")
    assert keys == {("ttft", T, f) for T in (128, 320) for f in families} | {("train", 128, f) for f in families}
    assert all(r["error"] is None and r["dense_ms"] > 0 and r["ours_ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert "| M1 | time to first token | 320 | spla |" in res.stdout  # the Markdown table for docs/benchmarks.md
    tables = (tmp_path / "prof.txt").read_text()  # one profiler table per model and measure at 128 tokens
    for name in ("dense", *families):
        for what in ("ttft", "train"):
            assert f"{name} {what} T=128: " in tables
