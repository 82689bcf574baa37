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

import re

import torch

from ..configuration.base import SOFTMAX_MIXERS
from ..configuration.hla import HLAConfig
from .core import FamilyConverter, fresh_mixer_tensors, register_family, softmax_layer_set

#: CLI destinations passed straight to HLAConfig.
CONFIG_OPTIONS = ("hla_variant", "decay_mode", "hla_chunk_size", "hla_normalize", "hla_rope")
SEED = 0
#: Parameters of an HLA layer that the dense source provides (everything else is new).
_FROM_SOURCE = re.compile(r"^(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.")


def build_config(fields: dict, options: dict) -> HLAConfig:
    n = fields["num_hidden_layers"]
    keep = softmax_layer_set(
        n, options.get("hla_softmax_every"), options.get("hla_softmax_layers"),
        every_flag="--hla-softmax-every", layers_flag="--hla-softmax-layers",
    )
    mixers = ["full_attention" if i in keep else "hla" for i in range(n)]
    extra = {k: v for k, v in options.items() if k in CONFIG_OPTIONS and v is not None}
    return HLAConfig(**fields, mixer_types=mixers, **extra)


def new_tensors(config: HLAConfig) -> dict[str, torch.Tensor]:
    """The HLA layers' new parameters (see `fresh_mixer_tensors`)."""
    from ..modeling.hla import HLAAttention

    return fresh_mixer_tensors(config, HLAAttention, _FROM_SOURCE, SEED)


def card_notes(config: HLAConfig) -> dict[str, str]:
    soft = [i for i, kind in enumerate(config.mixer_types) if kind in SOFTMAX_MIXERS]
    return {
        "variant": config.hla_variant,
        "decay_mode": config.decay_mode,
        "num_layers": str(config.num_hidden_layers),
        "num_hla_layers": str(config.num_hidden_layers - len(soft)),
        "softmax_layers": ", ".join(map(str, soft)) or "none (pure HLA)",
    }


CLI_OPTIONS = {
    "--hla-softmax-layers": dict(dest="hla_softmax_layers", help="comma list of the layers that keep softmax attention"),  # noqa: E501
    "--hla-softmax-every": dict(
        type=int, dest="hla_softmax_every", help="every K-th layer keeps softmax attention (default: none, pure HLA)"
    ),
    "--hla-variant": dict(choices=["hla2", "ahla"], dest="hla_variant", help="second-order or asymmetric (default hla2)"),  # noqa: E501
    "--hla-decay": dict(choices=["data", "constant"], dest="decay_mode", help="per-head decay gate (default data)"),
    "--hla-chunk-size": dict(type=int, dest="hla_chunk_size", help="chunk of the training / prefill form (default 64)"),
    "--hla-normalize": dict(action="store_const", const=True, dest="hla_normalize", help="normalised form"),
    "--hla-rope": dict(action="store_const", const=True, dest="hla_rope", help="apply the source's RoPE to q and k"),
}

register_family(
    FamilyConverter(
        "hla", build_config, new_tensors=new_tensors, card="hla.md", card_notes=card_notes, options=CLI_OPTIONS
    )
)
