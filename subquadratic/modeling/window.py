"""The in-layer sliding-window softmax branch of the state mixers (SSE's `sse_sliding_window`, HLA's
`hla_sliding_window`): a copy of the source layer's attention (`swa.*`, the source's GQA shapes and
projections) over each query's last W tokens. Its keys and values live in a fixed-size ring of the
mixer's cache layer (`WINDOW_FIELDS`), so the cache stays independent of the context length.

`WindowBranch` is a mixin of a state mixer (an `AttentionBase`): `add_window` builds the branch,
`window_attention` runs it; the mixer decides how the branch joins its own output. `window_copies`
is the conversion's half: the source's attention tensors of a converted layer, copied under `swa.`.
"""

from __future__ import annotations

import torch

from .base import SequenceInfo, SoftmaxAttention

#: The cache layer's tensors of the window branch.
WINDOW_FIELDS = ("swa_k", "swa_v", "swa_pos")


class WindowRing:
    """The window's keys/values as `SoftmaxAttention` sees a KV cache, kept in a cache layer's ring:
    swa_k, swa_v [B, H, W, D] (a token at logical position p sits in slot p % W) and swa_pos [B, W]
    (-1: empty slot).

    One new token (decode) is written into its slot first and attends over the ring alone (the slot it
    overwrites held a token W positions back, outside its window); several new tokens attend over the
    ring followed by themselves, and then the last W of each row are written into the ring (the
    layout `base.banded_window_attention` takes: W ring slots, then the new tokens)."""

    def __init__(self, layer, positions: torch.Tensor, window: int, no_padding: bool = False,
                 consecutive: bool = False) -> None:
        self.layer, self.pos, self.window = layer, positions, window  # positions: [B, T] (-1 = padding)
        self.copy = torch.is_grad_enabled()  # never write in place into tensors autograd may have saved
        #: whether the banded form may read the keys `update` returns (W ring slots, then the new
        #: tokens), i.e. every key a query needs lies among the W slots before it: the new tokens hold
        #: no padding, or the ring is empty (created by this call) and each row's real tokens are known
        #: to sit in consecutive slots (left padding, as a static cache checks at prefill)
        self.banded = no_padding or (consecutive and "swa_k" not in layer.tensors)

    def _ring(self, k: torch.Tensor, v: torch.Tensor):
        t = self.layer.tensors
        if "swa_k" not in t:
            B, H, _, D = k.shape
            t["swa_k"] = k.new_zeros(B, H, self.window, D)
            t["swa_v"] = v.new_zeros(B, H, self.window, D)
            t["swa_pos"] = torch.full((B, self.window), -1, dtype=self.pos.dtype, device=self.pos.device)
        ring = t["swa_k"], t["swa_v"], t["swa_pos"]
        return tuple(x.clone() for x in ring) if self.copy else ring

    def key_positions(self) -> torch.Tensor:
        """[B, S] positions of the keys `update` returns, in their order."""
        ring_pos = self.layer.tensors.get("swa_pos")
        if ring_pos is None:
            ring_pos = torch.full((self.pos.shape[0], self.window), -1, dtype=self.pos.dtype, device=self.pos.device)
        if self.pos.shape[1] == 1:
            slot = self.pos.clamp(min=0) % self.window  # [B, 1]
            return ring_pos.scatter(1, slot, torch.where(self.pos >= 0, self.pos, ring_pos.gather(1, slot)))
        return torch.cat([ring_pos, self.pos], dim=1)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, H, T, D] (post-RoPE) -> the keys/values to attend over, [B, H, S, D]."""
        ring_k, ring_v, ring_pos = self._ring(k, v)
        B, H, T, D = k.shape
        W, pos = self.window, self.pos
        if T == 1:
            rows, slot, real = torch.arange(B, device=k.device), pos[:, 0].clamp(min=0) % W, pos[:, 0] >= 0
            ring_k[rows, :, slot] = torch.where(real[:, None, None], k[:, :, 0], ring_k[rows, :, slot])
            ring_v[rows, :, slot] = torch.where(real[:, None, None], v[:, :, 0], ring_v[rows, :, slot])
            ring_pos[rows, slot] = torch.where(real, pos[:, 0], ring_pos[rows, slot])
            keys, values = ring_k, ring_v
        else:
            keys, values = torch.cat([ring_k, k], dim=2), torch.cat([ring_v, v], dim=2)
            # each slot takes the row's newest token that maps to it among the row's last W real tokens
            last = pos.max(dim=1, keepdim=True).values  # [B, 1]
            keep = (pos >= 0) & (pos > last - W)  # [B, T]; at most one kept token per slot
            index = torch.arange(T, device=pos.device).expand(B, T)
            src = torch.full((B, W), -1, dtype=torch.long, device=pos.device).scatter_reduce(
                1, pos.clamp(min=0) % W, torch.where(keep, index, -1), reduce="amax"
            )  # [B, W]: the new token each slot takes, -1 for none
            has, src = src >= 0, src.clamp(min=0)
            gather = src[:, None, :, None].expand(B, H, W, D)
            ring_k = torch.where(has[:, None, :, None], k.gather(2, gather), ring_k)
            ring_v = torch.where(has[:, None, :, None], v.gather(2, gather), ring_v)
            ring_pos = torch.where(has, pos.gather(1, src), ring_pos)
        self.layer.tensors.update(swa_k=ring_k, swa_v=ring_v, swa_pos=ring_pos)
        return keys, values


class WindowBranch:
    """Mixin of a state mixer with an optional sliding-window softmax branch (`self.swa`)."""

    def add_window(self, config, layer_idx: int, window: int | None) -> None:
        """The branch over the last `window` tokens (none for 0 / None): `self.window`, `self.swa`."""
        self.window = window or 0
        if self.window:
            self.swa = SoftmaxAttention(config, layer_idx)
            self.swa.window = self.window

    def window_attention(self, x: torch.Tensor, position_embeddings, seq: SequenceInfo, cache_layer) -> torch.Tensor:
        """Softmax attention over the last `self.window` tokens, through the shared `SoftmaxAttention`,
        with the window's keys/values in the cache layer's ring (`WindowRing`)."""
        if cache_layer is None:
            window_seq = SequenceInfo(seq.positions, seq.valid, seq.positions, causal=seq.causal)
            return self.swa(x, position_embeddings, window_seq, None)[0]
        ring = WindowRing(cache_layer, seq.positions, self.window, no_padding=seq.causal, consecutive=seq.consecutive)
        out, _ = self.swa(x, position_embeddings, SequenceInfo(seq.positions, seq.valid, ring.key_positions()), ring)
        return out


def window_copies(prefix: str, rest: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A converted layer's source attention tensor `prefix + rest` (e.g. rest "q_proj.weight"), copied
    as the window branch's `prefix + "swa." + rest`."""
    return [(prefix + "swa." + rest, t.clone())]
