"""Elementwise Triton functions that more than one kernel module calls."""

from __future__ import annotations

from .triton_launch import jit
from .utils import import_triton

triton, tl = import_triton()


@jit
def logsigmoid(z):
    """min(z, 0) - log1p(exp(-|z|)) in fp32, log1p(u) as log(1 + u) * u / ((1 + u) - 1) (exact to rounding
    for the small u of strongly positive z, where log(1 + u) alone loses the digits)."""
    u = tl.exp(-tl.abs(z))
    w = 1.0 + u
    lp = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
    return tl.minimum(z, 0.0) - lp
