"""The built-in families, one folder each (`families/<name>/`, the name being the model type).

Each folder's `__init__.py` is the family's declaration, as data: a light part the command line
reads without importing torch (`NAME`, `OPTIONS`, `CARD` and, where the family has some,
`CONVERT_PRESETS`), and `PARTS` / `MIXERS`, naming the "module:attribute" of the rest. Two functions
here import them: `config_class(module)` (`configuration.py` alone) and `family(module)`, the full
`registry.Family` (also `modeling.py` and `conversion.py`).

`import subquadratic` calls `install()`, which registers the built-ins once, when first needed,
without importing torch itself:
  - the registry runs `register_builtin` at its first read (`registry.load_with`), so config
    validation, the decoder, `convert` and the CLI's commands find the built-in mixers and families,
    and AutoModel / AutoModelForCausalLM their classes (`register_family`). Every config checks its
    `mixer_types` against the registry when it is made, so the model classes are registered before
    Transformers looks for the class of a config: `from_pretrained(folder)` reads the config first;
  - AutoConfig must know the model types before any config is made: it learns them when
    Transformers imports `transformers.models.auto.configuration_auto` (at once if it already has),
    through a post-import hook (wrapt) that imports the configuration modules only (the hook may run
    while Transformers' modeling code, or ours, is still being imported).
So `import subquadratic` then `AutoModelForCausalLM.from_pretrained(folder)` works in either import
order, while `subquadratic --help` imports neither torch nor Transformers.
"""

from importlib import import_module
from types import ModuleType

from ..registry import Family, cli_flags, families, load_with, register_family
from . import hla, spla, sse

BUILTIN = (spla, sse, hla)


def _part(declaration: ModuleType, ref: str):
    """The object a declaration names as "module:attribute" of its own folder."""
    module, attr = ref.split(":")
    return getattr(import_module(f"{declaration.__name__}.{module}"), attr)


def config_class(declaration: ModuleType) -> type:
    """A declaration's config class alone (what AutoConfig needs; imports no model code)."""
    return _part(declaration, declaration.PARTS["config_class"])


def family(declaration: ModuleType) -> Family:
    """The full `registry.Family` of a declaration (imports the configuration, model and converter modules)."""
    return Family(
        **{field: _part(declaration, ref) for field, ref in declaration.PARTS.items()},
        mixers={name: _part(declaration, ref) for name, ref in declaration.MIXERS.items()},
        card=declaration.CARD, options=declaration.OPTIONS,
        convert_presets=getattr(declaration, "CONVERT_PRESETS", {}),
    )


def register_builtin() -> None:
    """Register every built-in family not registered yet (imports torch and the model code)."""
    registered = {f.name for f in families(load=False)}
    for module in BUILTIN:
        if module.NAME not in registered:
            fam = family(module)
            if fam.name != module.NAME:
                raise RuntimeError(f"{module.__name__} declares NAME {module.NAME!r} but its config's model_type is "
                                   f"{fam.name!r}; make them equal")
            register_family(fam)


def _auto_configs(configuration_auto) -> None:
    """Post-import hook of `transformers.models.auto.configuration_auto`: AutoConfig learns the
    built-in model types."""
    for module in BUILTIN:
        configuration_auto.AutoConfig.register(module.NAME, config_class(module), exist_ok=True)


def install() -> None:
    """Register the built-in families lazily (see the module docstring); `import subquadratic` calls it."""
    import wrapt

    load_with(register_builtin)
    wrapt.register_post_import_hook(_auto_configs, "transformers.models.auto.configuration_auto")


def convert_targets() -> dict[str, tuple[dict[str, dict], dict[str, dict]]]:
    """Family name -> (its `convert` flags: `--prefix-key` -> argparse keyword arguments, its convert
    presets) for every family `convert` can target: the built-ins, registered or not (from their
    light declarations), and those registered so far (read without loading any)."""
    out = {m.NAME: (cli_flags(m.NAME, m.OPTIONS), getattr(m, "CONVERT_PRESETS", {})) for m in BUILTIN}
    for f in families(lambda f: f.converter is not None, load=False):
        out[f.name] = (f.cli_options(), f.convert_presets)
    return out


def converted_model_types() -> set[str]:
    """The model types of every family known without loading any: the built-ins and those registered."""
    return {m.NAME for m in BUILTIN} | {f.name for f in families(load=False)}
