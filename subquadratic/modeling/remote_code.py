"""Write the model code next to a checkpoint so that `trust_remote_code=True` loads it where the
package is not installed.

Transformers' remote-code loader only follows flat, same-folder relative imports (`from .x import`),
so the package's configuration/, modeling/ and kernels/ modules are copied as flat files
(`modeling/spla.py` -> `modeling_spla.py`) with their relative imports rewritten to match, and
config.json gets an `auto_map` pointing at them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_SUBPACKAGES = ("configuration", "modeling", "kernels")
_IMPORT = re.compile(r"^(\s*)from\s+(\.+)([\w.]*)\s+import\b(.*)$")

#: model_type -> (config class, base model class, causal LM class) as "module.Class" in the bundle
AUTO_CLASSES = {
    "spla": ("configuration_spla.SPLAConfig", "modeling_spla.SPLAModel", "modeling_spla.SPLAForCausalLM"),
    "sse": ("configuration_sse.SSEConfig", "modeling_sse.SSEModel", "modeling_sse.SSEForCausalLM"),
    "hla": ("configuration_hla.HLAConfig", "modeling_hla.HLAModel", "modeling_hla.HLAForCausalLM"),
}


def _module_parts(path: Path) -> list[str]:
    rel = path.relative_to(PACKAGE_ROOT).with_suffix("")
    parts = list(rel.parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def flat_name(parts: list[str]) -> str:
    return "_".join(parts)


def bundle_sources(model_type: str) -> dict[str, str]:
    """Flat file name -> rewritten source, for the family's configuration and modeling modules and
    every module they import relatively."""
    files = sorted(p for sub in BUNDLED_SUBPACKAGES for p in (PACKAGE_ROOT / sub).rglob("*.py"))
    modules = {tuple(_module_parts(p)): p for p in files}
    out: dict[str, str] = {}
    todo = [("configuration", model_type), ("modeling", model_type)]
    while todo:
        parts = todo.pop()
        if flat_name(list(parts)) + ".py" in out:
            continue
        path = modules[parts]
        is_pkg = path.name == "__init__.py"
        package = list(parts) if is_pkg else list(parts[:-1])
        lines = []
        for line in path.read_text().splitlines():
            m = _IMPORT.match(line)
            if m:
                indent, dots, rest, tail = m.groups()
                base = package[: len(package) - (len(dots) - 1)] if len(dots) > 1 else package
                if not rest:
                    raise ValueError(f"{path}: use 'from .module import name', not 'from . import module'")
                target = tuple(base + rest.split("."))
                if target not in modules:
                    raise ValueError(f"{path}: relative import of {'.'.join(target)} is outside the bundle")
                todo.append(target)
                line = f"{indent}from .{flat_name(list(target))} import{tail}"
            lines.append(line)
        out[flat_name(list(parts)) + ".py"] = "\n".join(lines) + "\n"
    return out


def write_remote_code(folder: str | Path, model_type: str) -> None:
    """Copy the flat model code into `folder` and add `auto_map` to its config.json."""
    folder = Path(folder)
    if model_type not in AUTO_CLASSES:
        raise ValueError(f"no remote code for model_type {model_type!r}")
    for name, text in bundle_sources(model_type).items():
        (folder / name).write_text(text)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    conf, base, lm = AUTO_CLASSES[model_type]
    cfg["auto_map"] = {"AutoConfig": conf, "AutoModel": base, "AutoModelForCausalLM": lm}
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
