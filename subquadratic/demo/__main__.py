"""`python -m subquadratic.demo`: the demo with its defaults (SPLA)."""

from . import run_demo

run_demo()
