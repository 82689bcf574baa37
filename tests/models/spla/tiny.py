"""A tiny SPLA model for tests."""

from __future__ import annotations

import torch

from ...conftest import TINY


def tiny_spla(seed: int = 0, gamma: float | None = 1.0, **overrides):
    """A tiny SPLA model; gamma (the residual norm gain) set to random values so the RLA term counts."""
    from subquadratic import SPLAConfig, SPLAForCausalLM

    kw = dict(TINY, block_size=8, top_k_blocks=4, num_sink_blocks=1, num_local_blocks=2, pad_token_id=0,
              bos_token_id=None, eos_token_id=None)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = SPLAForCausalLM(SPLAConfig(**kw)).eval()
    if gamma is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "rla_norm" in name:
                    p.copy_(gamma * torch.randn_like(p))
    return model
