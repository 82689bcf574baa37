"""SPLA (`spla`): block-sparse attention plus residual linear attention, declared once.

The light part (`NAME`, `OPTIONS`, `CARD`; no torch needed: the command line reads it), then
`config_class()` (the configuration module alone) and `family()`, the full declaration
(`registry.Family`), which import the folder's modules: `configuration.py` (SPLAConfig),
`modeling.py` (the mixer, its cache layer, the model classes), `conversion.py` (the Converter);
`card.md` is the model card template.
"""

from pathlib import Path

from ...checks import nonnegative_int, positive_int, power_of_two
from ...registry import Family

#: The family's one name: its model type and `convert --to` target.
NAME = "spla"
CARD = Path(__file__).with_name("card.md")
#: `convert` options (`--spla-<key>`; `dest`: the SPLAConfig field each one sets).
OPTIONS: dict[str, dict] = {
    "block-size": dict(type=power_of_two, help="keys per block, a power of two (default 64)"),
    "top-k-blocks": dict(type=positive_int, help="blocks attended per query, forced ones included (default 16)"),
    "sink-blocks": dict(type=nonnegative_int, dest="num_sink_blocks", help="always-selected first blocks (default 1)"),
    "local-blocks": dict(type=positive_int, dest="num_local_blocks",
                         help="always-selected recent blocks (default 2)"),
    "selection": dict(choices=["taylor", "mean"], help="block scoring (default taylor)"),
    "no-rla": dict(action="store_const", const=False, dest="use_rla",
                   help="no residual linear-attention term: sparse attention alone (the SPA ablation)"),
}


def config_class() -> type:
    """The config class alone (what AutoConfig needs; imports no model code)."""
    from .configuration import SPLAConfig

    return SPLAConfig


def family() -> Family:
    """The full declaration (imports the configuration, model and converter modules)."""
    from .configuration import SPLAConfig
    from .conversion import CONVERTER
    from .modeling import SPLAAttention, SPLAForCausalLM, SPLAModel

    return Family(
        config_class=SPLAConfig,
        model_class=SPLAModel,
        causal_lm_class=SPLAForCausalLM,
        mixers={"spla": SPLAAttention},  # cache layer: SPLALayer
        converter=CONVERTER,
        card=CARD,
        options=OPTIONS,
    )
