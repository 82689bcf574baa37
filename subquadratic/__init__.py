"""subquadratic: long-context attention families (SPLA, SSE, HLA) for Hugging Face Transformers.

Importing the package registers every built-in family (`subquadratic/families/`) through the
registry (`subquadratic.registry`), which also registers them with AutoConfig / AutoModel /
AutoModelForCausalLM. The one exception is the `subquadratic` command itself: it registers them once
it has parsed its arguments, so that `--help` and usage errors answer without importing torch.
The public names below are resolved on first use.
"""

from __future__ import annotations

import sys
from importlib import import_module
from pathlib import Path

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


def _is_command_line() -> bool:
    """Whether this process is the `subquadratic` command (the console script, or python -m subquadratic.cli)."""
    main = sys.modules.get("__main__")
    script = Path(getattr(main, "__file__", None) or "").name
    argv = sys.orig_argv
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None  # the first -m names python's module
    return script in ("subquadratic", "subquadratic.exe") or module == "subquadratic.cli"


if not _is_command_line():
    families.register_builtin()
