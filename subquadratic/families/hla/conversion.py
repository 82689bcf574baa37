"""Dense -> HLA: HLA layers built from the source projections, softmax layers kept where asked.

Conversion table (layer i, names under model.layers.{i}.self_attn):

| source                  | softmax layer | HLA layer                                                |
| ----------------------- | ------------- | -------------------------------------------------------- |
| q_proj, k_proj, v_proj  | as is         | as is (K/V heads are repeated to HQ inside the mixer)    |
| o_proj, q_norm, k_norm  | as is         | as is (qk-norm applied before the L2 normalisation)      |
| (all of these)          | -             | also copied to swa.* as is, with --hla-sliding-window    |
| -                       | -             | new: decay_bias (alphas spread over the heads),          |
|                         |               | decay_proj, g_proj (small random; 0 with the window),    |
|                         |               | o_norm (ones)                                            |

Everything outside self_attn (embeddings, MLPs, layer norms, lm_head) is copied unchanged. HLA does
not approximate softmax attention, so a converted model must be distilled before use (the model card
says so). The new parameters come from `HLAAttention.reset_mixer_parameters` under a fixed seed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ...configuration.base import SOFTMAX_MIXERS
from ...conversion.core import SOURCE_AND_WINDOW_PARAMS, Converter, hybrid_config, mixer_tensor, softmax_layer_notes
from ...modeling.window import window_copies, with_sink_default
from .configuration import HLAConfig


def build_config(fields: dict, options: dict) -> HLAConfig:
    """The layout options choose the softmax layers (none by default: pure HLA); every other option
    (`OPTIONS` of the declaration) is an HLAConfig field."""
    return hybrid_config(HLAConfig, fields, with_sink_default(options, "hla_sliding_window", "hla_window_sinks"),
                         "hla", "hla")


def card_notes(config: HLAConfig) -> dict[str, str]:
    soft = [i for i, kind in enumerate(config.mixer_types) if kind in SOFTMAX_MIXERS]
    return {
        "variant": config.hla_variant,
        "decay_mode": config.decay_mode,
        "num_layers": str(config.num_hidden_layers),
        "num_hla_layers": str(config.num_hidden_layers - len(soft)),
        "softmax_layers": softmax_layer_notes(config) or "none (pure HLA)",
        "sliding_window": (f"{config.hla_sliding_window} tokens and the first {config.hla_window_sinks}, added to "
                           "the HLA output (a copy of the source attention; the gate starts at 0, so the fresh "
                           "layer is exactly that window)"
                           if config.hla_sliding_window else "off"),
        "summary": (f"{config.hla_variant}, {config.decay_mode} decay, "
                    f"softmax layers: {softmax_layer_notes(config) or 'none'}"),
    }


def map_tensor(name: str, t: torch.Tensor, config: HLAConfig) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor as is; with the window branch, an HLA layer's attention tensors also under swa."""
    parts = mixer_tensor(name)
    if parts is None or not config.hla_sliding_window or config.mixer_types[parts[1]] in SOFTMAX_MIXERS:
        return [(name, t)]
    return [(name, t), *window_copies(parts[0], parts[2], t)]


#: New parameters come from `HLAAttention.reset_mixer_parameters` (the default `new_tensors`); the
#: window branch's come from the source.
CONVERTER = Converter(build_config, map_tensor=map_tensor, card_notes=card_notes,
                      from_source=SOURCE_AND_WINDOW_PARAMS)
