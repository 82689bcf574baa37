"""`python -m subquadratic ...` (and `accelerate launch -m subquadratic adapt ...`): the command line."""

from .cli import run

run()
