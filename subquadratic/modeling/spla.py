"""SPLA token mixer and model classes (DESIGN.md "SPLA").

o = o_sp + RMSNorm_gamma(o_rla), then W_o: o_sp is exact softmax attention over the selected KV
blocks, o_rla the residual linear attention over everything else, obtained by subtraction. gamma
[HQ, D] are the only new parameters; they start at 0, so a converted model begins as exact sparse
attention (and as the dense model while the budget covers the context).
"""

from __future__ import annotations

import torch

from ..configuration.spla import SPLAConfig
from ..kernels.spla import BlockStats, spla_attention
from .base import (
    AttentionBase,
    HeadNorm,
    SequenceInfo,
    SubquadraticForCausalLM,
    SubquadraticModel,
    register_mixer,
)
from .cache import StateLayer


class SPLALayer(StateLayer):
    """SPLA cache: post-RoPE keys k and values v [B, H, S, D], running block sums (sum_k, sum_k2
    [B, H, NB, D], count [B, NB]) and the residual linear state sbar [B, H, D, D], all updated with the
    new tokens only."""

    def update(self, k, v, pos, block_size):
        """Append new keys/values at logical positions pos [B, T]; returns (K, V, stats incl. new, sbar before)."""
        B, H, _, D = k.shape
        st = self.state
        if "k" in st:
            K, V = torch.cat([st["k"], k], dim=2), torch.cat([st["v"], v], dim=2)
            stats = BlockStats(st["sum_k"], st["sum_k2"], st["count"])
            sbar = st["sbar"]
        else:
            K, V = k, v
            acc = torch.float64 if k.dtype == torch.float64 else torch.float32
            stats = BlockStats.empty(B, H, D, k.device, acc)
            sbar = torch.zeros(B, H, D, D, device=k.device, dtype=acc)
        stats = stats.add(k, pos, block_size)
        st.update(k=K, v=V, sum_k=stats.sum_k, sum_k2=stats.sum_k2, count=stats.count)
        return K, V, stats, sbar

    def set_sbar(self, sbar: torch.Tensor) -> None:
        self.state["sbar"] = sbar


@register_mixer("spla")
class SPLAAttention(AttentionBase):
    cache_layer_cls = SPLALayer

    def __init__(self, config: SPLAConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        # gamma of the residual term's RMSNorm; 0 after conversion and at initialisation
        self.rla_norm = HeadNorm(self.num_heads, self.head_dim, eps=config.rms_norm_eps, init_value=0.0)

    def forward(self, hidden_states, position_embeddings, seq: SequenceInfo, cache_layer=None):
        cfg = self.config
        q, k, v = self.project(hidden_states, position_embeddings)
        if cache_layer is not None:
            K, V, stats, sbar = cache_layer.update(k, v, seq.positions, cfg.block_size)
        else:
            K, V = k, v
            acc = torch.float64 if k.dtype == torch.float64 else torch.float32
            B, H, _, D = k.shape
            nb = -(-k.shape[2] // cfg.block_size)  # an upper bound of the blocks, without a host sync
            stats = BlockStats.empty(B, H, D, k.device, acc, num_blocks=nb).add_(k, seq.positions, cfg.block_size)
            sbar = torch.zeros(B, H, D, D, device=k.device, dtype=acc)
        o_sp, o_rla, sbar = spla_attention(
            q, K, V, seq.positions, seq.key_positions, stats, sbar,
            backend=cfg.spla_backend, k_offsets=seq.key_offsets() if q.is_cuda else None,
            block_size=cfg.block_size, top_k_blocks=cfg.top_k_blocks, num_sink_blocks=cfg.num_sink_blocks,
            num_local_blocks=cfg.num_local_blocks, selection=cfg.selection, use_rla=cfg.use_rla,
        )
        if cache_layer is not None:
            cache_layer.set_sbar(sbar)
        o = o_sp if o_rla is None else o_sp + self.rla_norm(o_rla)
        return self.output(o), None


class SPLAModel(SubquadraticModel):
    config_class = SPLAConfig


class SPLAForCausalLM(SubquadraticForCausalLM):
    config_class = SPLAConfig
    base_model_class = SPLAModel
