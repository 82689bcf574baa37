"""Models: the shared decoder (`base`), the cache (`cache`), the captured decode step (`cuda_graph`),
its fused elementwise chains (`fused`), packed batches (`packing`) and remote-code bundling
(`remote_code`). Each family's mixer, cache layer and model classes live in its folder
(`subquadratic/families/<family>/modeling.py`)."""

from ..registry import mixer, mixers, register_mixer
from .base import CACHE_FIELD, AttentionBase, SubquadraticForCausalLM, SubquadraticModel
from .cache import KVLayer, RecurrentLayer, StateLayer, SubquadraticCache

__all__ = [
    "mixer", "mixers", "register_mixer", "CACHE_FIELD", "AttentionBase", "SubquadraticCache", "StateLayer", "KVLayer",
    "RecurrentLayer", "SubquadraticModel", "SubquadraticForCausalLM",
]
