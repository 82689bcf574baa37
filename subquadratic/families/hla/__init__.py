"""HLA (`hla`): second-order Higher-order Linear Attention, declared once."""

from pathlib import Path

from ...registry import Family

NAME = "hla"
OPTION_PREFIX = "hla"
#: Model card template of converted checkpoints.
CARD = Path(__file__).with_name("card.md")
#: `convert` options (`--hla-<key>`), readable without importing the model code.
OPTIONS: dict[str, dict] = {
    "softmax-layers": dict(help="comma list of the layers that keep softmax attention"),
    "softmax-every": dict(type=int, help="every K-th layer keeps softmax attention (default: none, pure HLA)"),
    "variant": dict(choices=["hla2", "ahla"], dest="hla_variant", help="second-order or asymmetric (default hla2)"),
    "decay": dict(choices=["data", "constant"], dest="decay_mode", help="per-head decay gate (default data)"),
    "chunk-size": dict(type=int, dest="hla_chunk_size", help="chunk of the training / prefill form (default 64)"),
    "normalize": dict(action="store_const", const=True, dest="hla_normalize", help="normalised form"),
    "rope": dict(action="store_const", const=True, dest="hla_rope", help="apply the source's RoPE to q and k"),
}


def family() -> Family:
    """The full declaration (imports the configuration, model and converter modules)."""
    from .configuration import TINY_PRESETS, HLAConfig
    from .conversion import CONVERTER
    from .modeling import HLAAttention, HLAForCausalLM, HLAModel

    return Family(
        name=NAME,
        config_class=HLAConfig,
        model_class=HLAModel,
        causal_lm_class=HLAForCausalLM,
        mixers={"hla": HLAAttention},  # cache layer: HLALayer
        converter=CONVERTER,
        card=CARD,
        presets=TINY_PRESETS,
        options=OPTIONS,
        option_prefix=OPTION_PREFIX,
    )
