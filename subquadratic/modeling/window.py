"""The in-layer sliding-window softmax branch of the state mixers (SSE's `sse_sliding_window`, HLA's
`hla_sliding_window`): a copy of the source layer's attention (`swa.*`, the source's GQA shapes and
projections) over each query's last W tokens. Its keys and values live in a fixed-size ring of the
mixer's cache layer (`WINDOW_FIELDS`), so the cache stays independent of the context length.

`WindowBranch` is a mixin of a state mixer (an `AttentionBase`): `add_window` builds the branch,
`window_attention` runs it; the mixer decides how the branch joins its own output. `window_copies`
is the conversion's half: the source's attention tensors of a converted layer, copied under `swa.`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.utils import fused_backend, fused_kernel, resolve_backend
from ..kernels.window_attention import (
    fresh_ring,
    fresh_ring_shapes_unsupported,
    window_step,
    window_step_shapes_unsupported,
)
from .base import SequenceInfo, SoftmaxAttention, operand_dtype
from .fused import FusedPlan, forward_plan

#: The cache layer's tensors of the window branch.
WINDOW_FIELDS = ("swa_k", "swa_v", "swa_pos", "swa_sink_k", "swa_sink_v", "swa_sink_pos")


class WindowRing:
    """The window's keys/values as `SoftmaxAttention` sees a KV cache, kept in a cache layer's ring:
    swa_k, swa_v [B, H, W, D] (a token at logical position p sits in slot p % W) and swa_pos [B, W]
    (-1: empty slot); with `sinks` > 0 also the first `sinks` tokens of each row (the attention
    sinks), kept for good in swa_sink_k, swa_sink_v [B, H, sinks, D] and swa_sink_pos [B, sinks].

    The keys `update` returns: the sink slots (copies of tokens 0..sinks-1, which a query sees only
    once they are W or more positions back: `sink_slots`), then for one new token (decode) the ring
    after it is written into its slot (the slot it overwrites held a token W positions back, outside
    its window), for several the ring followed by themselves, after which the last W of each row are
    written into the ring (the layout `base.banded_window_attention` takes)."""

    def __init__(self, layer, positions: torch.Tensor, window: int, no_padding: bool = False,
                 consecutive: bool = False, sinks: int = 0) -> None:
        self.layer, self.pos, self.window = layer, positions, window  # positions: [B, T] (-1 = padding)
        self.sink_slots = sinks
        self.copy = torch.is_grad_enabled()  # never write in place into tensors autograd may have saved
        #: whether the banded form may read the keys `update` returns (W ring slots, then the new
        #: tokens), i.e. every key a query needs lies among the W slots before it: the new tokens hold
        #: no padding, or the ring is empty (created by this call) and each row's real tokens are known
        #: to sit in consecutive slots (left padding, as a static cache checks at prefill)
        self.banded = no_padding or (consecutive and "swa_k" not in layer.tensors)

    def _tensors(self, k: torch.Tensor, v: torch.Tensor, prefix: str, size: int):
        t = self.layer.tensors
        if prefix + "k" not in t:
            B, H, _, D = k.shape
            t[prefix + "k"] = k.new_zeros(B, H, size, D)
            t[prefix + "v"] = v.new_zeros(B, H, size, D)
            t[prefix + "pos"] = self._empty_pos(size)
        ring = t[prefix + "k"], t[prefix + "v"], t[prefix + "pos"]
        return tuple(x.clone() for x in ring) if self.copy else ring

    def _empty_pos(self, size: int) -> torch.Tensor:
        return torch.full((self.pos.shape[0], size), -1, dtype=self.pos.dtype, device=self.pos.device)

    def _sources(self, slots: int, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For each of `slots` slots (position p -> slot p % slots), the new token it takes among the
        `keep` ones (the newest: at most one kept token per slot): (has [B, slots], index [B, slots])."""
        B, T = self.pos.shape
        index = torch.arange(T, device=self.pos.device).expand(B, T)
        src = torch.full((B, slots), -1, dtype=torch.long, device=self.pos.device).scatter_reduce(
            1, self.pos.clamp(min=0) % slots, torch.where(keep, index, -1), reduce="amax")
        return src >= 0, src.clamp(min=0)

    def _sink_keep(self) -> torch.Tensor:
        return (self.pos >= 0) & (self.pos < self.sink_slots)

    def key_positions(self) -> torch.Tensor:
        """[B, S] positions of the keys `update` returns, in their order."""
        W = self.window
        ring_pos = self.layer.tensors.get("swa_pos")
        ring_pos = self._empty_pos(W) if ring_pos is None else ring_pos
        if self.pos.shape[1] == 1:
            slot = self.pos.clamp(min=0) % W  # [B, 1]
            keys = ring_pos.scatter(1, slot, torch.where(self.pos >= 0, self.pos, ring_pos.gather(1, slot)))
        else:
            keys = torch.cat([ring_pos, self.pos], dim=1)
        if not self.sink_slots:
            return keys
        sink_pos = self.layer.tensors.get("swa_sink_pos")
        sink_pos = self._empty_pos(self.sink_slots) if sink_pos is None else sink_pos
        has, src = self._sources(self.sink_slots, self._sink_keep())
        return torch.cat([torch.where(has, self.pos.gather(1, src), sink_pos), keys], dim=1)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, H, T, D] (post-RoPE) -> the keys/values to attend over, [B, H, S, D]."""
        ring = self._tensors(k, v, "swa_", self.window)
        pos = self.pos
        if k.shape[2] == 1:
            ring = self._write(k, v, ring, pos >= 0)
            keys, values = ring[0], ring[1]
        else:
            keys, values = torch.cat([ring[0], k], dim=2), torch.cat([ring[1], v], dim=2)
            # each slot takes the row's newest token that maps to it among the row's last W real tokens
            last = pos.max(dim=1, keepdim=True).values  # [B, 1]
            ring = self._write(k, v, ring, (pos >= 0) & (pos > last - self.window))
        self.layer.tensors.update(swa_k=ring[0], swa_v=ring[1], swa_pos=ring[2])
        if self.sink_slots:
            sinks = self._write(k, v, self._tensors(k, v, "swa_sink_", self.sink_slots), self._sink_keep())
            self.layer.tensors.update(swa_sink_k=sinks[0], swa_sink_v=sinks[1], swa_sink_pos=sinks[2])
            keys, values = torch.cat([sinks[0], keys], dim=2), torch.cat([sinks[1], values], dim=2)
        return keys, values

    def _write(self, k, v, buffers, keep):
        """The buffers (k [B, H, n, D], v, pos [B, n]) with the `keep` new tokens written into slot p % n.
        One new token (decode) is written in place, so that a captured decode step keeps writing into
        the tensors the cache holds; several give new tensors."""
        buf_k, buf_v, buf_pos = buffers
        B, H, n, D = buf_k.shape
        if k.shape[2] == 1:
            rows, slot, real = torch.arange(B, device=k.device), self.pos[:, 0].clamp(min=0) % n, keep[:, 0]
            buf_k[rows, :, slot] = torch.where(real[:, None, None], k[:, :, 0], buf_k[rows, :, slot])
            buf_v[rows, :, slot] = torch.where(real[:, None, None], v[:, :, 0], buf_v[rows, :, slot])
            buf_pos[rows, slot] = torch.where(real, self.pos[:, 0], buf_pos[rows, slot])
            return buffers
        has, src = self._sources(n, keep)
        gather = src[:, None, :, None].expand(B, H, n, D)
        return (torch.where(has[:, None, :, None], k.gather(2, gather), buf_k),
                torch.where(has[:, None, :, None], v.gather(2, gather), buf_v),
                torch.where(has, self.pos.gather(1, src), buf_pos))


class FreshRing:
    """The window ring of a call whose new tokens are each row's first T, all real (positions 0..T-1 in
    every row, an empty ring): the queries attend over the new tokens themselves as causal rows (the
    window kernels, the banded form, or causal SDPA when T <= W), and `update` fills the ring with the
    last W tokens and the sink buffer with the first `sinks` (`fresh_ring`), in the layout `WindowRing`
    keeps (position p in ring slot p % W, -1 for an empty slot) for the steps that follow."""

    sink_slots = 0  # the keys `update` returns are the new tokens alone

    def __init__(self, layer, window: int, sinks: int = 0, kernel: bool = False) -> None:
        self.layer, self.window, self.sinks, self.kernel = layer, window, sinks, kernel

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, H, T, D] (post-RoPE) -> themselves, after writing the ring and the sinks
        (`kernels.window_attention.fresh_ring`: one kernel where `kernel`, `WindowPlan.ring_kernel`)."""
        ring_k, ring_v, pos, sink_k, sink_v, sink_pos = fresh_ring(k, v, self.window, self.sinks,
                                                                   "triton" if self.kernel else "torch")
        t = self.layer.tensors
        t.update(swa_k=ring_k, swa_v=ring_v, swa_pos=pos)
        if self.sinks:
            t.update(swa_sink_k=sink_k, swa_sink_v=sink_v, swa_sink_pos=sink_pos)
        return k, v


