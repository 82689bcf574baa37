"""The error of a bad evaluation setting (task, length, device, dtype, reference model); data that
cannot be used raises `subquadratic.data.DataError`."""

from ..checks import InputError


class EvaluationError(InputError):
    """A problem with the user's input to an evaluation: printed as one line, exit code 2."""
