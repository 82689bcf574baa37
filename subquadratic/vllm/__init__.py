"""The vLLM plugin: serves converted SPLA, SSE / SSE-H and HLA / HLA-H folders with vLLM's continuous
batching (docs/design.md "Serving with vLLM").

vLLM calls `register` in every one of its processes through the `vllm.general_plugins` entry point
(`pip install 'subquadratic[vllm]'`); it tells vLLM's model registry the families' architectures
(the `architectures` a converted folder's config.json names), as lazy `module:class` strings, so that
nothing here imports vLLM or PyTorch until vLLM loads such a folder (`subquadratic.vllm.model`).
Importing `subquadratic` never imports this package.
"""

from __future__ import annotations

#: The architectures served, by the class that serves each (in `subquadratic.vllm.model`).
ARCHITECTURES = {
    "SSEForCausalLM": "SSEForVLLM",
    "HLAForCausalLM": "HLAForVLLM",
    "SPLAForCausalLM": "SPLAForVLLM",
}


def register() -> None:
    """Register the families' vLLM model classes and their config hook (vLLM's plugin entry point)."""
    from vllm import ModelRegistry

    import subquadratic  # noqa: F401  (the families' configs for Transformers' AutoConfig)

    for arch, cls in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, f"subquadratic.vllm.model:{cls}")
    try:  # the per-architecture config hook (prefix caching, chunked prefill): vLLM reads this map by name
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP

        from .config import SubquadraticVLLMConfig
    except ImportError:  # a vLLM without the map: the model class checks the same at load time
        return
    for arch in ARCHITECTURES:
        MODELS_CONFIG_MAP[arch] = SubquadraticVLLMConfig
