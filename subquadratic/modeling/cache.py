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

Static caches (`max_length` given): every buffer is allocated once for `max_length` tokens and
written at slots held on the device (`StaticSlots`), fixed-size states are updated in place, and a
one-token step hands out whole buffers (unused slots have position -1), so the step has fixed
shapes, no host synchronisation and stable addresses: what a CUDA graph needs (`cuda_graph.py`).

Logical positions: with left padding, a row's own token positions differ from its cache slots.
The cache counts each row's real tokens (`seen`), so a new token's logical position is
`seen + (index among the new real tokens)`, and padding gets -1. Mixers use these positions for
RoPE, causal masks, SPLA blocks, and to keep padding out of recurrent states.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from ..kernels.utils import slot_offsets

#: Allocation granule of the growing buffers, in entries along the growing dimension (token slots
#: for keys, values and positions).
CHUNK = 256


class StaticSlots:
    """What a static cache shares with its layers: the allocation size (`max_length` token slots),
    the slots the current call writes (`index`, [T] long on the device, derived from a device
    counter so a replayed step writes the next slot) and whether the call hands out whole buffers
    (`whole`: one-token steps, fixed shapes) or views of the used part (longer calls: prefill)."""

    def __init__(self, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be at least 1, got {max_length}")
        self.max_length = max_length
        self.index: torch.Tensor | None = None
        self.whole = False
        #: allocations of the sequence before a `SubquadraticCache.rewind`, by (shape, dtype, device), in
        #: the order they were made: the next sequence takes them back in that order (`take`), so every
        #: tensor returns to its address and a captured decode step stays valid
        self.spare: dict[tuple, list[torch.Tensor]] = {}

    def give(self, t: torch.Tensor) -> None:
        self.spare.setdefault((tuple(t.shape), t.dtype, t.device), []).append(t)

    def take(self, shape, dtype: torch.dtype, device: torch.device, fill: float | None = None) -> torch.Tensor | None:
        """A spare allocation of this shape, dtype and device (filled with `fill` unless None), or None."""
        free = self.spare.get((tuple(shape), dtype, torch.device(device)))
        if not free:
            return None
        t = free.pop(0)
        return t if fill is None else t.fill_(fill)

    def allocate(self, shape, dtype: torch.dtype, device: torch.device, fill: float = 0) -> torch.Tensor:
        """A tensor of `shape` filled with `fill`: a spare allocation where one fits, else a new one."""
        t = self.take(shape, dtype, device, fill)
        return torch.full(tuple(shape), fill, dtype=dtype, device=device) if t is None else t


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

    Static (`static` given, a `StaticSlots`): allocated once for `static.max_length` token slots
    (`fill` in the entries not yet written), `append` writes at `static.index`, and `append` /
    `extend` return the whole allocation during one-token steps (`static.whole`). `apply` writes
    same-shape results back in place, so the addresses never change.
    """

    def __init__(self, dim: int, slots_per_entry: int = 1, fill: float = 0, static: StaticSlots | None = None) -> None:
        self.dim = dim
        self.slots_per_entry = slots_per_entry
        self.chunk = -(-CHUNK // slots_per_entry)  # entries per chunk (SPLA block sums: one per block)
        self.fill = fill
        self.static = static
        self.data: torch.Tensor | None = None
        self.length = 0

    def __repr__(self) -> str:
        shape = None if self.data is None else tuple(self.data.shape)
        return f"GrowingBuffer(dim={self.dim}, length={self.length}, allocated={shape})"

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[self.dim]

    def capacity_for(self, needed: int) -> int:
        if self.static is not None:
            cap = -(-self.static.max_length // self.slots_per_entry)
            if needed > cap:
                raise ValueError(f"the static cache holds {self.static.max_length} tokens and this call needs more; "
                                 "build it with a larger max_length")
            return cap
        return (needed + needed // 4) // self.chunk * self.chunk + self.chunk

    def view(self) -> torch.Tensor:
        return self.data.narrow(self.dim, 0, self.length)

    def _out(self) -> torch.Tensor:
        """What append / extend return: the used part, or the whole allocation in a static one-token step."""
        return self.data if self.static is not None and self.static.whole else self.view()

    def _grow(self, needed: int, like: torch.Tensor) -> None:
        """Reallocate (like's dtype, device and other dimensions) when `needed` entries do not fit."""
        if needed <= self.capacity:
            return
        shape = list(like.shape)
        shape[self.dim] = self.capacity_for(needed)
        if self.static is not None:  # allocated once, or taken back after a rewind
            new = self.static.allocate(shape, like.dtype, like.device, self.fill)
        else:
            new = like.new_full(shape, self.fill)
        if self.length:
            new.narrow(self.dim, 0, self.length).copy_(self.view())
        self.data = new

    def claim(self, x: torch.Tensor) -> torch.Tensor:
        """Static: count x's entries as used without writing them (the caller writes them at
        `static.index`); returns what `append` returns."""
        self._grow(self.length + x.shape[self.dim], x)
        self.length += x.shape[self.dim]
        return self._out()

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Write x after the used entries; returns the view of all of them, x included."""
        n = x.shape[self.dim]
        if self.static is not None:
            out = self.claim(x)
            self.data.index_copy_(self.dim, self.static.index, x)
            return out
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
        return self._out()

    def apply(self, fn) -> None:
        """Replace the allocation by fn(allocation) (a batch op: index_select, repeat_interleave, ...);
        static: written back in place when the shape is kept."""
        if self.data is not None:
            self.data = _write_back(self.data, fn(self.data), self.static is not None)

    def nbytes(self, allocated: bool = False) -> int:
        if self.data is None:
            return 0
        t = self.data if allocated else self.view()
        return t.numel() * t.element_size()


def _write_back(old: torch.Tensor, new: torch.Tensor, in_place: bool) -> torch.Tensor:
    """new, or (in_place, same shape and dtype) old with new's values copied in: the static cache's rule."""
    if in_place and new is not old and new.shape == old.shape and new.dtype == old.dtype:
        return old.copy_(new)
    return new


class StateDict(dict):
    """A layer's fixed-size tensors. In a static cache (`static` given), a new value for an existing
    entry of the same shape is copied into it, so the entry keeps its address (a CUDA graph replays on
    it); a new entry is copied into a spare allocation of the cache where one fits (`StaticSlots.take`:
    the one it had before a rewind)."""

    def __init__(self, *args, static: StaticSlots | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.static = static

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        old = self.get(name)
        if old is None and self.static is not None:
            old = self.static.take(value.shape, value.dtype, value.device)
        super().__setitem__(name, value if old is None else _write_back(old, value, self.static is not None))

    def update(self, *args, **kw) -> None:
        for name, value in dict(*args, **kw).items():
            self[name] = value


class StateLayer:
    """Per-layer cache: named tensors whose first dimension is the batch. Fixed-size tensors, replaced
    as a whole, are in `tensors`; growing ones in `buffers` (`GrowingBuffer`). `state` shows both,
    growing ones as views of their used part. In a static cache (`static` set by the cache), buffers
    are allocated for its `max_length` and fixed-size tensors are updated in place (`StateDict`):
    assigning `layer.tensors = {...}` or `layer.tensors[name] = t` copies into existing entries."""

    is_compileable = False
    is_sliding = False
    supports_early_init = False
    record_past = False
    #: whether the layer may keep work pending in Python between calls (SPLA's deferred block sums and
    #: Sbar inside its budget): a layer rebuilt from its tensors at every call (vLLM's slots, the
    #: plugin's layout probe) is made with False, so that each call leaves its tensors complete
    defer_updates = True

    def __init__(self) -> None:
        self.static: StaticSlots | None = None
        self._tensors = StateDict()
        self.buffers: dict[str, GrowingBuffer] = {}

    @property
    def tensors(self) -> StateDict:
        return self._tensors

    @tensors.setter
    def tensors(self, value: dict[str, torch.Tensor]) -> None:
        if self.static is None:
            self._tensors = StateDict(value)
            return
        if not self._tensors:
            self._tensors = StateDict(static=self.static)
        for name in [n for n in self._tensors if n not in value]:
            del self._tensors[name]
        self._tensors.update(value)

    def new_buffer(self, dim: int, slots_per_entry: int = 1) -> GrowingBuffer:
        """A growing buffer of this layer (static when the cache is)."""
        return GrowingBuffer(dim, slots_per_entry, static=self.static)

    @property
    def whole(self) -> bool:
        """Whether this call's buffers are handed out whole (a static one-token step): the new tokens
        then sit at their slots, not last."""
        return self.static is not None and self.static.whole

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
        self._tensors = StateDict(static=self.static)
        self.buffers = {}

    def allocations(self) -> list[torch.Tensor]:
        """Every tensor the layer holds (fixed-size ones, then the buffers' allocations)."""
        return [*self.tensors.values(), *(b.data for b in self.buffers.values() if b.data is not None)]

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
            self.buffers = {"k": self.new_buffer(2), "v": self.new_buffer(2)}
        return self.buffers["k"].append(k), self.buffers["v"].append(v)


class RecurrentLayer(StateLayer):
    """Fixed-size states of a linear mixer, memory independent of the context: a subclass beside its
    mixer names its tensors in `fields` and reads / writes them as the mixer's state type."""

    fields: tuple[str, ...] = ()


class SubquadraticCache(Cache):
    """Cache of a subquadratic model: one `StateLayer` per decoder layer plus token positions.

    With `max_length`, a static cache (see the module docstring): sized once, positions and the
    write slot kept on the device. On CUDA, with `cuda_graph` (the default), the model replays its
    one-token steps on it as one CUDA graph (`cuda_graph.DecodeGraph`, captured at the first
    one-token step), with its elementwise chains fused by torch.compile where `fuse` (the default;
    `fused.py`). A static cache takes left padding only (what generate() makes): every row's real
    tokens must sit in consecutive slots, and one-token steps must be real tokens."""

    def __init__(self, layers: list[StateLayer], track_key_positions: bool = True, max_length: int | None = None,
                 cuda_graph: bool = True, fuse: bool = True) -> None:
        super().__init__(layers=layers)
        self.track_key_positions = track_key_positions
        self.static = StaticSlots(max_length) if max_length is not None else None
        for layer in layers:
            layer.static = self.static
            layer.reset()
        self.cuda_graph = cuda_graph
        self.fuse = fuse
        self.decode_graph = None  # cuda_graph.DecodeGraph, once captured
        #: a step that cannot be captured runs eagerly (with a warning) instead of raising: the cache
        #: generate() builds by default (`base.generation_cache`)
        self.eager_fallback = False
        self._reset_positions()

    def _reset_positions(self) -> None:
        self.seen: torch.Tensor | None = None  # [B] real tokens per row
        # [B, S] logical position of each slot, -1 = padding (and, static, not yet written)
        self._key_positions = GrowingBuffer(dim=1, fill=-1, static=self.static)
        self.slot: torch.Tensor | None = None  # static: next slot to write, a device scalar
        self.length = 0  # slots, padding included (what generate() counts)
        # every slot so far a real token in a growing cache, where known without a host sync (`all_real`)
        self.all_real = self.static is None
        # a static cache: every slot so far a real token (its calls of several tokens checked once each;
        # one-token steps are real by the rule above)
        self.static_real = self.static is not None

    @property
    def causal_call(self) -> bool:
        """Whether the keys of the last `advance` call are real tokens in position order with the new
        tokens last (`SequenceInfo.causal`): every call of a growing cache whose tokens are all real
        (`all_real`), and a static cache's call of several tokens when they and every slot before them
        are real (its keys are then the used slots, as a growing cache's: the first call's the new tokens
        alone, a chunked prefill's later chunks the slots before them too), so that the mixers may take
        their causal forms: SDPA with is_causal or the lower-right causal bias, the window kernels, a
        window ring filled by slicing. A static one-token step returns the whole allocation: never."""
        return self.all_real or self.static_real and not self.static.whole

    @property
    def max_length(self) -> int | None:
        """Tokens a static cache holds (None: a growing cache)."""
        return None if self.static is None else self.static.max_length

    @property
    def key_positions(self) -> torch.Tensor | None:
        """[B, S] logical position of each slot (-1 = padding); None before the first tokens or when
        no layer needs them."""
        return self._key_positions.view() if self._key_positions.data is not None else None

    # --- positions ---------------------------------------------------------------------------
    def has_room(self, T: int) -> bool:
        """Whether T more tokens fit (always in a growing cache; a static one holds `max_length`)."""
        return self.static is None or self.length + T <= self.static.max_length

    def advance(self, new_valid: torch.Tensor, known_real: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Register T new tokens (new_valid [B, T] bool; `known_real`: the caller knows them all real,
        e.g. no attention mask was given). Returns (their positions [B, T], key positions [B, S]).
        Static: no host synchronisation in one-token steps (the slot and counts are updated in place
        on the device); a longer call checks once that every row's tokens are consecutive (and, while
        every slot before it is real, whether its tokens are all real: `causal_call`). Growing:
        whether every token so far is real (`all_real`) is read with one host synchronisation for a
        call of several tokens, never for one-token steps."""
        T = new_valid.shape[1]
        if self.seen is None:
            B, dev = new_valid.shape[0], new_valid.device
            self.seen = (torch.zeros(B, dtype=torch.long, device=dev) if self.static is None
                         else self.static.allocate((B,), torch.long, dev))
        pos = positions_from_mask(new_valid, self.seen)
        if self.static is None:
            self.all_real = self.all_real and (known_real or all_real(new_valid, sync=T > 1))
            self.seen = self.seen + new_valid.sum(-1)
            self.length += T
            kp = self._key_positions.append(pos) if self.track_key_positions else pos
            return pos, kp
        if not self.has_room(T):
            raise ValueError(f"the static cache holds {self.static.max_length} tokens; {self.length} are cached and "
                             f"{T} more were given: build it with a larger max_length")
        self.static_real = self.static_real and (T == 1 or known_real or all_real(new_valid, sync=True))
        if self.slot is None:
            self.slot = self.static.allocate((), torch.long, new_valid.device)
        self.static.index = self.slot + torch.arange(T, device=new_valid.device)
        self.static.whole = T == 1
        self.seen.add_(new_valid.sum(-1))
        self.slot.add_(T)
        self.length += T
        kp = self._key_positions.append(pos) if self.track_key_positions else pos
        if T > 1 and self.track_key_positions and slot_offsets(self._key_positions.view()) is None:
            raise ValueError("a static cache takes left padding only: a row has padding after its first token")
        return pos, kp

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def nbytes(self, allocated: bool = False) -> int:
        """Bytes of the layers' states in use (excluding the position bookkeeping): keys and values
        count for the tokens cached so far, so recurrent layers give a size independent of the
        context and softmax/SPLA layers one proportional to it. With `allocated`, the bytes of the
        allocations, spare room of the growing buffers included."""
        return sum(layer.nbytes(allocated) for layer in self.layers)

    # --- the captured decode step (cuda_graph.DecodeGraph) ------------------------------------
    def _buffers(self) -> list[GrowingBuffer]:
        return [self._key_positions] + [b for layer in self.layers for b in layer.buffers.values()]

    def host_counters(self) -> list[int]:
        """The host-side counts a step advances (slots, used entries of each buffer): a replayed step
        runs no Python, so the graph runner advances them by what one captured step did."""
        return [self.length] + [b.length for b in self._buffers()]

    def set_host_counters(self, counts: list[int]) -> None:
        self.length = counts[0]
        for b, n in zip(self._buffers(), counts[1:], strict=True):
            b.length = n

    # --- batch surgery (beam search, contrastive selection) ----------------------------------
    def _apply_meta(self, fn) -> None:
        if self.seen is not None:
            self.seen = _write_back(self.seen, fn(self.seen), self.static is not None)
        self._key_positions.apply(fn)
        if self.decode_graph is not None and not self.decode_graph.still_valid():
            self.decode_graph = None  # the batch changed size: buffers were reallocated

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
        self.decode_graph = None
        self._reset_positions()

    def allocations(self) -> list[torch.Tensor | None]:
        """Every tensor the cache holds, in the order a sequence allocates them (None: not yet made):
        the counts, the key positions, then each layer's (`StateLayer.allocations`)."""
        return [self.seen, self.slot, self._key_positions.data,
                *(t for layer in self.layers for t in layer.allocations())]

    def rewind(self) -> None:
        """Empty the cache for a new sequence. A growing cache is reset; a static one keeps its
        allocations and its captured decode step: the next sequence writes into the same tensors
        (taken back in the order they were made, refilled with their initial values), so the step
        replays without a new capture unless an address changed (then it is captured again:
        `cuda_graph.decode_step`). What generate() does with the static cache it keeps between calls."""
        if self.static is None:
            self.reset()
            return
        self.static.spare = {}
        for t in self.allocations():
            if t is not None:
                self.static.give(t)
        graph = self.decode_graph
        for layer in self.layers:
            layer.reset()
        self._reset_positions()
        self.static.index, self.static.whole = None, False
        self.decode_graph = graph
        if graph is not None:
            graph.stale = True  # checked against the new addresses at the next one-token step

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("subquadratic caches hold running state and cannot be cropped")

    @property
    def is_compileable(self) -> bool:
        return False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "decode_graph": None}  # a copy captures its own graph


def all_real(valid: torch.Tensor | None, sync: bool = False) -> bool:
    """Whether a padding mask (True / 1 = real token) marks every token real, where that is known: no
    mask, or a mask on the CPU, outside compilation and export; with `sync` also a mask on an
    accelerator, read with one host synchronisation (for calls of several tokens, where it costs
    little beside the call and lets the mixers take their causal forms: SDPA with is_causal, the banded
    window; never during CUDA-graph capture). False otherwise (unknown)."""
    if valid is None:
        return True
    if torch.compiler.is_compiling():
        return False
    if valid.device.type != "cpu" and (not sync or (valid.is_cuda and torch.cuda.is_current_stream_capturing())):
        return False
    return bool(valid.all())


def positions_from_mask(valid: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """Logical positions of tokens: running count of real tokens (plus `offset` [B]); -1 at padding."""
    pos = valid.long().cumsum(-1) - 1
    if offset is not None:
        pos = pos + offset[:, None]
    return torch.where(valid, pos, torch.full_like(pos, -1))
