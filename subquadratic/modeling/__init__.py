"""Models: the shared decoder (`base`), the cache (`cache`) and one module per family."""

from .base import MIXERS, SubquadraticForCausalLM, SubquadraticModel, register_mixer
from .cache import SubquadraticCache
from .spla import SPLAForCausalLM, SPLAModel

__all__ = [
    "MIXERS", "register_mixer", "SubquadraticCache", "SubquadraticModel", "SubquadraticForCausalLM",
    "SPLAModel", "SPLAForCausalLM",
]