#: The paths of a window branch's call (`plan_window`): "rows" (no cache: the window over the new tokens'
#: causal rows, the O(T W) forms), "steady" (`steady_window_step`), "static" (`static_window_step`),
#: "fresh" (a first call of real tokens: causal rows, the ring filled from them, `FreshRing`) and "ring"
#: (the masked path over the ring, `WindowRing`: any call).
WINDOW_PATHS = ("rows", "steady", "static", "fresh", "ring")


@dataclass(frozen=True)
class WindowPlan:
    """The path of one window branch's call. `path`: one of WINDOW_PATHS; `step_kernel`: the "static"
    step runs `kernels.window_attention.window_step`'s Triton kernel (else its PyTorch form);
    `ring_kernel`: the "fresh" call fills the ring and the sinks with `fresh_ring`'s kernel (else its
    PyTorch ops). Each kernel field is False on the other paths."""

    path: str
    step_kernel: bool = False
    ring_kernel: bool = False

    def __post_init__(self) -> None:
        if self.path not in WINDOW_PATHS:
            raise ValueError(f"a window path must be one of {WINDOW_PATHS}, got {self.path!r}")
        if self.step_kernel and self.path != "static" or self.ring_kernel and self.path != "fresh":
            raise ValueError(f"WindowPlan: step_kernel is a 'static' path's and ring_kernel a 'fresh' one's; got "
                             f"path {self.path!r}, step_kernel {self.step_kernel}, ring_kernel {self.ring_kernel}")


