"""Dense -> SPLA: the weights keep their names; each layer gains gamma = 0 (rla_norm.weight, from
`SPLAAttention.reset_mixer_parameters`), so the converted model is exactly sparse attention, and the
dense model while the budget covers the context."""

from __future__ import annotations

from ..configuration.spla import SPLAConfig
from .core import Converter

OPTIONS = ("block_size", "top_k_blocks", "num_sink_blocks", "num_local_blocks", "selection", "use_rla")


def build_config(fields: dict, options: dict) -> SPLAConfig:
    return SPLAConfig(**fields, **{k: v for k, v in options.items() if k in OPTIONS and v is not None})


def card_notes(config: SPLAConfig) -> dict[str, str]:
    return {
        "budget": f"{config.top_k_blocks} blocks x {config.block_size} tokens = {config.budget_tokens} tokens",
        "block_size": str(config.block_size),
        "top_k_blocks": str(config.top_k_blocks),
    }


CONVERTER = Converter(build_config, card_notes=card_notes)
