"""scripts/benchmarks/models/saved_tensors.py: --quick runs end to end on CPU, and `saved_by_module` counts
exactly the bytes autograd saves, each storage once, under the module and function that saved them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent


class _Square(nn.Module):
    def forward(self, x):
        return x * x  # saves x (twice: both operands of the product), one storage


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.sq = _Square()
        self.lin = nn.Linear(8, 8, bias=False)

    def forward(self, ids, labels=None):
        x = self.lin.weight[ids]  # an embedding lookup: saves the ids
        y = self.sq(x)
        return type("Out", (), {"loss": y.sum()})()


def test_saved_by_module_counts_each_storage_once():
    from scripts.benchmarks.models.saved_tensors import saved_by_module

    model = _Toy()
    ids = torch.tensor([[1, 2, 3]])
    saved, peak = saved_by_module(model, ids)
    sq = {k: v for k, v in saved.items() if k.startswith("sq (_Square)")}
    assert sum(sq.values()) == 3 * 8 * 4  # x [1, 3, 8] fp32, saved twice, counted once
    assert all("test_saved_tensors.py" in k or "<-" in k for k in sq)
    assert peak == 0  # no CUDA: no peak recorded
    assert model.lin.weight.grad is None  # the step's gradients are cleared again


def test_saved_tensors_quick_smoke(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "scripts.benchmarks.models.saved_tensors", "--quick", "--families", "sse-h",
           "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    models = json.loads(out.read_text())["models"]
    assert set(models) == {"dense", "sse-h"}
    for row in models.values():
        assert row["saved_bytes"] == sum(row["by_module"].values()) > 0
    assert any("SSEAttention" in k for k in models["sse-h"]["by_module"])
