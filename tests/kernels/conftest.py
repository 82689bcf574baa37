"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from subquadratic.kernels import utils


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """Every kernel output starts as NaN (or -1 for indices): anything a kernel leaves unwritten
    fails the test."""
    with utils.poisoned_outputs(True):
        yield
