"""The Triton helpers' switches: where kernels autotune."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("triton")
from subquadratic.kernels import triton_utils  # noqa: E402


@pytest.mark.parametrize("interpret,switch,expected", [("0", "1", True), ("0", "0", False), ("1", "1", False),
                                                       ("0", None, True)])
def test_autotuning_is_on_the_gpu_unless_switched_off(interpret, switch, expected, monkeypatch):
    """Kernels autotune on the GPU (not under the interpreter), and launch with their fixed settings
    there too with SUBQUADRATIC_AUTOTUNE=0."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    if switch is None:
        monkeypatch.delenv("SUBQUADRATIC_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("SUBQUADRATIC_AUTOTUNE", switch)
    try:
        assert importlib.reload(triton_utils).AUTOTUNE is expected
    finally:
        monkeypatch.undo()
        importlib.reload(triton_utils)
