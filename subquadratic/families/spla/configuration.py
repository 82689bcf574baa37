"""Configuration of SPLA (block-sparse attention plus residual linear attention)."""

from __future__ import annotations

from ...configuration.base import SubquadraticConfig


class SPLAConfig(SubquadraticConfig):
    """SPLA: exact softmax attention on the KV blocks a second-order Taylor score selects, plus a
    residual linear-attention term for everything else (see docs/design.md "SPLA").

    Selection budget per query: `top_k_blocks` blocks of `block_size` keys, of which the first
    `num_sink_blocks` and the `num_local_blocks` most recent (the current partial block included)
    are always taken. `selection` is "taylor" (second order) or "mean" (first order, for ablations).
    `use_rla=False` turns the residual linear term off (the SPA ablation).
    """

    model_type = "spla"
    default_mixer = "spla"

    block_size: int = 64
    top_k_blocks: int = 16
    num_sink_blocks: int = 1
    num_local_blocks: int = 2
    selection: str = "taylor"
    use_rla: bool = True

    def check(self) -> None:
        super().check()
        b = self.block_size
        if b < 1 or b & (b - 1):
            raise ValueError(f"block_size must be a power of two, got {b}")
        if self.num_sink_blocks < 0 or self.num_local_blocks < 1:
            raise ValueError("num_sink_blocks must be >= 0 and num_local_blocks >= 1")
        if self.top_k_blocks < self.num_sink_blocks + self.num_local_blocks:
            raise ValueError(
                f"top_k_blocks ({self.top_k_blocks}) is smaller than sink + local blocks "
                f"({self.num_sink_blocks} + {self.num_local_blocks}); raise top_k_blocks"
            )
        if self.selection not in ("taylor", "mean"):
            raise ValueError(f"selection must be 'taylor' or 'mean', got {self.selection!r}")

    @property
    def budget_tokens(self) -> int:
        """Keys one query attends to exactly, at most."""
        return self.top_k_blocks * self.block_size
