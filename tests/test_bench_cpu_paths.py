"""scripts/benchmarks/models/bench_cpu_paths.py --quick: on a tiny random Llama, generate() of the dense
model and each conversion from two prompt lengths, and `adapt`'s steps of each family against a dense
training step, with ratios and the environment written to JSON."""

from __future__ import annotations

import json

import pytest

from .processes import run_script


def test_bench_cpu_paths_quick_smoke(tmp_path):
    out = tmp_path / "r.json"
    res = run_script("scripts.benchmarks.models.bench_cpu_paths", "--quick", "--work", tmp_path / "work", "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"date", "cpu", "torch", "transformers", "commit"} <= set(result["environment"])
    gen = result["generate"]
    assert [(r["prompt"], r["model"]) for r in gen] == [(T, m) for T in (24, 96) for m in ("dense", "spla", "hla-h",
                                                                                          "sse-h")]
    for r in gen:
        assert r["prefill_s"] > 0 and r["decode_tok_s"] > 0 and len(r["rounds"]) == 1
        assert (r["prefill_x"], r["decode_x"]) == (1.0, 1.0) if r["model"] == "dense" else r["decode_x"] > 0
    adapt = {r["family"]: r for r in result["adapt"]}
    assert list(adapt) == ["spla", "hla-h", "sse-h"]
    assert "stage1_s" not in adapt["spla"] and adapt["spla"]["stage2_s"] > 0  # SPLA's recipe: no transfer
    for name in ("hla-h", "sse-h"):  # 3 steps, 2 of them attention transfer: one of each after the first
        assert adapt[name]["stage1_s"] > 0 and adapt[name]["stage2_s"] > 0
        step, dense = adapt[name]["stage2_s"], adapt[name]["dense_step_s"]
        # the ratio of the unrounded times, against that of the figures rounded to 1 ms (a quick run's
        # dense step takes a few ms, so the rounding alone moves the ratio by up to 0.5 ms / dense)
        assert adapt[name]["stage2_x"] == pytest.approx(step / dense, rel=0.02 + 0.0005 / dense + 0.0005 / step)
    assert "| 96 | sse-h |" in res.stdout and "| hla-h |" in res.stdout
