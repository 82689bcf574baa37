"""subquadratic: long-context attention families (SPLA, SSE, HLA) for Hugging Face Transformers.

Importing the package registers every built-in family (`subquadratic/families/`) through the
registry (`subquadratic.registry`), which also registers them with AutoConfig / AutoModel /
AutoModelForCausalLM.
"""

from . import families  # noqa: F401  (registers the built-in families)
from .configuration import HLAConfig, SPLAConfig, SSEConfig, SubquadraticConfig
from .modeling import (
    CACHE_FIELD,
    HLAForCausalLM,
    HLAModel,
    RecurrentLayer,
    SPLAForCausalLM,
    SPLAModel,
    SSEForCausalLM,
    SSEModel,
    StateLayer,
    SubquadraticCache,
)
from .registry import Family, get_family, register_family

__version__ = "0.1.0"

__all__ = ["SubquadraticConfig", "SubquadraticCache", "StateLayer", "RecurrentLayer", "CACHE_FIELD",
           "Family", "register_family", "get_family",
           "SPLAConfig", "SPLAModel", "SPLAForCausalLM", "HLAConfig", "HLAModel", "HLAForCausalLM",
           "SSEConfig", "SSEModel", "SSEForCausalLM", "__version__"]