def plan_window(T: int, *, cached: bool, whole: bool, length: int | None, causal: bool, weights: bool, grad: bool,
                sdpa: bool, window: int, sinks: int, ring: bool, sink_ring: bool, heads: tuple[int, int, int],
                dtype: torch.dtype, device: torch.device | str, backend: str, path: str | None = None,
                step_kernel: bool | None = None, ring_kernel: bool | None = None) -> WindowPlan:
    """The plan (`WindowPlan`) of a window branch's call on T new tokens: `cached` (a cache layer),
    `whole` (a static cache's whole buffers), `length` (`SequenceInfo.length`), `causal`, `weights` (the
    caller asked for attention weights), `grad` (gradients on), `sdpa` (not the eager attention), the
    branch's `window` and `sinks`, whether its ring (`ring`) and sinks (`sink_ring`) are made, its
    `heads` (query heads, key / value heads, head dim), the `dtype` of its operands, `device` (a device
    type is enough: "cuda" plans the CUDA paths on any machine, the kernels then running under Triton's
    interpreter) and the model's `backend`. A caller sets the `path` (a test's "ring", say),
    `step_kernel` or `ring_kernel` (taken on their own path only), as they are.

    A one-token step without gradients or attention weights under SDPA, with the ring (and sinks) made,
    is "steady" where every token so far is real with the count known on the host and at least W +
    sinks of them come before it (the ring and the sinks full, every slot in view), else "static" on a
    static cache's whole buffers; a first call of real tokens with no ring yet is "fresh". The static
    step takes its kernel by `utils.resolve_backend` ("auto": CUDA with Triton, for operands it takes;
    an explicit "triton" raises where it cannot), the fresh fill as a fused op does (`utils.fused_kernel`
    under `utils.fused_backend`)."""
    if path is None:
        path = _window_path(T, cached, whole, length, causal, weights, grad, sdpa, window, sinks, ring, sink_ring)
    elif path not in WINDOW_PATHS:
        raise ValueError(f"a window path must be one of {WINDOW_PATHS}, got {path!r}")
    device = torch.device(device)
    HQ, H, D = heads
    if path != "static":
        step_kernel = False
    elif step_kernel is None:
        why = window_step_shapes_unsupported((1, HQ, 1, D), (1, H, 1, D), dtype, sinks)
        step_kernel = resolve_backend(backend, device, op="window decode step", has_triton=True, has_naive=True,
                                      unsupported=why) == "triton"
    if path != "fresh":
        ring_kernel = False
    elif ring_kernel is None:
        why = fresh_ring_shapes_unsupported((1, H, T, D), dtype, window, sinks)
        ring_kernel = fused_kernel(fused_backend(backend), device, "window ring fill", why)
    return WindowPlan(path, step_kernel=bool(step_kernel), ring_kernel=bool(ring_kernel))


