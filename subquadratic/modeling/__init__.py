"""Models: the shared decoder (`base`), the cache (`cache`) and one module per family."""

from .base import MIXERS, SubquadraticForCausalLM, SubquadraticModel, register_mixer
from .cache import SubquadraticCache
from .hla import HLAForCausalLM, HLAModel
from .spla import SPLAForCausalLM, SPLAModel
from .sse import SSEForCausalLM, SSEModel

__all__ = [
    "MIXERS", "register_mixer", "SubquadraticCache", "SubquadraticModel", "SubquadraticForCausalLM",
    "SPLAModel", "SPLAForCausalLM",
    "HLAModel", "HLAForCausalLM",
    "SSEModel", "SSEForCausalLM",
]
