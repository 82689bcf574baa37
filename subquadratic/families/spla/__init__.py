"""SPLA (`spla`): block-sparse attention plus residual linear attention, declared once.

The whole declaration is data: `NAME`, `OPTIONS`, `CARD` (read by the command line without torch),
then `PARTS` and `MIXERS`, naming where `families.family()` finds the rest of the `registry.Family`
in this folder: `configuration.py` (SPLAConfig), `modeling.py` (the mixer, its cache layer, the model
classes), `conversion.py` (the Converter); `card.md` is the model card template.
"""

from pathlib import Path

#: The family's one name: its model type and `convert --to` target.
NAME = "spla"
CARD = Path(__file__).with_name("card.md")
#: `convert` options (`--spla-<key>`; `dest`: the SPLAConfig field each one sets).
OPTIONS: dict[str, dict] = {
    "block-size": dict(type=int, help="keys per block, a power of two (default 64)"),
    "top-k-blocks": dict(type=int, help="blocks attended per query, forced ones included (default 16)"),
    "sink-blocks": dict(type=int, dest="num_sink_blocks", help="always-selected first blocks (default 1)"),
    "local-blocks": dict(type=int, dest="num_local_blocks", help="always-selected recent blocks (default 2)"),
    "selection": dict(choices=["taylor", "mean"], help="block scoring (default taylor)"),
    "no-rla": dict(action="store_const", const=False, dest="use_rla",
                   help="no residual linear-attention term: sparse attention alone (the SPA ablation)"),
}
#: Where the rest of the declaration lives: `registry.Family` field -> "module:attribute" of this
#: folder, imported by `families.family()` (the config class alone by `families.config_class()`).
PARTS: dict[str, str] = {
    "config_class": "configuration:SPLAConfig",
    "model_class": "modeling:SPLAModel",
    "causal_lm_class": "modeling:SPLAForCausalLM",
    "converter": "conversion:CONVERTER",
}
#: The token mixers the family adds: name in `config.mixer_types` -> "module:class" (cache layer: SPLALayer).
MIXERS: dict[str, str] = {"spla": "modeling:SPLAAttention"}
