"""`python -m subquadratic ...` (and `accelerate launch -m subquadratic adapt ...`): the command line."""

import sys

from .cli import main

sys.exit(main())
