"""A small family declared outside the package, for tests/models/test_extra_family.py: sliding-window
softmax attention with a per-channel output gain (its one new parameter, 1 at initialisation).

It imports the package by absolute module paths only (not `subquadratic` itself), so the module
travels as remote code next to the checkpoints it saves.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import initialization as init

from subquadratic.configuration.base import SubquadraticConfig
from subquadratic.modeling.base import SoftmaxAttention, SubquadraticForCausalLM, SubquadraticModel


class SWAConfig(SubquadraticConfig):
    """Every layer attends to its last `window` tokens."""

    model_type = "swa_test"
    default_mixer: ClassVar[str] = "local_softmax"

    window: int = 64

    def check(self) -> None:
        super().check()
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


class LocalSoftmax(SoftmaxAttention):
    """Sliding-window softmax attention (the shared KV cache layer), output scaled by `out_gain`."""

    def __init__(self, config: SWAConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.window = config.window
        self.out_gain = nn.Parameter(torch.empty(config.hidden_size))
        self.reset_mixer_parameters()

    def reset_mixer_parameters(self) -> None:
        init.ones_(self.out_gain)

    def forward(self, hidden_states, position_embeddings, seq, cache_layer=None):
        out, aux = super().forward(hidden_states, position_embeddings, seq, cache_layer)
        return out * self.out_gain, aux


class SWAModel(SubquadraticModel):
    config_class = SWAConfig


class SWAForCausalLM(SubquadraticForCausalLM):
    config_class = SWAConfig
    base_model_class = SWAModel
