"""Dense -> SSE / SSE-H: softmax layers (none, or those the layout options or the `sse-h` preset
name) keep the source attention; the other layers become SSE layers.

Conversion table (layer i, names under model.layers.{i}.self_attn):

| source          | softmax layer | SSE layer                                                  |
| --------------- | ------------- | ---------------------------------------------------------- |
| q_proj, o_proj  | as is         | as is                                                      |
| k_proj, v_proj  | as is         | each K/V head repeated to its G = HQ/H query heads (as is  |
|                 |               | with --sse-kv-heads source)                                |
| q_norm, k_norm  | as is         | as is, applied to q1/q2 and k1/k2 (Qwen3)                  |
| (all of these)  | -             | also copied to swa.* as is, with --sse-sliding-window (but |
|                 |               | q/k/v_proj with --sse-window-qkv shared: the SSE layer's)  |
| -               | -             | new: LoRA down random / up = 0, router small random, decay |
|                 |               | biases for long memory, output gate, norms = 1             |

Everything outside self_attn (embeddings, MLPs, layer norms, lm_head) is copied unchanged. The new
parameters come from `SSEAttention.reset_mixer_parameters` (one source of truth for the
initialisation) under a fixed seed, so a conversion is reproducible.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ...configuration.base import SOFTMAX_MIXERS
from ...conversion.core import (
    SOURCE_AND_WINDOW_PARAMS,
    Converter,
    fresh_mixer_tensors,
    hybrid_config,
    mixer_tensor,
    softmax_layer_notes,
)
from ...modeling.window import window_copies, with_sink_default
from .configuration import SSEConfig

SEED = 0


def build_config(fields: dict, options: dict) -> SSEConfig:
    """The layout options choose the softmax layers (none by default: pure SSE; the `sse-h` preset: a
    sixth of them, measured by `layer_choice` before this runs); every other option (`OPTIONS` of the
    declaration) is an SSEConfig field."""
    return hybrid_config(SSEConfig, fields, with_sink_default(options, "sse_sliding_window", "sse_window_sinks"),
                         "sse", "sse")


def _is_sse(config: SSEConfig, layer: int) -> bool:
    return config.mixer_types[layer] not in SOFTMAX_MIXERS


def map_tensor(name: str, t: torch.Tensor, config: SSEConfig) -> Iterable[tuple[str, torch.Tensor]]:
    parts = mixer_tensor(name)
    if parts is None or not _is_sse(config, parts[1]):
        return [(name, t)]
    prefix, _, rest = parts
    shared = config.sse_window_qkv == "shared" and rest.split(".")[0] in ("q_proj", "k_proj", "v_proj")
    out = window_copies(prefix, rest, t) if config.sse_sliding_window and not shared else []
    if rest.split(".")[0] in ("k_proj", "v_proj") and config.sse_kv_heads == "query":
        # [H * D, ...] -> [HQ * D, ...], kv head j -> q heads jG..jG+G-1
        h, g = config.num_key_value_heads, config.num_key_value_groups
        t = t.reshape(h, -1, *t.shape[1:]).repeat_interleave(g, dim=0).reshape(-1, *t.shape[1:])
    return [(name, t), *out]


def new_tensors(config: SSEConfig) -> dict[str, torch.Tensor]:
    """The SSE layers' new parameters (see `fresh_mixer_tensors`)."""
    return fresh_mixer_tensors(config, SOURCE_AND_WINDOW_PARAMS, SEED)


def card_notes(config: SSEConfig) -> dict[str, str]:
    soft = config.softmax_layers
    return {
        "name": "SSE-H" if soft else "SSE",
        "partitions": str(config.sse_num_partitions),
        "top_k": str(config.sse_top_k),
        "sse_base": config.sse_base,
        "num_layers": str(config.num_hidden_layers),
        "num_sse_layers": str(config.num_hidden_layers - len(soft)),
        "softmax_layers": softmax_layer_notes(config) or "none (pure SSE)",
        "sliding_window": (f"{config.sse_sliding_window} tokens and the first {config.sse_window_sinks}, "
                           + ("added to the SSE output (the gate's up projection starts at 0, so the fresh layer "
                              "is exactly that window)" if config.sse_window_merge == "sum" else
                              "merged as (RMSNorm(SSE) + RMSNorm(window)) / 2")
                           if config.sse_sliding_window else "off"),
        "hybrid_tag": "\n- sse-h" if soft else "",
        "summary": (f"{config.sse_num_partitions} partitions, top-{config.sse_top_k}, {config.sse_base} base, "
                    f"softmax layers: {softmax_layer_notes(config) or 'none'}"),
    }


CONVERTER = Converter(build_config, map_tensor=map_tensor, new_tensors=new_tensors, card_notes=card_notes)
