"""HLA (`hla`): second-order Higher-order Linear Attention, declared once.

The whole declaration is data: `NAME`, `OPTIONS`, `CARD` (read by the command line without torch),
then `PARTS` and `MIXERS`, naming where `families.family()` finds the rest of the `registry.Family`
in this folder: `configuration.py` (HLAConfig, tiny presets), `modeling.py` (the mixer, its cache
layer, the model classes), `conversion.py` (the Converter); `card.md` is the model card template.
"""

from pathlib import Path

#: The family's one name: its model type and `convert --to` target.
NAME = "hla"
CARD = Path(__file__).with_name("card.md")
#: `convert` options (`--hla-<key>`; `dest`: the HLAConfig field each one sets, but for the layout).
OPTIONS: dict[str, dict] = {
    "softmax-layers": dict(help="comma list of the layers that keep softmax attention"),
    "softmax-every": dict(type=int, help="every K-th layer keeps softmax attention (default: none, pure HLA)"),
    "variant": dict(choices=["hla2", "ahla"], dest="hla_variant", help="second-order or asymmetric (default hla2)"),
    "decay": dict(choices=["data", "constant"], dest="decay_mode", help="per-head decay gate (default data)"),
    "chunk-size": dict(type=int, dest="hla_chunk_size", help="chunk of the training / prefill form (default 64)"),
    "normalize": dict(action="store_const", const=True, dest="hla_normalize", help="normalised form"),
    "rope": dict(action="store_const", const=True, dest="hla_rope", help="apply the source's RoPE to q and k"),
}
#: Where the rest of the declaration lives: `registry.Family` field -> "module:attribute" of this
#: folder, imported by `families.family()` (the config class alone by `families.config_class()`).
PARTS: dict[str, str] = {
    "config_class": "configuration:HLAConfig",
    "model_class": "modeling:HLAModel",
    "causal_lm_class": "modeling:HLAForCausalLM",
    "converter": "conversion:CONVERTER",
    "presets": "configuration:TINY_PRESETS",
}
#: The token mixers the family adds: name in `config.mixer_types` -> "module:class" (cache layer: HLALayer).
MIXERS: dict[str, str] = {"hla": "modeling:HLAAttention"}
