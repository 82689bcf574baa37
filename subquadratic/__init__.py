"""subquadratic: long-context attention families (SPLA, SSE, HLA) for Hugging Face Transformers.

Importing the package imports neither torch nor Transformers: it hands the registration of the
built-in families (`subquadratic/families/`) to the registry (`subquadratic.registry`), which runs it
at its first read, and hooks it to Transformers, whose AutoConfig / AutoModel / AutoModelForCausalLM
learn the families when Transformers loads them, or at once if it already has
(`families.install`). The public names below are resolved on first use.
"""

from __future__ import annotations

from importlib import import_module

from . import families

__version__ = "0.1.0"

_EXPORTS = {
    "SubquadraticConfig": ".configuration",
    **dict.fromkeys(("CACHE_FIELD", "SubquadraticCache", "StateLayer", "RecurrentLayer"), ".modeling"),
    "SPLAConfig": ".families.spla.configuration",
    **dict.fromkeys(("SPLAModel", "SPLAForCausalLM"), ".families.spla.modeling"),
    "SSEConfig": ".families.sse.configuration",
    **dict.fromkeys(("SSEModel", "SSEForCausalLM"), ".families.sse.modeling"),
    "HLAConfig": ".families.hla.configuration",
    **dict.fromkeys(("HLAModel", "HLAForCausalLM"), ".families.hla.modeling"),
    **dict.fromkeys(("Family", "register_family", "get_family"), ".registry"),
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


families.install()
