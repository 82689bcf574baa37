"""Families and token mixers, each declared once.

A family (a model type) declares itself with one `register_family(Family(...))` call: its config
class, base and causal-LM model classes, the token mixers it adds (name in `config.mixer_types` ->
mixer class; each mixer class names its cache-layer type in `cache_layer_cls`), its converter from
dense checkpoints, model card, presets and `convert` options. The built-in families do so in
`subquadratic/families/`; an outside family does the same from its own module. Registration makes
the mixers available to the shared decoder and config validation, the family available to
`convert` and the CLI, its classes available to AutoConfig / AutoModel / AutoModelForCausalLM, and
its modules bundled as remote code next to the checkpoints it saves.

The registry is read through functions (`mixer`, `mixers`, `get_family`, `families`, ...), never
its tables directly: the first read runs the loaders handed to `load_with` (the package hands it the
registration of its built-in families, `subquadratic.families.register_builtin`), once.

This module imports nothing from the package, so it sits at the bottom of the layering (and travels
with the remote code, where the bundled configuration file hands `load_with` the import of the
modeling file, which registers the mixers: `modeling.remote_code`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Token mixers by the name `config.mixer_types` uses; filled by `register_mixer`, read by `mixer(s)`.
_MIXERS: dict[str, type] = {}
#: Families by name (their model type); filled by `register_family`, read by `get_family`, `families`.
_FAMILIES: dict[str, Family] = {}
#: Loaders run before the first read (`load_with`); each is dropped once it has run without error.
_LOADERS: list[Callable[[], None]] = []
_LOCK = threading.RLock()
_loading = False


def load_with(loader: Callable[[], None]) -> None:
    """Run `loader` once, before the registry is first read (an error leaves it to run at the next read)."""
    with _LOCK:
        _LOADERS.append(loader)


def _load() -> None:
    """Run the pending loaders; a read made while they run (by the code they import) sees what is
    registered so far."""
    global _loading
    if not _LOADERS:
        return
    with _LOCK:
        if _loading:
            return
        _loading = True
        try:
            while _LOADERS:
                _LOADERS[0]()
                _LOADERS.pop(0)
        finally:
            _loading = False


def register_mixer(name: str, cls: type) -> type:
    """Make the token mixer `cls` available under `name` in `config.mixer_types`."""
    if _MIXERS.get(name, cls) is not cls and _MIXERS[name].__qualname__ != cls.__qualname__:
        raise ValueError(f"mixer name {name!r} is already taken by {_MIXERS[name].__qualname__}")
    _MIXERS[name] = cls
    return cls


def _lookup(table: dict, name: str, missing: str, known: str):
    """table[name] after the loaders ran; if absent, a KeyError: `missing`, then `known` and the names."""
    _load()
    if name not in table:
        raise KeyError(f"{missing}; {known}: {', '.join(sorted(table)) or 'none'}")
    return table[name]


def mixer(name: str) -> type:
    """The token mixer class registered under `name` (a `config.mixer_types` entry)."""
    return _lookup(_MIXERS, name, f"mixer {name!r} is not available (import the family that provides it)", "available")


def mixers() -> dict[str, type]:
    """Every registered token mixer: name -> class (a copy)."""
    _load()
    return dict(_MIXERS)


@dataclass(frozen=True)
class Family:
    """Everything the package needs to know about one family.

    config_class, model_class, causal_lm_class: the family's classes; `config_class.model_type` is
      the family's one name: the model type registered with Transformers' Auto classes, the
      conversion target (`convert --to NAME`, `demo --to NAME`) and the default CLI option prefix.
    mixers: token mixer name -> mixer class, for the names the family adds to `mixer_types`.
    converter: a `conversion.core.Converter` (None: the family cannot be converted to).
    card: the model card template of converted checkpoints (a file).
    options: the `convert` options of this family, as argparse keyword arguments keyed by the option
      name without its prefix; the CLI spells them `--{option_prefix}-{key}`; `dest` (default: the
      key with underscores) is the name `converter.build_config` receives, and `convert` refuses
      names the family does not declare.
    option_prefix: prefix of the family's CLI options (default: the model type).
    presets: named config field sets (tiny shapes for tests, the papers' sizes), for `preset()`.
    convert_presets: named `convert` option sets, each a conversion target beside the family's own
      name (`convert --to sse-h` is the `sse` family with `softmax_every=6`); options given
      explicitly override the preset's.
    """

    config_class: type
    model_class: type
    causal_lm_class: type
    mixers: dict[str, type]
    converter: Any = None
    card: str | Path | None = None
    options: dict[str, dict] = field(default_factory=dict)
    option_prefix: str | None = None
    presets: dict[str, dict] = field(default_factory=dict)
    convert_presets: dict[str, dict] = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return self.config_class.model_type

    @property
    def name(self) -> str:
        """The family's name: its model type."""
        return self.config_class.model_type

    def cli_options(self) -> dict[str, dict]:
        """`--prefix-key` -> argparse keyword arguments (with `dest` filled in)."""
        return cli_flags(self.option_prefix or self.model_type, self.options)

    def option_names(self) -> set[str]:
        """The option names `convert` takes for this family (the options' `dest`s)."""
        return {kw["dest"] for kw in self.cli_options().values()}

    def preset(self, name: str, **overrides):
        """A config of the preset `name` with fields overridden by keyword."""
        if name not in self.presets:
            raise ValueError(f"unknown {self.name} preset {name!r}; available: {', '.join(self.presets)}")
        return self.config_class(**{**self.presets[name], **overrides})


def cli_flags(prefix: str, options: dict[str, dict]) -> dict[str, dict]:
    """`--prefix-key` -> argparse keyword arguments, `dest` defaulting to the key with underscores."""
    return {f"--{prefix}-{key}": {"dest": key.replace("-", "_"), **kw} for key, kw in options.items()}


def register_family(family: Family, *, auto_classes: bool = True) -> Family:
    """Declare `family`: register its mixers and (with `auto_classes`) its classes with Transformers'
    AutoConfig / AutoModel / AutoModelForCausalLM (`register_auto_classes`)."""
    _load()  # the built-ins first, so that a name clash with them shows here
    for kind in (family.config_class, family.model_class, family.causal_lm_class):
        if not isinstance(kind, type):
            raise TypeError(f"family {family.name!r}: {kind!r} is not a class")
    if family.converter is not None and family.card is None:
        raise ValueError(f"family {family.name!r} has a converter but names no model card (card=...)")
    for cls in family.mixers.values():
        for attr in ("cache_layer_cls", "needs_key_positions", "reset_mixer_parameters"):
            if not hasattr(cls, attr):
                raise TypeError(f"mixer {cls.__qualname__} of family {family.name!r} has no {attr}; "
                                "subclass subquadratic.modeling.base.AttentionBase")
    taken = {n: f.name for f in _FAMILIES.values() if f.name != family.name for n in (f.name, *f.convert_presets)}
    clash = sorted(n for n in (family.name, *family.convert_presets) if n in taken)
    if clash:
        raise ValueError(f"family {family.name!r}: target name(s) {clash} already taken by family "
                         f"{taken[clash[0]]!r}")
    for name, cls in family.mixers.items():
        register_mixer(name, cls)
    _FAMILIES[family.name] = family
    if auto_classes:
        register_auto_classes(family)
    return family


def register_auto_classes(family: Family) -> None:
    """Make AutoConfig / AutoModel / AutoModelForCausalLM know the family's classes (again: no-op)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    AutoConfig.register(family.model_type, family.config_class, exist_ok=True)
    AutoModel.register(family.config_class, family.model_class, exist_ok=True)
    AutoModelForCausalLM.register(family.config_class, family.causal_lm_class, exist_ok=True)


def unregister_family(name: str) -> Family:
    """Withdraw the family `name` and its mixers from the registry (not from Transformers' Auto
    classes); returns it."""
    family = get_family(name)
    del _FAMILIES[name]
    for mixer_name, cls in family.mixers.items():
        if _MIXERS.get(mixer_name) is cls:
            del _MIXERS[mixer_name]
    return family


def get_family(name: str) -> Family:
    """The family registered under `name`, its model type."""
    return _lookup(_FAMILIES, name, f"unknown family {name!r}", "registered")


#: The family of a model type: `get_family` (a family's name is its model type).
family_of_model_type = get_family


def convert_target(name: str) -> tuple[Family, dict]:
    """The family that `convert --to name` converts to, and the options its preset `name` sets ({}
    for the family's own name). Raises KeyError listing the targets."""
    for fam in families(lambda f: f.converter is not None):
        if name == fam.name:
            return fam, {}
        if name in fam.convert_presets:
            return fam, dict(fam.convert_presets[name])
    raise KeyError(f"unknown target {name!r}; available: {', '.join(convert_targets()) or 'none'}")


def convert_targets() -> list[str]:
    """Every `convert --to` name, sorted: the families with a converter and their presets."""
    return sorted(n for f in families(lambda f: f.converter is not None) for n in (f.name, *f.convert_presets))


def families(where: Callable[[Family], bool] | None = None, *, load: bool = True) -> list[Family]:
    """Registered families in registration order (those for which `where` holds). `load=False`
    reads only those registered so far, without running the loaders (the command line does, to
    build its parser without importing torch: it reads the built-ins from their light declarations)."""
    if load:
        _load()
    return [f for f in _FAMILIES.values() if where is None or where(f)]
