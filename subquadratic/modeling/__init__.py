"""Models: the shared decoder (`base`), the cache (`cache`) and one module per family (mixer, its
cache layer, model classes)."""

from ..registry import MIXERS, register_mixer
from .base import CACHE_FIELD, AttentionBase, SubquadraticForCausalLM, SubquadraticModel
from .cache import KVLayer, RecurrentLayer, StateLayer, SubquadraticCache
from .hla import HLAAttention, HLAForCausalLM, HLALayer, HLAModel
from .spla import SPLAAttention, SPLAForCausalLM, SPLALayer, SPLAModel
from .sse import SSEAttention, SSEForCausalLM, SSELayer, SSEModel

__all__ = [
    "MIXERS", "register_mixer", "CACHE_FIELD", "AttentionBase", "SubquadraticCache", "StateLayer", "KVLayer",
    "RecurrentLayer", "SubquadraticModel", "SubquadraticForCausalLM",
    "SPLAAttention", "SPLALayer", "SPLAModel", "SPLAForCausalLM",
    "HLAAttention", "HLALayer", "HLAModel", "HLAForCausalLM",
    "SSEAttention", "SSELayer", "SSEModel", "SSEForCausalLM",
]
