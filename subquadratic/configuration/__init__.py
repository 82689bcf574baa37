"""Model configuration shared by every family (`base`); each family's own config class lives in its
folder (`subquadratic/families/<family>/configuration.py`)."""

from .base import SubquadraticConfig

__all__ = ["SubquadraticConfig"]
