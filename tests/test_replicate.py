"""scripts/replicate.py --scale tiny runs the whole pipeline on CPU (pretrain, convert to five
contenders, adapt each, evaluate, MQAR) and writes every table it promises, from computed numbers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_replicate_tiny_writes_every_table(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "replicate.py"), "--scale", "tiny", "--device", "cpu",
           "--out", str(out), "--work", str(tmp_path / "work")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    names = ["dense", "SPLA", "SPA (use_rla=False)", "SSE-H", "SSE (no softmax layers)", "HLA hybrid"]
    assert [r["model"] for r in results["evaluation"]] == names
    for r in results["evaluation"]:
        ppl = [v["ppl"] for v in r["tasks"]["ppl"].values()]
        assert ppl and all(math.isfinite(p) and p > 1 for p in ppl)
        assert all(0 <= v["accuracy"] <= 1 for v in r["tasks"]["passkey"].values())
    assert 0 < results["adaptation"]["share_of_pretraining"] <= 0.05
    assert {"sse", "gla", "hla"} <= set(results["mqar"])
    assert len({results["mqar"][m]["state_bytes"] for m in ("sse", "gla", "hla")}) == 1
    report = (out / "results.md").read_text()
    for heading in ("## Q3", "## Q4", "## Q5", "## Q6"):
        assert heading in report
    assert len(list((out / "plots").glob("*.png"))) == len(names)
    assert len(list(out.glob("adapt_log_*.jsonl"))) == 5
