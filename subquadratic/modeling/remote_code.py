"""Write the model code next to a checkpoint so that `trust_remote_code=True` loads it where the
package is not installed.

A Hub user finds the files Transformers' own remote-code models have: `configuration_<model_type>.py`
(the family's config module) and `modeling_<model_type>.py` (the module of its model classes, which
also registers the family's mixers when it runs as remote code; the configuration file has the
registry load it before a config checks its mixer names), and config.json's `auto_map` points at
them. Transformers' remote-code loader only follows flat, same-folder relative imports (`from .x
import`), so every other module of the package they import travels as a flat file named
`subquadratic_<its dotted path>.py` (`subquadratic/modeling/base.py` -> `subquadratic_modeling_base.py`;
two modules that would share a name are refused), with the imports rewritten to match. Package
modules import each other relatively; a family declared outside the package may import the package
absolutely (`from subquadratic.x import y`), and its other modules keep their flat dotted names.
Everything comes from the family's registration (`registry.Family`).
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
    """Flat file stem of a module: the package's modules `subquadratic_<dotted path, dots as
    underscores>`, another package's its dotted path with underscores."""
    parts = [p for p in module.split(".") if p != "__init__"]
    return "_".join(parts)


def entry_names(family: Family) -> dict[str, str]:
    """module -> file stem of the two files a Hub user opens: the model classes' module as
    `modeling_<model_type>`, the config class's as `configuration_<model_type>` (when it is another
    module; else `configuration_<model_type>` is generated, re-exporting the config class)."""
    names = {family.causal_lm_class.__module__: f"modeling_{family.model_type}"}
    names.setdefault(family.config_class.__module__, f"configuration_{family.model_type}")
    return names


def _source(module: str) -> tuple[Path, bool]:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ValueError(f"cannot bundle module {module!r}: no Python source found")
    return Path(spec.origin), spec.submodule_search_locations is not None


def bundle_sources(family: Family) -> dict[str, str]:
    """File name -> rewritten source, for the modules of the family's classes (`entry_names`) and every
    module they import from the package (or, relatively, from their own package)."""
    classes = [family.config_class, family.model_class, family.causal_lm_class, *family.mixers.values()]
    entries = entry_names(family)
    stem = lambda module: entries.get(module) or flat_name(module)  # noqa: E731
    todo = sorted({cls.__module__ for cls in classes})
    out: dict[str, str] = {}
    origin: dict[str, str] = {}  # file name -> the module it holds
    while todo:
        module = todo.pop()
        name = stem(module) + ".py"
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
                line = f"{indent}from .{stem(target)} import{tail}"
            lines.append(line)
        out[name] = "\n".join(lines) + "\n"
    modeling = f"modeling_{family.model_type}.py"
    out[modeling] += _registration(family, stem)
    configuration = f"configuration_{family.model_type}.py"
    if configuration in out:
        out[configuration] += _deferred_registration(family, stem)
    else:  # the config class lives in the modeling module
        cls = family.config_class
        out[configuration] = (f'"""The {family.name} family\'s configuration (defined in {modeling})."""\n\n'
                              f"from .modeling_{family.model_type} import {cls.__name__}\n\n"
                              f"__all__ = [{cls.__name__!r}]\n")
    return out


def _deferred_registration(family: Family, stem) -> str:
    """What the configuration file ends with: the modeling file loaded (registering the mixers) before
    the registry is first read, as a config checks its `mixer_types` there. The import sits in a
    function (the modeling file imports this one), where Transformers' loader still finds it and
    copies the modeling file along."""
    return "\n".join([
        "", "",
        "def _register_mixers() -> None:",
        '    """Remote code: the modeling file registers the mixers a config names, before they are read."""',
        f"    from .modeling_{family.model_type} import {family.causal_lm_class.__name__}  # noqa: F401",
        "",
        "",
        f"from .{stem('subquadratic.registry')} import load_with  # noqa: E402",
        "",
        "load_with(_register_mixers)",
    ]) + "\n"


def _registration(family: Family, stem) -> str:
    """What the modeling file ends with: the family's mixers registered under the names its configs'
    `mixer_types` use (the package registers them itself; remote code has only this file)."""
    lines = ["", "", "# Remote code: the family's mixers, registered under the names config.mixer_types uses.",
             f"from .{stem('subquadratic.registry')} import register_mixer  # noqa: E402"]
    for cls in dict.fromkeys(family.mixers.values()):
        if cls.__module__ != family.causal_lm_class.__module__:
            lines.append(f"from .{stem(cls.__module__)} import {cls.__name__}  # noqa: E402")
    lines += [f"register_mixer({name!r}, {cls.__name__})" for name, cls in family.mixers.items()]
    return "\n".join(lines) + "\n"


def write_remote_code(folder: str | Path, model_type: str) -> None:
    """Write the model code (`bundle_sources`) into `folder` and point its config.json's `auto_map` at
    `configuration_<model_type>.py` and `modeling_<model_type>.py`."""
    folder = Path(folder)
    try:
        family = family_of_model_type(model_type)
    except KeyError as e:
        raise ValueError(f"no remote code for model_type {model_type!r}: {e.args[0]}") from None
    for name, text in bundle_sources(family).items():
        (folder / name).write_text(text)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    modeling = f"modeling_{family.model_type}"
    cfg["auto_map"] = {
        "AutoConfig": f"configuration_{family.model_type}.{family.config_class.__name__}",
        "AutoModel": f"{modeling}.{family.model_class.__name__}",
        "AutoModelForCausalLM": f"{modeling}.{family.causal_lm_class.__name__}",
    }
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
