"""HLA (`hla`): second-order Higher-order Linear Attention, declared once.

The light part (`NAME`, `OPTIONS`, `CARD`; no torch needed: the command line reads it), then
`config_class()` (the configuration module alone) and `family()`, the full declaration
(`registry.Family`), which import the folder's modules: `configuration.py` (HLAConfig, tiny
presets), `modeling.py` (the mixer, its cache layer, the model classes), `conversion.py` (the
Converter); `card.md` is the model card template.
"""

from pathlib import Path

from ...checks import int_at_least, layer_list, positive_int
from ...registry import Family

#: The family's one name: its model type and `convert --to` target.
NAME = "hla"
CARD = Path(__file__).with_name("card.md")
#: `convert` options (`--hla-<key>`; `dest`: the HLAConfig field each one sets, but for the layout).
OPTIONS: dict[str, dict] = {
    "softmax-layers": dict(type=layer_list, help="comma list of the layers that keep softmax attention"),
    "softmax-every": dict(type=int_at_least(0, "K"),
                          help="every K-th layer keeps softmax attention (default: none, pure HLA)"),
    "variant": dict(choices=["hla2", "ahla"], dest="hla_variant", help="second-order or asymmetric (default hla2)"),
    "decay": dict(choices=["data", "constant"], dest="decay_mode", help="per-head decay gate (default data)"),
    "chunk-size": dict(type=positive_int, dest="hla_chunk_size",
                       help="chunk of the training / prefill form (default 64)"),
    "normalize": dict(action="store_const", const=True, dest="hla_normalize", help="normalised form"),
    "rope": dict(action="store_const", const=True, dest="hla_rope", help="apply the source's RoPE to q and k"),
}


def config_class() -> type:
    """The config class alone (what AutoConfig needs; imports no model code)."""
    from .configuration import HLAConfig

    return HLAConfig


def family() -> Family:
    """The full declaration (imports the configuration, model and converter modules)."""
    from .configuration import TINY_PRESETS, HLAConfig
    from .conversion import CONVERTER
    from .modeling import HLAAttention, HLAForCausalLM, HLAModel

    return Family(
        config_class=HLAConfig,
        model_class=HLAModel,
        causal_lm_class=HLAForCausalLM,
        mixers={"hla": HLAAttention},  # cache layer: HLALayer
        converter=CONVERTER,
        card=CARD,
        presets=TINY_PRESETS,
        options=OPTIONS,
    )
