"""The built-in families, each declared once in its module: the light part the command line reads
(`NAME`, `OPTION_PREFIX`, `OPTIONS`; no torch needed) and `family()`, the full declaration.

`register_builtin()` registers them (`registry.register_family`); `import subquadratic` calls it.
"""

from ..registry import FAMILIES, cli_flags, register_family
from . import hla, spla, sse

BUILTIN = (spla, sse, hla)


def register_builtin() -> None:
    """Register every built-in family not registered yet (imports torch and the model code)."""
    for module in BUILTIN:
        if module.NAME not in FAMILIES:
            register_family(module.family())


def convert_targets() -> dict[str, dict[str, dict]]:
    """Family name -> its `convert` flags (`--prefix-key` -> argparse keyword arguments) for every
    family `convert` can target: the built-ins, registered or not, and the registered ones."""
    out = {m.NAME: cli_flags(m.OPTION_PREFIX, m.OPTIONS) for m in BUILTIN}
    out.update({f.name: f.cli_options() for f in FAMILIES.values() if f.converter is not None})
    return out
