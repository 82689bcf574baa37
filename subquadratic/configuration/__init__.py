"""Model configurations (one module per family, shared fields in `base`)."""

from .base import SubquadraticConfig
from .spla import SPLAConfig

__all__ = ["SubquadraticConfig", "SPLAConfig"]
