"""scripts/benchmarks/kernels/bench_spla_blocks.py --quick runs end to end on CPU (Triton interpreter, tiny shapes) on a
random selection and on a tiny file in scripts/tools/dump_spla_inputs.py's layout, and its check finds the
block-major kernels equal to the per-token ones."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_bench_spla_blocks_quick_smoke(tmp_path):
    pytest.importorskip("triton")
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    L, T, HQ, H, D = 1, 40, 4, 2, 16
    qkv = {"q": torch.randn(L, T, HQ, D, generator=g), "k": torch.randn(L, T, H, D, generator=g),
           "v": torch.randn(L, T, H, D, generator=g)}
    real = tmp_path / "qkv.safetensors"
    save_file(qkv, str(real), metadata=dict(layers="[5]", block_size="16", top_k_blocks="3"))
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "scripts.benchmarks.kernels.bench_spla_blocks", "--quick", "--data", "iid", "--real",
           str(real), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["iid", "real L5"]
    for r in rows:
        assert r["check"] <= 1e-4, r  # block-major == per-token, values and gradients
        for form in ("flash", "blocks", "tile", "token"):
            assert math.isfinite(r[f"{form}_fwd"]) and math.isfinite(r[f"{form}_fb"]), (form, r)
        assert r["pairs"] > 0 and 1 <= r["union_train"] <= -(-T // 16)
    assert "| real L5 | 40 |" in res.stdout  # the summary table
