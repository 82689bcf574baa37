"""Families and token mixers, each declared once.

A family (a model type) declares itself with one `register_family(Family(...))` call: its config
class, base and causal-LM model classes, the token mixers it adds (name in `config.mixer_types` ->
mixer class; each mixer class names its cache-layer type in `cache_layer_cls`), its converter from
dense checkpoints, model card, presets and `convert` options. The built-in families do so in
`subquadratic/families/`; an outside family does the same from its own module. Registration makes
the mixers available to the shared decoder and config validation, the family available to
`convert` and the CLI, its classes available to AutoConfig / AutoModel / AutoModelForCausalLM, and
its modules bundled as remote code next to the checkpoints it saves.

This module imports nothing from the package, so it sits at the bottom of the layering (and travels
with the remote code, where `MIXERS` is filled by the bundle's entry module).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Token mixers by the name `config.mixer_types` uses; filled by `register_mixer`.
MIXERS: dict[str, type] = {}
#: Families by name (the `convert --to` target); filled by `register_family`.
FAMILIES: dict[str, Family] = {}


def register_mixer(name: str, cls: type) -> type:
    """Make the token mixer `cls` available under `name` in `config.mixer_types`."""
    if MIXERS.get(name, cls) is not cls and MIXERS[name].__qualname__ != cls.__qualname__:
        raise ValueError(f"mixer name {name!r} is already taken by {MIXERS[name].__qualname__}")
    MIXERS[name] = cls
    return cls


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
    AutoConfig / AutoModel / AutoModelForCausalLM."""
    for kind in (family.config_class, family.model_class, family.causal_lm_class):
        if not isinstance(kind, type):
            raise TypeError(f"family {family.name!r}: {kind!r} is not a class")
    if family.converter is not None and family.card is None:
        raise ValueError(f"family {family.name!r} has a converter but names no model card (card=...)")
    for name, cls in family.mixers.items():
        for attr in ("cache_layer_cls", "needs_key_positions", "reset_mixer_parameters"):
            if not hasattr(cls, attr):
                raise TypeError(f"mixer {cls.__qualname__} of family {family.name!r} has no {attr}; "
                                "subclass subquadratic.modeling.base.AttentionBase")
        register_mixer(name, cls)
    taken = {n: f.name for f in FAMILIES.values() if f.name != family.name for n in (f.name, *f.convert_presets)}
    clash = sorted(n for n in (family.name, *family.convert_presets) if n in taken)
    if clash:
        raise ValueError(f"family {family.name!r}: target name(s) {clash} already taken by family "
                         f"{taken[clash[0]]!r}")
    FAMILIES[family.name] = family
    if auto_classes:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

        AutoConfig.register(family.model_type, family.config_class, exist_ok=True)
        AutoModel.register(family.config_class, family.model_class, exist_ok=True)
        AutoModelForCausalLM.register(family.config_class, family.causal_lm_class, exist_ok=True)
    return family


def get_family(name: str) -> Family:
    """The family registered under `name` (its model type)."""
    if name not in FAMILIES:
        raise KeyError(f"unknown family {name!r}; registered: {', '.join(sorted(FAMILIES)) or 'none'}")
    return FAMILIES[name]


def family_of_model_type(model_type: str) -> Family:
    """The family whose config class has `model_type` (its name: `get_family`)."""
    if model_type not in FAMILIES:
        raise KeyError(f"no family registered for model_type {model_type!r}; "
                       f"registered: {', '.join(sorted(FAMILIES)) or 'none'}")
    return FAMILIES[model_type]


def convert_target(name: str) -> tuple[Family, dict]:
    """The family that `convert --to name` converts to, and the options its preset `name` sets ({}
    for the family's own name). Raises KeyError listing the targets."""
    for fam in FAMILIES.values():
        if fam.converter is not None and name == fam.name:
            return fam, {}
        if fam.converter is not None and name in fam.convert_presets:
            return fam, dict(fam.convert_presets[name])
    raise KeyError(f"unknown target {name!r}; available: {', '.join(convert_targets()) or 'none'}")


def convert_targets() -> list[str]:
    """Every `convert --to` name, sorted: the families with a converter and their presets."""
    return sorted(n for f in FAMILIES.values() if f.converter is not None for n in (f.name, *f.convert_presets))


def families(where: Callable[[Family], bool] | None = None) -> list[Family]:
    """Registered families in registration order (those for which `where` holds)."""
    return [f for f in FAMILIES.values() if where is None or where(f)]
