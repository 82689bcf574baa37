"""scripts/benchmarks/kernels/bench_host.py --quick runs end to end on the CPU: the host time of an aten op and of a
one-layer model of each family."""

from __future__ import annotations

import json

from .processes import run_script


def test_bench_host_quick_smoke(tmp_path):
    out = tmp_path / "r.json"
    res = run_script("scripts.benchmarks.kernels.bench_host", "--quick", "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["host_us"]
    assert rows["aten add"] > 0
    for name in ("llama", "sse, window 64 + 4 sinks", "sse, no window", "hla"):
        assert rows[f"one-layer model forward, {name}, 16 tokens"] > rows["aten add"]
    assert "aten add" in res.stdout
