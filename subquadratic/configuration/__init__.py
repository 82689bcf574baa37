"""Model configurations (one module per family, shared fields in `base`)."""

from .base import SubquadraticConfig
from .hla import HLAConfig
from .spla import SPLAConfig
from .sse import SSEConfig

__all__ = ["SubquadraticConfig", "SPLAConfig", "HLAConfig", "SSEConfig"]
