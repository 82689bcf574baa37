"""Dense -> HLA: HLA layers built from the source projections, softmax layers kept where asked.

Conversion table (layer i, names under model.layers.{i}.self_attn):

| source                  | softmax layer | HLA layer                                                |
| ----------------------- | ------------- | -------------------------------------------------------- |
| q_proj, k_proj, v_proj  | as is         | as is (K/V heads are repeated to HQ inside the mixer)    |
| o_proj, q_norm, k_norm  | as is         | as is (qk-norm applied before the L2 normalisation)      |
| -                       | -             | new: decay_bias (alphas spread over the heads),          |
|                         |               | decay_proj, g_proj (small random), o_norm (ones)         |

Everything outside self_attn (embeddings, MLPs, layer norms, lm_head) is copied unchanged. HLA does
not approximate softmax attention, so a converted model must be distilled before use (the model card
says so). The new parameters come from `HLAAttention.reset_mixer_parameters` under a fixed seed.
"""

from __future__ import annotations

from ...configuration.base import SOFTMAX_MIXERS
from ...conversion.core import Converter, hybrid_config, softmax_layer_notes
from .configuration import HLAConfig


def build_config(fields: dict, options: dict) -> HLAConfig:
    """The layout options choose the softmax layers (none by default: pure HLA); every other option
    (`OPTIONS` of the declaration) is an HLAConfig field."""
    return hybrid_config(HLAConfig, fields, options, "hla", "hla")


def card_notes(config: HLAConfig) -> dict[str, str]:
    soft = [i for i, kind in enumerate(config.mixer_types) if kind in SOFTMAX_MIXERS]
    return {
        "variant": config.hla_variant,
        "decay_mode": config.decay_mode,
        "num_layers": str(config.num_hidden_layers),
        "num_hla_layers": str(config.num_hidden_layers - len(soft)),
        "softmax_layers": softmax_layer_notes(config) or "none (pure HLA)",
        "summary": (f"{config.hla_variant}, {config.decay_mode} decay, "
                    f"softmax layers: {softmax_layer_notes(config) or 'none'}"),
    }


#: New parameters come from `HLAAttention.reset_mixer_parameters` (the default `new_tensors`).
CONVERTER = Converter(build_config, card_notes=card_notes)
