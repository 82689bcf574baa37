"""The built-in families, one folder each (`families/<name>/`, the name being the model type).

Each folder's `__init__.py` is the family's declaration: a light part the command line reads
without importing torch (`NAME`, `OPTIONS`, `CARD` and, where the family has some, `CONVERT_PRESETS`)
and `family()`, the full `registry.Family`, which imports the folder's `configuration.py`,
`modeling.py` and `conversion.py`. `register_builtin()` registers them (`registry.register_family`).
"""

from ..registry import FAMILIES, cli_flags, register_family
from . import hla, spla, sse

BUILTIN = (spla, sse, hla)


def register_builtin() -> None:
    """Register every built-in family not registered yet (imports torch and the model code)."""
    for module in BUILTIN:
        if module.NAME not in FAMILIES:
            family = module.family()
            if family.name != module.NAME:
                raise RuntimeError(f"{module.__name__} declares NAME {module.NAME!r} but its config's model_type is "
                                   f"{family.name!r}; make them equal")
            register_family(family)


def convert_targets() -> dict[str, tuple[dict[str, dict], list[str]]]:
    """Family name -> (its `convert` flags: `--prefix-key` -> argparse keyword arguments, the names
    of its convert presets) for every family `convert` can target: the built-ins, registered or not
    (from their light declarations), and the registered ones."""
    out = {m.NAME: (cli_flags(m.NAME, m.OPTIONS), list(getattr(m, "CONVERT_PRESETS", {}))) for m in BUILTIN}
    out.update({f.name: (f.cli_options(), list(f.convert_presets)) for f in FAMILIES.values() if f.converter})
    return out
