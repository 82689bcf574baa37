"""scripts/benchmarks/models/bench_model.py --quick runs end to end on CPU (tiny model) and reports every
M1 / M2 row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_model_quick_smoke(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "scripts.benchmarks.models.bench_model", "--quick", "--repeats", "1",
           "--out", str(out), "--profile", "128", "--profile-host", "5", "--profile-gaps", "5",
           "--profile-out", str(tmp_path / "prof.txt"), "--split-train"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    keys = {(r["measure"], r["T"], r["family"]) for r in rows}
    families = ("spla", "spla-adapted", "sse-h", "hla-h", "hla")
    assert keys == {("ttft", T, f) for T in (128, 320) for f in families} | {("train", 128, f) for f in families}
    assert all(r["error"] is None and r["dense_ms"] > 0 and r["ours_ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert "| M1 | time to first token | 320 | spla |" in res.stdout  # the Markdown table for docs/benchmarks.md
    for r in rows:  # a first token's host time (the call's time to return, at most its wall time); none for training
        if r["measure"] == "ttft":
            assert 0 < r["ours_host_ms"] <= r["ours_ms"] * 1.001 and 0 < r["dense_host_ms"] <= r["dense_ms"] * 1.001
        else:
            assert r["ours_host_ms"] is None and r["dense_host_ms"] is None
    for r in rows:  # --split-train: a training step's halves, each host time at most its wall time
        if r["measure"] != "train":
            assert r["ours_split"] is None and r["dense_split"] is None
            continue
        for h in (r["ours_split"], r["dense_split"]):
            assert 0 < h["forward_host_ms"] <= h["forward_wall_ms"]
            assert 0 < h["backward_host_ms"] <= h["backward_wall_ms"]
    for r in rows:  # the allocator's counters over the timed calls (zeros on the CPU) and no sync count off CUDA
        for who in ("ours", "dense"):
            assert r[f"{who}_allocator"] == {k: 0 for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                                            "num_sync_all_streams")}
            assert r[f"{who}_syncs"] is None
            assert r[f"{who}_gc"]["ms"] >= 0 and r[f"{who}_gc"]["collections"] >= 0
            assert 0 < r[f"{who}_probe_us"] < 1e4  # the host's speed before the row (microseconds a step)
    host = json.loads(out.read_text())["meta"]["host"]  # the host the calls were enqueued from
    assert host["cpus"] >= 1 and "cpu" in host and "loadavg" in host
    assert "| T | model | forward host / wall ms | backward host / wall ms |" in res.stdout
    assert "| 128 | dense |" in res.stdout and "| 128 | sse-h |" in res.stdout
    tables = (tmp_path / "prof.txt").read_text()  # one profiler table per model and measure at 128 tokens
    for name in ("dense", *families):
        for what in ("ttft", "train"):
            assert f"{name} {what} T=128: " in tables
            assert f"{name} {what} T=128: no GPU, no idle gaps to show" in tables  # --profile-gaps on the CPU


def test_bench_model_on_a_checkpoint_and_real_text(tmp_path):
    """--checkpoint measures a given dense model and its conversions; --text takes the prompts from
    real text through the checkpoint's tokenizer (here this test folder's Python sources);
    --checkpointing marks the training rows (their steps checkpoint every layer: test_gradients)."""
    from tests.conftest import make_dense
    from tests.evaluation.conftest import tiny_tokenizer

    ckpt = tmp_path / "dense"
    make_dense("llama").save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "scripts.benchmarks.models.bench_model", "--quick", "--repeats", "1",
           "--out", str(out), "--checkpoint", str(ckpt), "--text", str(ROOT / "tests" / "models"),
           "--families", "spla,hla",
           "--lengths", "96", "--train-lengths", "64", "--checkpointing"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["model"]["model"] == str(ckpt) and data["meta"]["text"].endswith("models")
    keys = {(r["measure"], r["T"], r["family"]) for r in data["rows"]}
    assert keys == {("ttft", 96, f) for f in ("spla", "hla")} | {("train", 64, f) for f in ("spla", "hla")}
    assert all(r["error"] is None and r["ratio"] > 0 for r in data["rows"])
    assert data["meta"]["checkpointing"] and all(r["checkpointing"] == (r["measure"] == "train") for r in data["rows"])
    assert "| M2 | training step (checkpointed) | 64 | hla |" in res.stdout
    bad = subprocess.run([*cmd[:3], "--quick", "--text", "python"], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=120)
    assert bad.returncode != 0 and "--text needs --checkpoint" in bad.stderr
