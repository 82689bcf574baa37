"""SPLA (`spla`): block-sparse attention plus residual linear attention, declared once."""

from ..configuration.spla import SPLAConfig
from ..conversion.spla import CONVERTER
from ..modeling.spla import SPLAAttention, SPLAForCausalLM, SPLAModel
from ..registry import Family, register_family

FAMILY = register_family(Family(
    name="spla",
    config_class=SPLAConfig,
    model_class=SPLAModel,
    causal_lm_class=SPLAForCausalLM,
    mixers={"spla": SPLAAttention},  # cache layer: SPLALayer
    converter=CONVERTER,
    card="spla.md",
    options={
        "block-size": dict(type=int, help="keys per block, a power of two (default 64)"),
        "top-k-blocks": dict(type=int, help="blocks attended per query, forced ones included (default 16)"),
        "sink-blocks": dict(type=int, dest="num_sink_blocks", help="always-selected first blocks (default 1)"),
        "local-blocks": dict(type=int, dest="num_local_blocks", help="always-selected recent blocks (default 2)"),
        "selection": dict(choices=["taylor", "mean"], help="block scoring (default taylor)"),
    },
))
