"""Dense -> SPLA: the weights keep their names; each layer gains gamma = 0 (rla_norm.weight), so the
converted model is exactly sparse attention, and the dense model while the budget covers the context."""

from __future__ import annotations

import torch

from ..configuration.spla import SPLAConfig
from .core import FamilyConverter, register_family

OPTIONS = ("block_size", "top_k_blocks", "num_sink_blocks", "num_local_blocks", "selection", "use_rla")


def build_config(fields: dict, options: dict) -> SPLAConfig:
    return SPLAConfig(**fields, **{k: v for k, v in options.items() if k in OPTIONS and v is not None})


def new_tensors(config: SPLAConfig) -> dict[str, torch.Tensor]:
    shape = (config.num_attention_heads, config.head_dim)
    return {
        f"model.layers.{i}.self_attn.rla_norm.weight": torch.zeros(shape)
        for i, kind in enumerate(config.mixer_types)
        if kind == "spla"
    }


def card_notes(config: SPLAConfig) -> dict[str, str]:
    return {
        "budget": f"{config.top_k_blocks} blocks x {config.block_size} tokens = {config.budget_tokens} tokens",
        "block_size": str(config.block_size),
        "top_k_blocks": str(config.top_k_blocks),
    }


CLI_OPTIONS = {
    "--block-size": dict(type=int, help="keys per block, a power of two (default 64)"),
    "--top-k-blocks": dict(type=int, help="blocks attended per query, forced ones included (default 16)"),
    "--sink-blocks": dict(type=int, dest="num_sink_blocks", help="always-selected first blocks (default 1)"),
    "--local-blocks": dict(type=int, dest="num_local_blocks", help="always-selected recent blocks (default 2)"),
    "--selection": dict(choices=["taylor", "mean"], help="block scoring (default taylor)"),
}

register_family(
    FamilyConverter(
        "spla", build_config, new_tensors=new_tensors, card="spla.md", card_notes=card_notes, options=CLI_OPTIONS
    )
)
