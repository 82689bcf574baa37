"""scripts/benchmarks/models/bench_generate.py --quick runs end to end on CPU (tiny model) and reports what P7 asks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_generate_quick_smoke(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "scripts.benchmarks.models.bench_generate", "--quick", "--contexts", "128,320",
           "--new-tokens", "3", "--repeats", "1", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    decode = [r for r in rows if r["what"].startswith("tok/s")]
    # SPLA: 8 pairs of caches x 2 contexts; the adapted SPLA, HLA, SSE-H and HLA-H: their default against dense's
    # (and steady) x 2
    assert len(decode) == 16 + 16 and all(r["ratio"] > 0 for r in decode)
    assert sum("spla-adapted default vs dense default" in r["what"] for r in decode) == 4
    assert sum("SPLA default vs dense default" in r["what"] for r in decode) == 4
    assert sum(f"{f} default vs dense default" in r["what"] for r in decode for f in ("hla", "sse-h", "hla-h")) == 12
    eager = [r for r in decode if "SPLA eager vs dense eager" in r["what"]]
    # generate == loop
    assert len(eager) == 4 and all(r["spla"]["same_tokens"] and r["dense"]["same_tokens"] for r in eager)
    same = [r for r in rows if "vs SPLA eager: equal greedy steps" in r["what"]]
    assert len(same) == 4 and all(r["ours"] == r["peer"] == "3" and r["ratio"] < 1e-5 for r in same)
    linear = {r["what"].split()[0]: r for r in rows if "linear-layer cache bytes" in r["what"]}
    assert set(linear) == {"hla", "sse-h", "hla-h"} and all(r["ratio"] == 1.0 for r in linear.values())
    soft = [r for r in rows if "softmax-layer KV bytes" in r["what"]]
    assert len(soft) == 2 and all(r["ratio"] == 320 / 128 for r in soft)  # the hybrids' softmax layers grow
