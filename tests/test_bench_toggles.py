"""scripts/benchmarks/models/bench_toggles.py --quick runs end to end on the CPU: every setting of each
family measured, the dense peer once, the training pair, a ratio per row."""

from __future__ import annotations

import json

from .processes import run_script


def test_bench_toggles_quick_smoke(tmp_path):
    out = tmp_path / "r.json"
    res = run_script("scripts.benchmarks.models.bench_toggles", "--quick", "--repeats", "2", "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    got = {(r["model"], r["measure"], r["T"], r["setting"]) for r in rows}
    for T in (64, 128):
        assert ("dense", "ttft", T, "new") in got
        for s in ("new", "old", "no-fast-launch", "no-rms-norm", "no-router"):
            assert ("sse-h", "ttft", T, s) in got
        assert ("hla-h", "ttft", T, "no-rms-norm") in got and ("hla-h", "ttft", T, "no-router") not in got
    assert {("sse-h", "train", 64, "new"), ("sse-h", "train", 64, "old"), ("hla-h", "train", 64, "old"),
            ("sse-h", "train", 64, "no-packed-grad"), ("hla-h", "train", 64, "no-swiglu-grad")} <= got
    assert all(r["wall_ms"] > 0 for r in rows) and all(r["host_ms"] <= r["wall_ms"] for r in rows if "host_ms" in r)
    assert "| sse-h | ttft | 128 | no-router |" in res.stdout
