"""Write the model code next to a checkpoint so that `trust_remote_code=True` loads it where the
package is not installed.

Transformers' remote-code loader only follows flat, same-folder relative imports (`from .x import`),
so the modules a family's classes live in, and every module of the package they import, are copied
as flat files named by their dotted path (`subquadratic/families/spla/modeling.py` ->
`families_spla_modeling.py`, `subquadratic/registry.py` -> `registry.py`; two modules that would
share a name are refused) with their imports rewritten to match. Package modules import each other
relatively; a family declared outside the package may import the package absolutely (`from
subquadratic.x import y`). A generated entry module, `family_<model_type>.py`, imports the family's classes and
registers its mixers; config.json's `auto_map` points at it. Everything comes from the family's
registration (`registry.Family`).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from ..registry import Family, family_of_model_type

PACKAGE = "subquadratic"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
_IMPORT = re.compile(r"^(\s*)from\s+(\.*)([\w.]*)\s+import\b(.*)$")


def flat_name(module: str) -> str:
    """Flat file stem of a module: the package prefix dropped, dots as underscores."""
    parts = module.split(".")
    if parts[0] == PACKAGE:
        parts = parts[1:]
    return "_".join(p for p in parts if p != "__init__")


def _source(module: str) -> tuple[Path, bool]:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ValueError(f"cannot bundle module {module!r}: no Python source found")
    return Path(spec.origin), spec.submodule_search_locations is not None


def bundle_sources(family: Family) -> dict[str, str]:
    """Flat file name -> rewritten source, for the modules of the family's classes and every module
    they import from the package (or, relatively, from their own package)."""
    classes = [family.config_class, family.model_class, family.causal_lm_class, *family.mixers.values()]
    todo = sorted({cls.__module__ for cls in classes})
    out: dict[str, str] = {}
    origin: dict[str, str] = {}  # flat file name -> the module it holds
    while todo:
        module = todo.pop()
        name = flat_name(module) + ".py"
        if origin.setdefault(name, module) != module:
            raise ValueError(f"modules {origin[name]} and {module} both flatten to {name}; rename one of them")
        if name in out:
            continue
        path, is_pkg = _source(module)
        package = module.split(".") if is_pkg else module.split(".")[:-1]
        external = module.split(".")[0] != PACKAGE
        lines = []
        for line in path.read_text().splitlines():
            m = _IMPORT.match(line)
            if m and (m.group(2) or (external and m.group(3).split(".")[0] == PACKAGE)):
                indent, dots, rest, tail = m.groups()
                if not rest:
                    raise ValueError(f"{path}: use 'from .module import name', not 'from . import module'")
                if dots:
                    base = package[: len(package) - (len(dots) - 1)] if len(dots) > 1 else package
                    target = ".".join(base + rest.split("."))
                else:
                    target = rest
                if target == PACKAGE:
                    raise ValueError(f"{path}: import from the package's modules (subquadratic.modeling.base, ...), "
                                     "not from the package itself, so that the code can travel as remote code")
                todo.append(target)
                line = f"{indent}from .{flat_name(target)} import{tail}"
            lines.append(line)
        out[name] = "\n".join(lines) + "\n"
    entry = f"family_{family.model_type}.py"
    if entry in out:
        raise ValueError(f"module {origin[entry]} flattens to {entry}, the name of the remote-code entry module")
    out[entry] = _entry_module(family)
    return out


def _entry_module(family: Family) -> str:
    """The module `auto_map` points at: the family's classes, and its mixers registered."""
    lines = [f'"""Remote-code entry of the {family.name} family: its classes, and its mixers registered."""', ""]
    lines.append(f"from .{flat_name('subquadratic.registry')} import register_mixer")
    classes = [family.config_class, family.model_class, family.causal_lm_class, *family.mixers.values()]
    for cls in dict.fromkeys(classes):
        lines.append(f"from .{flat_name(cls.__module__)} import {cls.__name__}")
    lines.append("")
    lines += [f"register_mixer({name!r}, {cls.__name__})" for name, cls in family.mixers.items()]
    return "\n".join(lines) + "\n"


def write_remote_code(folder: str | Path, model_type: str) -> None:
    """Copy the flat model code into `folder` and add `auto_map` to its config.json."""
    folder = Path(folder)
    try:
        family = family_of_model_type(model_type)
    except KeyError as e:
        raise ValueError(f"no remote code for model_type {model_type!r}: {e.args[0]}") from None
    for name, text in bundle_sources(family).items():
        (folder / name).write_text(text)
    entry = f"family_{family.model_type}"
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["auto_map"] = {
        "AutoConfig": f"{entry}.{family.config_class.__name__}",
        "AutoModel": f"{entry}.{family.model_class.__name__}",
        "AutoModelForCausalLM": f"{entry}.{family.causal_lm_class.__name__}",
    }
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
