"""Generation cache shared by every family: one state object per layer plus the positions of the
tokens seen so far.

`SubquadraticCache` is a Transformers `Cache` whose layers are ours: `KVLayer` (softmax attention),
`SPLALayer` (keys, values, running block sums, residual linear state) and `RecurrentLayer`
(fixed-size recurrent states of linear mixers). Every layer keeps its tensors batch-first in a dict,
so beam search and batch selection work the same way for all of them.

Logical positions: with left padding, a row's own token positions differ from its cache slots.
The cache counts each row's real tokens (`seen`), so a new token's logical position is
`seen + (index among the new real tokens)`, and padding gets -1. Mixers use these positions for
RoPE, causal masks, SPLA blocks, and to keep padding out of recurrent states.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache


class StateLayer:
    """Per-layer cache: named tensors whose first dimension is the batch."""

    is_compileable = False
    is_sliding = False
    supports_early_init = False
    record_past = False

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    @property
    def is_initialized(self) -> bool:
        return bool(self.state)

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.state.items()}
        return f"{type(self).__name__}({shapes})"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def _apply(self, fn) -> None:
        self.state = {k: fn(v) for k, v in self.state.items()}

    def reset(self) -> None:
        self.state = {}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} keeps running state and cannot be cropped; "
            "assisted or speculative decoding is not supported by this model"
        )

    def offload(self) -> None:  # states are small or needed every step: keep them in place
        pass

    def prefetch(self) -> None:
        pass


class KVLayer(StateLayer):
    """Keys and values [B, H, S, D] of a softmax-attention layer (full or sliding window)."""

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if "k" in self.state:
            k = torch.cat([self.state["k"], k], dim=2)
            v = torch.cat([self.state["v"], v], dim=2)
        self.state["k"], self.state["v"] = k, v
        return k, v


class RecurrentLayer(StateLayer):
    """Fixed-size recurrent states of a linear mixer (SSE, HLA): memory independent of context."""

    def get(self) -> dict[str, torch.Tensor] | None:
        return dict(self.state) if self.state else None

    def set(self, states: dict[str, torch.Tensor]) -> None:
        self.state = dict(states)


class SubquadraticCache(Cache):
    """Cache of a subquadratic model: one `StateLayer` per decoder layer plus token positions."""

    def __init__(self, layers: list[StateLayer], track_key_positions: bool = True) -> None:
        super().__init__(layers=layers)
        self.track_key_positions = track_key_positions
        self.seen: torch.Tensor | None = None  # [B] real tokens per row
        self.key_positions: torch.Tensor | None = None  # [B, S] logical position of each slot, -1 = pad
        self.length = 0  # slots, padding included (what generate() counts)

    # --- positions ---------------------------------------------------------------------------
    def advance(self, new_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Register T new tokens (new_valid [B, T] bool). Returns (their positions [B, T], key positions [B, S])."""
        if self.seen is None:
            self.seen = torch.zeros(new_valid.shape[0], dtype=torch.long, device=new_valid.device)
        pos = positions_from_mask(new_valid, self.seen)
        self.seen = self.seen + new_valid.sum(-1)
        self.length += new_valid.shape[1]
        if self.track_key_positions:
            kp = pos if self.key_positions is None else torch.cat([self.key_positions, pos], dim=1)
            self.key_positions = kp
        else:
            kp = pos
        return pos, kp

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def nbytes(self) -> int:
        """Bytes held by the layers' states (excluding the position bookkeeping)."""
        return sum(layer.nbytes() for layer in self.layers)

    # --- batch surgery (beam search, contrastive selection) ----------------------------------
    def _apply_meta(self, fn) -> None:
        if self.seen is not None:
            self.seen = fn(self.seen)
        if self.key_positions is not None:
            self.key_positions = fn(self.key_positions)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._apply_meta(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._apply_meta(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._apply_meta(lambda t: t[indices])

    def reset(self) -> None:
        super().reset()
        self.seen, self.key_positions, self.length = None, None, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("subquadratic caches hold running state and cannot be cropped")

    @property
    def is_compileable(self) -> bool:
        return False

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__


def positions_from_mask(valid: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """Logical positions of tokens: running count of real tokens (plus `offset` [B]); -1 at padding."""
    pos = valid.long().cumsum(-1) - 1
    if offset is not None:
        pos = pos + offset[:, None]
    return torch.where(valid, pos, torch.full_like(pos, -1))
