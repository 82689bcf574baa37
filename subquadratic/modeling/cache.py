"""Generation cache shared by every family: one state object per layer plus the positions of the
tokens seen so far.

`SubquadraticCache` is a Transformers `Cache` whose layers are ours: each mixer names its layer type
(`cache_layer_cls`), a `StateLayer` subclass that lives beside the mixer. Here: the base classes,
`KVLayer` (softmax attention) and `RecurrentLayer` (fixed-size states of linear mixers, whose
subclasses name their tensors). Every layer keeps its tensors batch-first, so beam search and batch
selection work the same way for all of them.

Growing states (keys, values, running block sums, the key positions) live in `GrowingBuffer`s:
preallocated with spare room and written in place, so a decode step costs O(new tokens) instead of
a copy of the whole cache. Layers hand out views of the used part (`layer.state["k"]`).

Logical positions: with left padding, a row's own token positions differ from its cache slots.
The cache counts each row's real tokens (`seen`), so a new token's logical position is
`seen + (index among the new real tokens)`, and padding gets -1. Mixers use these positions for
RoPE, causal masks, SPLA blocks, and to keep padding out of recurrent states.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

#: Allocation granule of the growing buffers, in entries along the growing dimension (token slots
#: for keys, values and positions).
CHUNK = 256


class GrowingBuffer:
    """A batch-first tensor that grows along dimension `dim` into preallocated spare room.

    `data` is the allocation (zero-initialised), `length` the entries in use along `dim`; `view()` is
    `data` narrowed to them (a view, not a copy). `append(x)` writes x in place after the used part;
    `extend(n)` makes the used part n long, the new entries being zeros (running sums start there).
    When the room runs out, the buffer is reallocated to `capacity_for(needed)` entries, a quarter
    more than needed rounded up to whole chunks of `CHUNK` token slots, and the used part is copied
    once: appending T entries costs amortised O(T), and a fifth of the allocation (plus up to one
    chunk) is spare after a reallocation.

    Autograd: when grad is enabled and the new entries require grad (a training forward that keeps a
    cache), `append` builds a new tensor instead of writing in place, so tensors saved for backward
    by earlier steps are never overwritten.
    """

    def __init__(self, dim: int, slots_per_entry: int = 1) -> None:
        self.dim = dim
        self.chunk = -(-CHUNK // slots_per_entry)  # entries per chunk (SPLA block sums: one per block)
        self.data: torch.Tensor | None = None
        self.length = 0

    def __repr__(self) -> str:
        shape = None if self.data is None else tuple(self.data.shape)
        return f"GrowingBuffer(dim={self.dim}, length={self.length}, allocated={shape})"

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[self.dim]

    def capacity_for(self, needed: int) -> int:
        return (needed + needed // 4) // self.chunk * self.chunk + self.chunk

    def view(self) -> torch.Tensor:
        return self.data.narrow(self.dim, 0, self.length)

    def _grow(self, needed: int, like: torch.Tensor) -> None:
        """Reallocate (like's dtype, device and other dimensions) when `needed` entries do not fit."""
        if needed <= self.capacity:
            return
        shape = list(like.shape)
        shape[self.dim] = self.capacity_for(needed)
        new = like.new_zeros(shape)
        if self.length:
            new.narrow(self.dim, 0, self.length).copy_(self.view())
        self.data = new

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Write x after the used entries; returns the view of all of them, x included."""
        n = x.shape[self.dim]
        if self.data is not None and torch.is_grad_enabled() and (x.requires_grad or self.data.requires_grad):
            spare = list(x.shape)
            spare[self.dim] = max(0, self.capacity - self.length - n)
            self.data = torch.cat([self.view(), x, x.new_zeros(spare)], dim=self.dim)
        else:
            self._grow(self.length + n, x)
            self.data.narrow(self.dim, self.length, n).copy_(x)
        self.length += n
        return self.view()

    def extend(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """Make the used part at least n long with zero entries (shape/dtype/device of `like`)."""
        self._grow(n, like)
        self.length = max(self.length, n)
        return self.view()

    def apply(self, fn) -> None:
        """Replace the allocation by fn(allocation) (a batch op: index_select, repeat_interleave, ...)."""
        if self.data is not None:
            self.data = fn(self.data)

    def nbytes(self, allocated: bool = False) -> int:
        if self.data is None:
            return 0
        t = self.data if allocated else self.view()
        return t.numel() * t.element_size()


class StateLayer:
    """Per-layer cache: named tensors whose first dimension is the batch. Fixed-size tensors, replaced
    as a whole, are in `tensors`; growing ones in `buffers` (`GrowingBuffer`). `state` shows both,
    growing ones as views of their used part."""

    is_compileable = False
    is_sliding = False
    supports_early_init = False
    record_past = False

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, GrowingBuffer] = {}

    @property
    def state(self) -> dict[str, torch.Tensor]:
        views = {k: b.view() for k, b in self.buffers.items() if b.data is not None}
        return {**self.tensors, **views}

    @property
    def is_initialized(self) -> bool:
        return bool(self.tensors) or any(b.data is not None for b in self.buffers.values())

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.state.items()}
        return f"{type(self).__name__}({shapes})"

    def nbytes(self, allocated: bool = False) -> int:
        """Bytes of the state in use; with `allocated`, of the allocations (spare room included)."""
        fixed = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return fixed + sum(b.nbytes(allocated) for b in self.buffers.values())

    def _apply(self, fn) -> None:
        self.tensors = {k: fn(v) for k, v in self.tensors.items()}
        for b in self.buffers.values():
            b.apply(fn)

    def reset(self) -> None:
        self.tensors = {}
        self.buffers = {}

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
    """Keys and values [B, H, S, D] of a softmax-attention layer (full or sliding window), in
    preallocated buffers growing along S."""

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new keys/values [B, H, T, D]; returns views of all of them [B, H, S, D]."""
        if not self.buffers:
            self.buffers = {"k": GrowingBuffer(dim=2), "v": GrowingBuffer(dim=2)}
        return self.buffers["k"].append(k), self.buffers["v"].append(v)


class RecurrentLayer(StateLayer):
    """Fixed-size states of a linear mixer, memory independent of the context: a subclass beside its
    mixer names its tensors in `fields` and reads / writes them as the mixer's state type."""

    fields: tuple[str, ...] = ()


class SubquadraticCache(Cache):
    """Cache of a subquadratic model: one `StateLayer` per decoder layer plus token positions."""

    def __init__(self, layers: list[StateLayer], track_key_positions: bool = True) -> None:
        super().__init__(layers=layers)
        self.track_key_positions = track_key_positions
        self.seen: torch.Tensor | None = None  # [B] real tokens per row
        self._key_positions = GrowingBuffer(dim=1)  # [B, S] logical position of each slot, -1 = pad
        self.length = 0  # slots, padding included (what generate() counts)

    @property
    def key_positions(self) -> torch.Tensor | None:
        """[B, S] logical position of each slot (-1 = padding); None before the first tokens or when
        no layer needs them."""
        return self._key_positions.view() if self._key_positions.data is not None else None

    # --- positions ---------------------------------------------------------------------------
    def advance(self, new_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Register T new tokens (new_valid [B, T] bool). Returns (their positions [B, T], key positions [B, S])."""
        if self.seen is None:
            self.seen = torch.zeros(new_valid.shape[0], dtype=torch.long, device=new_valid.device)
        pos = positions_from_mask(new_valid, self.seen)
        self.seen = self.seen + new_valid.sum(-1)
        self.length += new_valid.shape[1]
        kp = self._key_positions.append(pos) if self.track_key_positions else pos
        return pos, kp

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def nbytes(self, allocated: bool = False) -> int:
        """Bytes of the layers' states in use (excluding the position bookkeeping): keys and values
        count for the tokens cached so far, so recurrent layers give a size independent of the
        context and softmax/SPLA layers one proportional to it. With `allocated`, the bytes of the
        allocations, spare room of the growing buffers included."""
        return sum(layer.nbytes(allocated) for layer in self.layers)

    # --- batch surgery (beam search, contrastive selection) ----------------------------------
    def _apply_meta(self, fn) -> None:
        if self.seen is not None:
            self.seen = fn(self.seen)
        self._key_positions.apply(fn)

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
        self.seen, self.length = None, 0
        self._key_positions = GrowingBuffer(dim=1)

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
