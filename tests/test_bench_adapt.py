"""scripts/benchmarks/models/bench_adapt.py: the --quick smoke run adapts each family's conversion of a
tiny Llama for two steps through `adapt()`, and the peak breakdown replays an allocator trace to its
largest live total."""

from __future__ import annotations

import json

from .processes import run_script


def test_bench_adapt_quick_smoke(tmp_path):
    out = tmp_path / "r.json"
    res = run_script("scripts.benchmarks.models.bench_adapt", "--quick", "--work", tmp_path / "work", "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["family"] for r in rows] == ["spla", "sse-h", "hla-h"]
    for r in rows:
        assert "error" not in r, r
        assert r["tokens_per_step"] == 256 and r["steps"] == 2
        assert r["first_step_seconds"] > 0 and r["stage2_seconds_per_step"] > 0
    assert "| sse-h | 2 x 128 | no |" in res.stdout


def test_peak_breakdown_replays_to_the_largest_live_total():
    from scripts.benchmarks.models.bench_adapt import peak_breakdown

    def frame(name, line):
        return [{"filename": f"/x/site-packages/subquadratic/{name}", "line": line, "name": "f"}]

    gib = 2**30
    trace = [
        {"action": "alloc", "addr": 1, "size": 2 * gib, "frames": frame("a.py", 10)},
        {"action": "alloc", "addr": 2, "size": 1 * gib, "frames": frame("b.py", 20)},
        {"action": "free_completed", "addr": 1, "size": 2 * gib, "frames": []},
        {"action": "alloc", "addr": 3, "size": 1 * gib, "frames": frame("b.py", 20)},
        {"action": "alloc", "addr": 4, "size": 1 * gib, "frames": frame("c.py", 5)},  # total 3 GiB: not the peak
    ]
    got = peak_breakdown({"device_traces": [trace]})
    assert got["peak_gib"] == 3.0  # a then b: 3 GiB; the later 3 GiB does not replace the first peak
    assert got["by_owner"] == [["subquadratic/a.py:10 (f)", 2.0], ["subquadratic/b.py:20 (f)", 1.0]]
    assert peak_breakdown({"device_traces": []})["peak_gib"] == 0.0
