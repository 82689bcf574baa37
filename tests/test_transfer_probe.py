"""scripts/studies/transfer_probe.py --tiny: layer-local attention transfer on a tiny random Llama and numpy's
sources; the fitted mixer reproduces the dense attention better than the fresh one, its scores come
per position range, and rows that do not change the mixer are refused in one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def probe():
    return importlib.import_module("scripts.studies.transfer_probe")


def test_relative_errors_by_range(probe):
    want = torch.randn(2, 8, 4)
    assert probe.relative_errors(want, want, [(0, 4), (4, 8)]) == [0.0, 0.0]
    assert probe.relative_errors(torch.zeros_like(want), want, [(0, 8)]) == [pytest.approx(1.0)]
    got = want.clone()
    got[:, 4:] *= 2  # the second half off by its own size
    assert probe.relative_errors(got, want, [(0, 4), (4, 8)]) == [0.0, pytest.approx(1.0)]


def test_default_layers_skip_the_softmax_layers(probe):
    assert probe.default_layers(30) == [3, 9, 15, 21, 27]
    layers = probe.default_layers(6, count=3)
    assert len(layers) == 3 and 5 not in layers


def test_tiny_probe_fits_and_scores_each_range(probe, tmp_path):
    res = probe.main(["--out", str(tmp_path), "--tiny", "--rows", "sse-h/no-window,sse-h", "--layers", "1,3",
                      "--train-len", "64", "--train-rows", "4", "--steps", "12", "--packages", "numpy"])
    assert set(res["rows"]) == {"sse-h/no-window", "sse-h"}
    assert res["protocol"]["buckets"] == [(0, 64), (64, 128), (128, 256)]
    for r in res["rows"].values():
        assert set(r["after"]) == {1, 3} and all(len(v) == 3 for v in r["after"].values())
        assert all(0 <= v < 1.5 for v in r["after_mean"] + r["before_mean"])
    base = res["rows"]["sse-h/no-window"]
    assert sum(base["after_mean"]) < sum(base["before_mean"])  # fitting lowers the error
    assert base["before_mean"][0] == pytest.approx(1.0, abs=0.05)  # fresh SSE: output near 0
    # the default window branch (64 tokens, sum merge, the state's gate at 0) starts as the source's
    # attention itself within its window: the first 64 positions are exact before any fitting
    assert res["rows"]["sse-h"]["before_mean"][0] < 1e-4 < res["rows"]["sse-h"]["before_mean"][2]
    saved = json.loads((tmp_path / "probe.json").read_text())
    assert saved["rows"].keys() == res["rows"].keys()
    assert "| sse-h/no-window |" in (tmp_path / "probe.md").read_text()


def test_rows_that_change_the_adaptation_are_refused(probe, tmp_path):
    with pytest.raises(SystemExit, match="changes the adaptation"):
        probe.main(["--out", str(tmp_path), "--tiny", "--rows", "sse-h/rows-4x", "--layers", "1", "--train-len", "32",
                    "--train-rows", "1", "--eval-rows", "1", "--steps", "1", "--packages", "numpy"])