def _window_path(T: int, cached: bool, whole: bool, length: int | None, causal: bool, weights: bool, grad: bool,
                 sdpa: bool, window: int, sinks: int, ring: bool, sink_ring: bool) -> str:
    """`plan_window`'s path of a call (its docstring)."""
    if not cached:
        return "rows"
    step = T == 1 and not weights and not grad and sdpa and ring and (not sinks or sink_ring)
    if step and length is not None and length > window + sinks:
        return "steady"
    if step and whole:
        return "static"
    if causal and length == T and not ring:
        return "fresh"
    return "ring"


class WindowBranch:
    """Mixin of a state mixer with an optional sliding-window softmax branch (`self.swa`)."""

    def add_window(self, config, layer_idx: int, window: int | None, sinks: int = 0, own_qkv: bool = True) -> None:
        """The branch over the last `window` tokens (none for 0 / None) and the first `sinks` tokens:
        `self.window`, `self.swa`. Without `own_qkv` the branch has no q / k / v projections of its own:
        `window_attention` is given the mixer's (`inputs`), whose k / v heads must be the source's."""
        self.window = window or 0
        if self.window:
            self.swa = SoftmaxAttention(config, layer_idx)
            self.swa.window, self.swa.sinks = self.window, sinks
            if not own_qkv:
                del self.swa.q_proj, self.swa.k_proj, self.swa.v_proj

    def window_attention(self, x: torch.Tensor, position_embeddings, seq: SequenceInfo, cache_layer,
                         inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Softmax attention over the last `self.window` tokens, through the shared `SoftmaxAttention`,
        with the window's keys/values in the cache layer's ring (`WindowRing`), on the path `plan_window`
        gives. `inputs`: the mixer's q / k / v projections of x when the branch reads those (`add_window`
        without `own_qkv`)."""
        t, attn = {} if cache_layer is None else cache_layer.tensors, self.swa
        plan = seq.plan("window", plan_window, x.shape[1], cached=cache_layer is not None,
                        whole=cache_layer is not None and cache_layer.whole, length=seq.length, causal=seq.causal,
                        weights=seq.attentions is not None, grad=torch.is_grad_enabled(),
                        sdpa=self.config._attn_implementation != "eager", window=self.window, sinks=attn.sinks,
                        ring="swa_k" in t, sink_ring="swa_sink_k" in t,
                        heads=(attn.num_heads, attn.num_kv_heads, attn.head_dim), dtype=operand_dtype(x),
                        device=x.device, backend=self.config.kernel_backend)
        path = plan.path
        if path == "rows":
            # a packed batch's documents (one per right-padded row) keep their causal rows: the O(T W) forms
            window_seq = seq.branch(seq.positions, seq.valid, seq.positions, causal=seq.causal,
                                    documents=seq.documents, packed_rope=seq.packed_rope)
            return self.swa(x, position_embeddings, window_seq, None, inputs=inputs)[0]
        if path == "steady":
            fused = forward_plan(seq, self.config, x, self.swa.o_proj.weight)
            return self.steady_window_step(x, position_embeddings, seq.length - 1, cache_layer, inputs, fused)
        if path == "static":
            fused = forward_plan(seq, self.config, x, self.swa.o_proj.weight)
            return self.static_window_step(x, position_embeddings, seq.positions[:, 0], cache_layer, inputs, fused,
                                           kernel=plan.step_kernel)
        if path == "fresh":
            # a first call of real tokens (a prefill): causal rows over the new tokens, the ring filled from them
            fresh = seq.branch(seq.positions, seq.valid, seq.positions, causal=True)
            ring = FreshRing(cache_layer, self.window, self.swa.sinks, plan.ring_kernel)
            return self.swa(x, position_embeddings, fresh, ring, inputs=inputs)[0]
        ring = WindowRing(cache_layer, seq.positions, self.window, no_padding=seq.causal, consecutive=seq.consecutive,
                          sinks=self.swa.sinks)
        out, _ = self.swa(x, position_embeddings, seq.branch(seq.positions, seq.valid, ring.key_positions()), ring,
                          inputs=inputs)
        return out

    def static_window_step(self, x: torch.Tensor, position_embeddings, position: torch.Tensor,
                           cache_layer, inputs: dict[str, torch.Tensor] | None = None,
                           plan: FusedPlan | None = None, kernel: bool = False) -> torch.Tensor:
        """One decode step of the window with the positions on the device (position [B], each row's new
        token, real), as a captured step runs it: the new key / value / position go into ring slot
        position % W (and into the sinks while position < sinks) in place, and the query attends over
        the sinks and the ring under the mask `window_keys` gives (ring slots of the last W positions,
        sink copies W or more back): `kernels.window_attention.window_step`, on its kernel where `kernel`
        (`WindowPlan.step_kernel`: one launch). The values of the masked path (`WindowRing`). `plan`: this
        forward's `fused.FusedPlan` (RoPE's path)."""
        attn, t = self.swa, cache_layer.tensors
        q, k, v = attn.project(x, position_embeddings, inputs=inputs, plan=plan)  # [B, heads, 1, D]
        sinks = [t[n] for n in ("swa_sink_k", "swa_sink_v", "swa_sink_pos")] if attn.sinks else [None] * 3
        o = window_step(q, k, v, t["swa_k"], t["swa_v"], t["swa_pos"], *sinks, position, self.window, attn.scaling,
                        kernel=kernel, precision=self.config.kernel_precision)
        return attn.o_proj(o.transpose(1, 2).reshape(x.shape[0], 1, -1))

    def steady_window_step(self, x: torch.Tensor, position_embeddings, position: int, cache_layer,
                           inputs: dict[str, torch.Tensor] | None = None,
                           plan: FusedPlan | None = None) -> torch.Tensor:
        """One decode step of the window at `position` >= W + sinks, every token so far real: the new
        key/value goes into its ring slot in place, and the query attends over the sinks and the whole
        ring with no mask (every slot holds one of the last W tokens, the sinks are W or more back and
        the ring holds none of them). The values of the masked path (`WindowRing`) with far fewer
        operations, as a step on the CPU or an uncaptured one on a GPU needs. `plan`: as `static_window_step`'s."""
        attn, t = self.swa, cache_layer.tensors
        q, k, v = attn.project(x, position_embeddings, inputs=inputs, plan=plan)  # [B, heads, 1, D]
        slot = position % self.window
        t["swa_k"][:, :, slot] = k[:, :, 0]
        t["swa_v"][:, :, slot] = v[:, :, 0]
        t["swa_pos"][:, slot] = position
        keys, values = t["swa_k"], t["swa_v"]
        if attn.sinks:
            keys, values = torch.cat([t["swa_sink_k"], keys], dim=2), torch.cat([t["swa_sink_v"], values], dim=2)
        o = F.scaled_dot_product_attention(q, keys, values, scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1])
        return attn.o_proj(o.transpose(1, 2).reshape(*x.shape[:2], -1))


#: Attention sinks a conversion gives a window branch when its options name none: the first tokens
#: draw much of the source's attention mass (a window without them misses it; `window_keys`).
CONVERT_SINKS = 4


def with_sink_default(options: dict, window_field: str, sinks_field: str) -> dict:
    """Conversion options with `sinks_field` = CONVERT_SINKS where a window is asked and no sinks are."""
    if options.get(window_field) and options.get(sinks_field) is None:
        return {**options, sinks_field: CONVERT_SINKS}
    return options


def window_copies(prefix: str, rest: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A converted layer's source attention tensor `prefix + rest` (`conversion.core.mixer_tensor`'s
    parts, e.g. rest "q_proj.weight"), copied as the window branch's `prefix + "swa." + rest`."""
    return [(prefix + "swa." + rest, t.clone())]
