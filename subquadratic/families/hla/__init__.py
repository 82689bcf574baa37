"""HLA (`hla`): second-order Higher-order Linear Attention, declared once; its hybrid is the convert preset `hla-h`.

The whole declaration is data: `NAME`, `OPTIONS`, `CONVERT_PRESETS`, `CARD` (read by the command line without torch),
then `PARTS` and `MIXERS`, naming where `families.family()` finds the rest of the `registry.Family`
in this folder: `configuration.py` (HLAConfig, tiny presets), `modeling.py` (the mixer, its cache
layer, the model classes), `conversion.py` (the Converter); `card.md` is the model card template.
"""

from pathlib import Path

from ...checks import int_at_least, layer_list_or_auto, positive_int

#: The family's one name: its model type and `convert --to` target.
NAME = "hla"
CARD = Path(__file__).with_name("card.md")
#: `convert` options (`--hla-<key>`; `dest`: the HLAConfig field each one sets, but for the layout).
OPTIONS: dict[str, dict] = {
    "softmax-layers": dict(
        type=layer_list_or_auto,
        help="comma list of the layers that keep softmax attention, or auto:K: the K layers whose replacement "
             "costs the most, measured by a short attention transfer (--calibration-data), or retrieval:K: the K "
             "layers holding the source's strongest retrieval heads (scored on needle prompts; retrieval:1/N: "
             "a N-th of the layers)",
    ),
    "softmax-every": dict(type=int_at_least(0, "K"),
                          help="every K-th layer keeps softmax attention (default: none, pure HLA)"),
    "variant": dict(choices=["hla2", "ahla"], dest="hla_variant", help="second-order or asymmetric (default hla2)"),
    "decay": dict(choices=["data", "constant"], dest="decay_mode", help="per-head decay gate (default data)"),
    "chunk-size": dict(type=positive_int, dest="hla_chunk_size",
                       help="chunk of the training / prefill form (default 64)"),
    "normalize": dict(action="store_const", const=True, dest="hla_normalize", help="normalised form"),
    "rope": dict(action="store_const", const=True, dest="hla_rope", help="apply the source's RoPE to q and k"),
    "sliding-window": dict(
        type=int_at_least(0, "W"), dest="hla_sliding_window",
        help="add an in-layer sliding-window softmax branch of this many tokens to the HLA output (a copy of the "
             "source attention; a fresh conversion is exactly that window)",
    ),
    "window-sinks": dict(
        type=int_at_least(0, "N"), dest="hla_window_sinks",
        help="the window branch also sees the first N tokens, the attention sinks (default 4 with a window)",
    ),
    "decay-init-min": dict(
        type=float, dest="decay_init_min",
        help="initial decay rate of the shortest-memory head (default 0.9; the heads spread geometrically in "
             "1 - alpha up to --hla-decay-init-max)",
    ),
    "decay-init-max": dict(
        type=float, dest="decay_init_max",
        help="initial decay rate of the longest-memory head (default 0.99: a memory of ~100 tokens)",
    ),
}
#: Conversion targets beside `hla` (pure HLA, every layer): option sets under the given options. HLA-H,
#: the hybrid, keeps softmax attention in a sixth of the layers, those holding the source's strongest
#: retrieval heads (`retrieval:1/6`, `layer_choice.retrieval_head_layout`: docs/results.md, "Recall"),
#: and adds a 64-token window branch (with 4 sinks) to the HLA output of the others, as SSE-H does
#: (`--hla-sliding-window 0` converts without it; `--hla-softmax-every 6` keeps every 6th layer).
CONVERT_PRESETS: dict[str, dict] = {"hla-h": {"softmax_layers": "retrieval:1/6", "hla_sliding_window": 64}}
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
