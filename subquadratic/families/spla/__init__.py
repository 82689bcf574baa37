"""SPLA (`spla`): block-sparse attention plus residual linear attention, declared once."""

from pathlib import Path

from ...registry import Family

NAME = "spla"
OPTION_PREFIX = "spla"
#: Model card template of converted checkpoints.
CARD = Path(__file__).with_name("card.md")
#: `convert` options (`--spla-<key>`), readable without importing the model code.
OPTIONS: dict[str, dict] = {
    "block-size": dict(type=int, help="keys per block, a power of two (default 64)"),
    "top-k-blocks": dict(type=int, help="blocks attended per query, forced ones included (default 16)"),
    "sink-blocks": dict(type=int, dest="num_sink_blocks", help="always-selected first blocks (default 1)"),
    "local-blocks": dict(type=int, dest="num_local_blocks", help="always-selected recent blocks (default 2)"),
    "selection": dict(choices=["taylor", "mean"], help="block scoring (default taylor)"),
}


def family() -> Family:
    """The full declaration (imports the configuration, model and converter modules)."""
    from .configuration import SPLAConfig
    from .conversion import CONVERTER
    from .modeling import SPLAAttention, SPLAForCausalLM, SPLAModel

    return Family(
        name=NAME,
        config_class=SPLAConfig,
        model_class=SPLAModel,
        causal_lm_class=SPLAForCausalLM,
        mixers={"spla": SPLAAttention},  # cache layer: SPLALayer
        converter=CONVERTER,
        card=CARD,
        options=OPTIONS,
        option_prefix=OPTION_PREFIX,
    )
