"""The decoder shared by every family, written once: embeddings -> L x [RMSNorm -> token mixer ->
residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> lm_head. Each residual add runs with the
norm after it (`fused.RMSNorm.add_and_norm`: one kernel on CUDA), so a layer leaves its MLP output for
the next layer's input norm (or the final norm) to add.

Families only add token mixers (declared with `registry.register_family`); `config.mixer_types[i]`
picks layer i's mixer from the registry (`registry.mixer`). A mixer subclasses `AttentionBase` (q/k/v/o
projections, qk-norm, RoPE), names the cache layer it keeps (`cache_layer_cls`) and initialises the
parameters a dense checkpoint lacks in `reset_mixer_parameters`. Transformers supplies rotary
embeddings, RMSNorm, the SwiGLU MLP, the attention functions, weight loading and generation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, eager_attention_forward

from ..configuration.base import SubquadraticConfig
from ..kernels.decode_attention import decode_attention, decode_shapes_unsupported, grouped_query_attention
from ..kernels.utils import allowed_keys, resolve_backend, slot_offsets
from ..kernels.window_attention import window_attention, window_shapes_unsupported
from ..registry import mixer, register_mixer
from .cache import KVLayer, StateLayer, SubquadraticCache, all_real, positions_from_mask
from .cuda_graph import decode_step, replays_decode
from .fused import MLP, FusedPlan, HeadNorm, RMSNorm, apply_rope, forward_plan
from .packing import find_documents, positions_from_cu_seqlens
from .projections import QKV, PackedInputs, input_projections

#: Name of the cache field in model outputs and of the forward argument generate() passes:
#: Transformers 5.24 renamed `past_key_values` to `cache`; both names are accepted on input.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

@dataclass
class SequenceInfo:
    """Where the new tokens sit. positions, valid: [B, T]; key_positions: [B, S] for every cached +
    new slot (-1 at padding). Logical positions count a row's real tokens, so left padding is invisible."""

    positions: torch.Tensor
    valid: torch.Tensor
    key_positions: torch.Tensor
    _key_offsets: tuple = ()
    #: Set when the caller asked for attention weights: mixers that compute them
    #: (`computes_attention_weights`) record theirs here by layer index, [B, HQ, T, S] each; the
    #: model returns None for the other layers.
    attentions: dict | None = None
    #: A packed batch's documents (`packing.Documents`) when the mixers run one document per row, and
    #: the RoPE (cos, sin) of its packed layout [B, T, D] (the mixers that `take_packed` project there).
    documents: object | None = None
    packed_rope: tuple | None = None
    #: Whether each row's real tokens are known to sit in consecutive slots (a static cache checks
    #: it at prefill; `causal` implies it), so `key_offsets` needs no check (no host sync).
    consecutive: bool = False
    #: Whether every key slot holds a real token in position order and the new tokens are the last
    #: T slots (no padding anywhere, a growing cache or none): a query then sees exactly the slots up
    #: to its own, so the mixers may call SDPA with is_causal (T = S) or without a mask (T = 1)
    #: instead of an explicit mask. Also a static cache's first call when its tokens are all real
    #: (`SubquadraticCache.causal_call`). False when unknown.
    causal: bool = False
    #: Slots of every row after this call when that is known on the host and every slot is a real
    #: token in order (`causal`), so that each new token's position is length - T + i without
    #: reading a tensor; else None.
    length: int | None = None
    #: What one layer hands to the next within this forward (SPLA's `UnionHint`), by name.
    shared: dict = field(default_factory=dict)
    #: Whether every new token is real by the cache's rule without a mask being read: a static cache's
    #: one-token step after its first call (`SubquadraticCache`: one-token steps must be real tokens).
    new_real: bool = False
    #: Fields a caller sets on this forward's plans, by op: {"sse": {"path": "masked"}} (the keywords of
    #: the op's planner, `plan_sse`'s say; "device": "cuda" plans the CUDA paths on any machine). The
    #: model's `plan_settings`.
    plan_settings: dict = field(default_factory=dict)
    #: The plans made in this forward, by op and inputs (`plan`).
    _plans: dict = field(default_factory=dict)

    def plan(self, op: str, make: Callable[..., Any], *inputs, **settings) -> Any:
        """`make(*inputs, **settings)` with the caller's `plan_settings[op]` over `settings`, made once per
        forward for these inputs (every layer of an op that plans alike shares it; a layer planning other
        inputs gets its own)."""
        key = (op, inputs, tuple(settings.items()))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make(*inputs, **{**settings, **self.plan_settings.get(op, {})})
        return plan

    def branch(self, positions: torch.Tensor, valid: torch.Tensor, key_positions: torch.Tensor,
               **fields) -> SequenceInfo:
        """The sequence information of a branch inside this forward's layers (a window branch over its
        rows or its ring): other positions, this forward's plan settings and plans."""
        return SequenceInfo(positions, valid, key_positions, plan_settings=self.plan_settings, _plans=self._plans,
                            **fields)

    def key_offsets(self) -> torch.Tensor | None:
        """Slot of each row's position 0 when each row's real tokens sit in consecutive slots (left or
        right padding; else None); computed
        once per forward and shared by all layers."""
        if not self._key_offsets:
            self._key_offsets = (slot_offsets(self.key_positions, check=not self.consecutive),)
        return self._key_offsets[0]

    def is_packed(self, x: torch.Tensor) -> bool:
        """Whether x [B, T, ...] is in a packed batch's own layout (not one document per row): a mixer
        that `takes_packed` gets its input so."""
        return self.documents is not None and tuple(x.shape[:2]) == tuple(self.documents.shape)

    def valid_like(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T] True at the real tokens of x [B, T, ...], in x's layout: a packed batch's own layout
        (`is_packed`: the residual stream, a `takes_packed` mixer's output) or one row per document."""
        return self.documents.packed_valid if self.is_packed(x) else self.valid

    @property
    def padding_unread(self) -> bool:
        """Whether no real token can read what a padding slot's inputs write: every new token is real
        (`causal`, `new_real`), or the rows are a packed batch's documents (each right-padded after its
        real tokens, no cache outliving the call, the padding's outputs dropped when packed back). The
        mixers then need not zero the padding's inputs or outputs."""
        return self.causal or self.new_real or self.documents is not None


def autocast_operands(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """xs in the autocast dtype of their device while autocast is on there (floating tensors other
    than fp64, which autocast leaves alone too), else unchanged. The mixers' kernels then take 16-bit
    operands with fp32 accumulation, as autocast's matmuls do: under autocast the projections give
    bf16, but the qk-norm's and RoPE's fp32 factors (the norm weights, cos and sin) promote q and k
    back to fp32, which would send them down the kernels' fp32 path."""
    device = xs[0].device.type
    if not torch.is_autocast_enabled(device):
        return xs
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) if x.is_floating_point() and x.dtype != torch.float64 else x for x in xs)


def operand_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype `autocast_operands` gives a tensor of x's dtype and device (a plan's question: the
    dtype of the kernels' operands before they are computed)."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point() and x.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return x.dtype


#: generate() modes that take the static cache by default on CUDA (`generation_cache`); the beam
#: and assisted modes reorder or roll back their caches and keep the growing one.
STATIC_DEFAULT_MODES = ("greedy_search", "sample")


def generation_cache(generation_config, generation_mode, device: torch.device | str) -> str | None:
    """The cache a generate() call of a subquadratic model builds: the `cache_implementation` the
    caller asked for ("dynamic": the growing cache, None); if none, "static" on CUDA for greedy
    search and sampling unless `disable_compile` (its one-token steps replay one captured CUDA
    graph: the fast decode), else None (the growing cache: the CPU, beam search, assisted
    generation)."""
    asked = generation_config.cache_implementation
    if asked is not None:
        return None if asked == "dynamic" else asked
    if (torch.device(device).type == "cuda" and generation_mode in STATIC_DEFAULT_MODES
            and not generation_config.disable_compile):
        return "static"
    return None


def decay_spread(n: int, alpha_min: float, alpha_max: float) -> torch.Tensor:
    """1 - alpha of n initial decay rates alpha, spread geometrically from 1 - alpha_min to 1 - alpha_max
    (float64; n == 1 gives 1 - alpha_min). HLA spreads them over heads, SSE over key channels."""
    return torch.linspace(math.log(1.0 - alpha_min), math.log(1.0 - alpha_max), n, dtype=torch.float64).exp()


class AttentionBase(PackedInputs, nn.Module):
    """q/k/v/o projections with the source model's bias and qk-norm, and RoPE. Names match Llama,
    Qwen2 and Qwen3 so weights convert by name and PEFT targets q_proj/k_proj/v_proj/o_proj.

    `num_kv_heads` sets the heads of k and v (default: the config's num_key_value_heads; SSE gives
    every query head its own, HQ). A mixer with parameters of its own initialises them in
    `reset_mixer_parameters` and nowhere else: it calls it at the end of `__init__` (a mixer built
    alone is ready), the model calls it again for every mixer after Transformers' default init of
    the submodules, and conversion calls it to build the parameters a dense checkpoint lacks.
    """

    cache_layer_cls: type[StateLayer] = KVLayer
    needs_key_positions = True
    #: The linear maps of the layer's input that run as one matmul without gradients
    #: (`projections.input_projections`); a family's mixer lists its own beside q, k, v.
    input_projection_names: tuple[str, ...] = QKV
    #: Whether the mixer forms softmax attention weights it can return for `output_attentions`.
    computes_attention_weights = False

    def __init__(self, config: SubquadraticConfig, layer_idx: int, num_kv_heads: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        h, d = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_bias)
        if config.qk_norm:  # the plain module: a captured step fuses the decoder's norms only
            self.q_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)

    def reset_mixer_parameters(self) -> None:
        """Initialise the parameters a dense checkpoint does not provide (none here)."""

    def qkv(self, x: torch.Tensor, inputs: dict[str, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, hidden] -> q [B, T, HQ, D], k, v [B, T, H, D]: the projections alone (from
        `inputs`, the `input_projections` of x, when given; without gradients one matmul with the
        mixer's other input projections)."""
        B, T, _ = x.shape
        p = input_projections(self, x, QKV) if inputs is None else inputs
        q = p["q_proj"].view(B, T, self.num_heads, self.head_dim)
        k = p["k_proj"].view(B, T, self.num_kv_heads, self.head_dim)
        v = p["v_proj"].view(B, T, self.num_kv_heads, self.head_dim)
        return q, k, v

    def project(
        self, x: torch.Tensor, position_embeddings=None, heads_first: bool = True,
        inputs: dict[str, torch.Tensor] | None = None, plan: FusedPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, hidden] -> q [B, T, HQ, D], k, v [B, T, H, D] with the source's qk-norm, and RoPE
        when `position_embeddings` (cos, sin) are given (on the path of the forward's fused `plan`, none:
        planned for the call), in the autocast dtype under autocast (`autocast_operands`); `heads_first`
        returns them as [B, heads, T, D]. `inputs`: as `qkv`."""
        q, k, v = self.qkv(x, inputs)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if position_embeddings is not None:
            q, k = apply_rope(q, k, *position_embeddings, backend=self.config.kernel_backend, plan=plan)
        q, k, v = autocast_operands(q, k, v)
        if heads_first:
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return q, k, v

    def project_rows(self, x: torch.Tensor, position_embeddings, seq: SequenceInfo,
                     inputs: dict[str, torch.Tensor] | None = None):
        """(q, k, v [rows, heads, T, D], packed): `project` of x with RoPE, and whether x came in a
        packed batch's own layout (`seq.is_packed`, a mixer that `takes_packed`): then the projections
        run on the packed tokens and q, k, v are laid out one document per right-padded row. `inputs`:
        as `qkv`."""
        plan = forward_plan(seq, self.config, x, self.o_proj.weight)
        if seq.is_packed(x):
            q, k, v = self.project(x, seq.packed_rope, heads_first=False, inputs=inputs, plan=plan)
            return (*(seq.documents.unpack(t).transpose(1, 2) for t in (q, k, v)), True)
        return (*self.project(x, position_embeddings, inputs=inputs, plan=plan), False)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o: [B, HQ, T, D] -> [B, T, hidden]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


def window_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, sinks: int = 0,
                sink_slots: int = 0) -> torch.Tensor:
    """`allowed_keys` of a sliding window that also keeps the first `sinks` tokens (attention sinks),
    bool [B, Tq, S]. With `sink_slots`, the first sink_slots keys are copies of the sink tokens (a
    window ring's, `window.WindowRing`), seen only once they are `window` or more positions back (the
    window's own copy serves before), so no token counts twice; without, a key at position < sinks is
    seen from every later query."""
    allowed = allowed_keys(q_pos, k_pos, window)
    if not sinks:
        return allowed
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    if sink_slots:
        copies = (kp[..., :sink_slots] >= 0) & (kp[..., :sink_slots] <= qp) & (qp - kp[..., :sink_slots] >= window)
        return torch.cat([copies | (qp < 0), allowed[..., sink_slots:]], dim=-1)
    return allowed | ((kp >= 0) & (kp < sinks) & (kp <= qp))


def banded_window_attention(q, k, v, q_pos, k_pos, window: int, scaling: float, dropout: float = 0.0,
                            sinks: int = 0, sink_slots: int = 0):
    """Sliding-window softmax attention in O(T W): query t sees the real keys j with t - W < j <= t.

    q [B, HQ, T, D]; k, v [B, H, S, D] (H divides HQ) with S = T (no earlier keys) or S = W + T (the
    W slots of a window ring, any order, then the T new tokens); q_pos [B, T], k_pos [B, S] logical
    positions (-1: padding or an empty slot). Each row's new real tokens must sit in consecutive slots
    (no padding between them). The queries go in blocks of W, each against the W slots before it and
    its own: one SDPA call over [B * T / W] blocks with a [W, 2W] mask each, instead of a [T, S] mask.
    With `sinks`, the first `sinks` tokens count for every query once they leave its window
    (`window_keys`): the keys' first `sink_slots` slots are their copies (a ring's; then S counts
    them too), or, without, the first `sinks` slots of the new tokens (no padding). Returns
    o [B, T, HQ, D], as Transformers' attention functions do."""
    import torch.nn.functional as F

    if sinks:  # every block also sees the sink tokens, once W or more positions back
        n_sink = sink_slots or min(sinks, k.shape[2])
        sink_k, sink_v, sink_pos = k[:, :, :n_sink], v[:, :, :n_sink], k_pos[:, :n_sink]
        if sink_slots:
            k, v, k_pos = k[:, :, sink_slots:], v[:, :, sink_slots:], k_pos[:, sink_slots:]
    B, HQ, T, D = q.shape
    H, S, C = k.shape[1], k.shape[2], window
    if S == T:  # W empty slots in front: block 0 has no earlier keys
        k, v = F.pad(k, (0, 0, C, 0)), F.pad(v, (0, 0, C, 0))
        k_pos = F.pad(k_pos, (C, 0), value=-1)
    elif S != T + C:
        raise ValueError(f"banded_window_attention: {S} keys for {T} queries and a window of {C}")
    n = -(-T // C)
    pad = n * C - T
    q, q_pos = F.pad(q, (0, 0, 0, pad)), F.pad(q_pos, (0, pad), value=-1)
    k, v, k_pos = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad)), F.pad(k_pos, (0, pad), value=-1)

    def blocks(x, heads):  # [B, heads, (n + 1) C, D] -> [B n, heads, 2C, D]: block i's slots [iC, iC + 2C)
        lo, hi = x[:, :, : n * C].view(B, heads, n, C, D), x[:, :, C:].view(B, heads, n, C, D)
        return torch.cat([lo, hi], dim=3).transpose(1, 2).reshape(B * n, heads, 2 * C, D)

    qb = q.view(B, HQ, n, C, D).transpose(1, 2).reshape(B * n, HQ, C, D)
    kb, vb = blocks(k, H), blocks(v, H)
    kp = torch.cat([k_pos[:, : n * C].view(B, n, C), k_pos[:, C:].view(B, n, C)], dim=-1)  # [B, n, 2C]
    n_copies = 0
    if sinks:  # the sink tokens before every block's keys, as a ring's copies are (`window_keys`)
        per_block = lambda x: x[:, None].expand(B, n, *x.shape[1:]).reshape(B * n, *x.shape[1:])  # noqa: E731
        kb, vb = torch.cat([per_block(sink_k), kb], dim=2), torch.cat([per_block(sink_v), vb], dim=2)
        kp, n_copies = torch.cat([sink_pos[:, None].expand(B, n, -1), kp], dim=-1), sink_pos.shape[1]
    allowed = window_keys(q_pos.view(B * n, C), kp.reshape(B * n, -1), C, sinks, n_copies)
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed[:, None], dropout_p=dropout, scale=scaling,
                                       enable_gqa=HQ != H)
    return o.view(B, n, HQ, C, D).transpose(2, 3).reshape(B, n * C, HQ, D)[:, :T]


#: The paths of a softmax layer's call (`plan_softmax`): "window_kernel" (causal rows over a window shorter
#: than them: `kernels.window_attention`), "banded" (the same in PyTorch, or a window ring before the new
#: tokens: `banded_window_attention`), "causal" (SDPA without a mask: causal rows, or one query over every
#: slot, all real), "causal_lower_right" (a chunk of new tokens after a cache whose slots are all real: SDPA
#: with PyTorch's lower-right causal bias, no mask built; a chunked prefill's), "decode_kernel" (one query
#: under a mask: `decode_attention`'s Triton kernels), "decode" (the same in PyTorch), "grouped" (a chunk
#: under a mask without gradients: `grouped_query_attention`), "masked" (SDPA under a mask) and "eager"
#: (Transformers' eager attention, which also gives the weights).
SOFTMAX_PATHS = ("window_kernel", "banded", "causal", "causal_lower_right", "decode_kernel", "decode", "grouped",
                 "masked", "eager")


def plan_softmax(q_shape: tuple[int, ...], k_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 *, window: int | None, sinks: int, sink_slots: int, banded: bool, sdpa: bool, causal_rows: bool,
                 causal: bool, dropout: bool, grad: bool, backend: str, window_kernel: bool | None = None,
                 decode_kernel: bool | None = None, path: str | None = None) -> str:
    """The path (`SOFTMAX_PATHS`) of a softmax layer's call of queries q_shape [B, HQ, T, D] over keys
    k_shape [B, H, S, D] (the cache's slots and the new ones) of `dtype` on `device`: the layer's
    `window` and `sinks`, the cache's `sink_slots` and whether it holds a window ring before the new
    tokens (`banded`), `sdpa` (SDPA, not the eager attention or weights asked for), `causal_rows` (T =
    S, every real query's keys the slots up to its own), `causal` (`SequenceInfo.causal`), `dropout`
    (attention dropout), `grad` (gradients on) and the model's `backend`. A caller sets
    `window_kernel` (where the window's path is taken: its kernels or not), `decode_kernel` (likewise
    where a masked query is: the decode kernels, on the CPU under Triton's interpreter, or not) or the
    `path` itself.

    A window shorter than the new tokens over causal rows (or after a window ring) runs O(T W): the
    Triton kernels by `utils.resolve_backend` ("auto" on CUDA for inputs they take, not with dropout),
    else the banded form; calls whose queries see every slot up to their own run SDPA without a mask;
    a chunk after a cache whose slots are all real (`causal`, T < S) SDPA with the lower-right causal bias
    (each query sees the S - T cached slots and the new ones up to its own: flash attention on CUDA, no
    [B, T, S] mask); the rest build the mask: one query (no dropout) `decode_attention` (its Triton kernels by
    `utils.resolve_backend` likewise: "decode_kernel"), a chunk `grouped_query_attention` where it packs
    the groups (`grouped_query_packs`), else SDPA, or the eager function."""
    if path is not None:
        if path not in SOFTMAX_PATHS:
            raise ValueError(f"a softmax path must be one of {SOFTMAX_PATHS}, got {path!r}")
        return path
    T, S = q_shape[2], k_shape[2]
    if sdpa and window and T > window and (causal_rows or S == T + window + sink_slots and banded):
        if causal_rows and window_kernel is None:
            why = "attention dropout" if dropout else window_shapes_unsupported(q_shape, k_shape, dtype, window, sinks)
            window_kernel = resolve_backend(backend, torch.device(device), op="sliding-window attention",
                                            has_triton=True, has_naive=True, unsupported=why) == "triton"
        return "window_kernel" if causal_rows and window_kernel else "banded"
    if sdpa and (causal_rows or causal and T == 1) and (not window or S <= window):
        return "causal"
    if sdpa and causal and 1 < T < S and (not window or S <= window):
        return "causal_lower_right"
    if sdpa and T == 1 and not dropout:
        if decode_kernel is None:
            decode_kernel = resolve_backend(backend, torch.device(device), op="decode attention", has_triton=True,
                                            has_naive=True,
                                            unsupported=decode_shapes_unsupported(q_shape, k_shape, dtype)) == "triton"
        return "decode_kernel" if decode_kernel else "decode"
    if sdpa and grouped_query_packs(q_shape, k_shape, grad):
        return "grouped"
    return "masked" if sdpa else "eager"


def grouped_query_packs(q: torch.Tensor | tuple[int, ...], k: torch.Tensor | tuple[int, ...],
                        grad: bool | None = None) -> bool:
    """Whether `grouped_query_attention` serves a masked call of q [B, HQ, T, D] over k [B, H, S, D] (tensors
    or their shapes): no gradients (`grad`; None: grad mode; a chunk of new tokens over a cache; training
    keeps Transformers' function), grouped queries (HQ > H) and a mask copied G = HQ / H times that is
    smaller than the keys and values repeated G times (T < 2 H D)."""
    HQ, T, D = tuple(q if isinstance(q, tuple) else q.shape)[1:]
    H = (k if isinstance(k, tuple) else k.shape)[1]
    grad = torch.is_grad_enabled() if grad is None else grad
    return not grad and HQ != H and HQ % H == 0 and T < 2 * H * D


class SoftmaxAttention(AttentionBase):
    """Exact softmax attention (full, or a sliding window for `sliding_attention` layers), through
    Transformers' eager or SDPA attention function with an explicit position-based mask where one is
    needed; a masked one-token step runs `kernels.decode_attention` and a masked chunk over a cache
    without gradients `grouped_query_attention` (neither repeats the keys and values per query head),
    the window over causal rows `kernels.window_attention`. When the caller asks for attention weights
    (`seq.attentions` is a dict), the eager path runs and records them."""

    computes_attention_weights = True
    #: a packed batch's hidden states come packed (`SubquadraticDecoderLayer`): the projections run on
    #: the real tokens, the attention one document per right-padded row
    takes_packed = True

    def __init__(self, config: SubquadraticConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        kind = config.mixer_types[layer_idx]
        self.window = config.sliding_window if kind == "sliding_attention" else None
        self.sinks = 0  # with a window: the first `sinks` tokens stay visible (a state mixer's window branch)

    def forward(self, hidden_states, position_embeddings, seq: SequenceInfo, cache_layer=None,
                inputs: dict[str, torch.Tensor] | None = None):
        """`inputs`: the q / k / v projections of hidden_states when another module computed them (a
        window branch that reads its mixer's projections), else None: this layer's own."""
        q, k, v, packed = self.project_rows(hidden_states, position_embeddings, seq, inputs)
        if cache_layer is not None:
            k, v = cache_layer.update(k, v)
        sink_slots = getattr(cache_layer, "sink_slots", 0)
        dropout = self.attention_dropout if self.training else 0.0
        T, S = q.shape[2], k.shape[2]
        # a packed batch's documents run one per right-padded row with no cache: each real query's keys
        # are the slots up to its own (padding only after them), as in a causal call
        path = seq.plan("softmax", plan_softmax, tuple(q.shape), tuple(k.shape), dtype=q.dtype, device=q.device,
                        window=self.window, sinks=self.sinks, sink_slots=sink_slots,
                        banded=getattr(cache_layer, "banded", False),
                        sdpa=self.config._attn_implementation != "eager" and seq.attentions is None,
                        causal_rows=T == S and (seq.causal or seq.documents is not None), causal=seq.causal,
                        dropout=bool(dropout), grad=torch.is_grad_enabled(), backend=self.config.kernel_backend)
        if path == "window_kernel":  # a window shorter than the new tokens over causal rows: O(T W)
            o = window_attention(q, k, v, self.window, self.scaling, self.sinks, precision=self.config.kernel_precision)
        elif path == "banded":  # the same, or a window ring before the new tokens
            o = banded_window_attention(q, k, v, seq.positions, seq.key_positions, self.window, self.scaling, dropout,
                                        self.sinks, sink_slots)
        elif path == "causal":
            # the queries the last T: causal (T = S; padding only after the real tokens, whose outputs
            # are zeroed below) or every key (one query, every slot real), no mask
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            o, _ = sdpa_attention_forward(self, q, k, v, None, dropout=dropout, scaling=self.scaling, is_causal=T > 1)
        elif path == "causal_lower_right":  # a chunk after real cached slots: query i sees slots [0, S - T + i]
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S),
                                                                 dropout_p=dropout, scale=self.scaling,
                                                                 enable_gqa=q.shape[1] != k.shape[1])
            o = o.transpose(1, 2)
        else:
            allowed = window_keys(seq.positions, seq.key_positions, self.window, self.sinks, sink_slots)
            if path in ("decode_kernel", "decode"):  # a decode step under a mask (a static cache's)
                o = decode_attention(q, k, v, allowed[:, 0], self.scaling, kernel=path == "decode_kernel",
                                     precision=self.config.kernel_precision).transpose(1, 2)
            else:
                mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
                mask = mask.masked_fill(~allowed, torch.finfo(q.dtype).min)[:, None]
                if path == "grouped":
                    o = grouped_query_attention(q, k, v, mask, self.scaling, dropout)
                elif path == "masked":
                    from transformers.integrations.sdpa_attention import sdpa_attention_forward

                    o, _ = sdpa_attention_forward(self, q, k, v, mask, dropout=dropout, scaling=self.scaling)
                else:
                    o, weights = eager_attention_forward(self, q, k, v, mask, dropout=dropout, scaling=self.scaling)
                    if seq.attentions is not None:
                        seq.attentions[self.layer_idx] = weights
        if not seq.padding_unread:  # else every new token is real, or the padding's outputs are dropped
            o = o * seq.valid[:, :, None, None]  # [B, T, HQ, D]
        if packed:
            o = seq.documents.pack(o)
        return self.o_proj(o.reshape(*o.shape[:2], -1)), None


register_mixer("full_attention", SoftmaxAttention)
register_mixer("sliding_attention", SoftmaxAttention)


class SubquadraticDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: SubquadraticConfig, layer_idx: int) -> None:
        super().__init__()
        self.mixer_type = config.mixer_types[layer_idx]
        self.self_attn = mixer(self.mixer_type)(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, config=config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, config=config)

    def forward(self, hidden_states, pending=None, position_embeddings=None, seq=None, cache_layer=None, **kwargs):
        """(residual stream, this layer's MLP output, aux loss or None): the MLP output is left for the next
        norm to add (`pending`: the previous layer's, added here before this layer's input norm, in one
        kernel with it on CUDA), so that the stream is hidden_states + pending. The norms and the MLP run on
        the paths of this forward's `FusedPlan` (`fused.forward_plan`; without `seq`, each plans its call)."""
        plan = None if seq is None else forward_plan(seq, self.mlp.config, hidden_states, self.input_layernorm.weight)
        if pending is None:
            x = self.input_layernorm(hidden_states, plan)
        else:
            hidden_states, x = self.input_layernorm.add_and_norm(hidden_states, pending, plan)
        docs = seq.documents if seq is not None else None
        if docs is None or getattr(self.self_attn, "takes_packed", False):
            # a mixer that `takes_packed` keeps a packed batch's documents apart itself
            h, aux = self.self_attn(x, position_embeddings, seq, cache_layer)
        else:  # a packed batch: only the mixer runs one document per right-padded row, the rest on the real tokens
            h, aux = self.self_attn(docs.unpack(x), position_embeddings, seq, cache_layer)
            h = docs.pack(h)
        hidden_states, x = self.post_attention_layernorm.add_and_norm(hidden_states, h, plan)  # residual add, norm
        return hidden_states, self.mlp(x, plan), aux


@dataclass
class SubquadraticModelOutput(BaseModelOutputWithPast):
    """Adds the mixers' auxiliary loss (SSE's router load balance), None when no layer has one."""

    aux_loss: torch.FloatTensor | None = None


@dataclass
class SubquadraticCausalLMOutput(CausalLMOutputWithPast):
    aux_loss: torch.FloatTensor | None = None


class KeptCache:
    """The static cache generate() keeps on a model for its next call (`key`: batch size, graph
    setting, device). Not part of the model's state: a copy or a pickle of the model starts without one."""

    def __init__(self) -> None:
        self.key: tuple[int, bool, torch.device] | None = None
        self.cache: SubquadraticCache | None = None

    def __deepcopy__(self, memo) -> KeptCache:
        return KeptCache()

    def __reduce__(self):
        return KeptCache, ()


#: The ops that plan once per forward and whose plans a caller may set (`set_plan`): SSE
#: (`kernels.sse.plan_sse`), HLA (`kernels.hla.plan_hla`), the window branch (`window.plan_window`), the
#: softmax layers (`plan_softmax`), the decoder's fused elementwise ops (`fused.plan_fused`) and SPLA
#: (`kernels.spla.plan_spla`; without settings each SPLA call plans itself, as `spla_attention` does, so
#: that rows with padding in the middle take the PyTorch form; with them, the rows must be consecutive).
PLANNED_OPS = ("sse", "hla", "window", "softmax", "fused", "spla")


class SubquadraticPreTrainedModel(PreTrainedModel):
    config_class = SubquadraticConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SubquadraticDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    # Softmax layers run Transformers' eager or SDPA functions with an explicit position mask; the
    # other mixers run their own kernels. No flash / flex attention, no external attention backends.
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    # Running states (linear mixers, SPLA's residual state) cannot be split along the sequence.
    _supports_context_parallel = False
    # generate() must not compile: cache_implementation="static" builds our static cache, whose
    # one-token steps replay our own CUDA graph (`cuda_graph.py`) instead.
    _can_compile_fullgraph = False
    # Running states cannot be rolled back token by token (no assisted decoding).
    _is_stateful = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own SubquadraticCache

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, HeadNorm):
            init.constant_(module.weight, module.init_value)

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """Transformers' init, then every mixer's `reset_mixer_parameters`: called on each mixer
        whether or not it owns parameters directly (Transformers skips the `_init_weights` of
        custom-code modules without own parameters), after its submodules' default init. The
        `transformers.initialization` functions leave weights loaded from a checkpoint alone."""
        super().initialize_weights()
        for module in self.modules():
            if hasattr(module, "reset_mixer_parameters"):
                module.reset_mixer_parameters()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save as usual, plus the model code and `auto_map` so that `trust_remote_code=True`
        loads the folder where the package is not installed."""
        super().save_pretrained(save_directory, *args, **kwargs)
        try:
            from subquadratic.modeling.remote_code import write_remote_code
        except ImportError:  # running as remote code: Transformers copies the files itself
            return
        if kwargs.get("is_main_process", True):
            write_remote_code(save_directory, self.config.model_type)

    def output_options(
        self, output_hidden_states: bool | None, output_attentions: bool | None, return_dict: bool | None
    ) -> tuple[bool, bool, bool]:
        """The forward's output switches, each defaulting to the config's (`output_hidden_states`,
        `output_attentions`, `return_dict`). Attention weights come from the layers whose mixer forms
        them (`computes_attention_weights`: softmax attention, SPLA's exact branch), one entry each in
        layer order (`weight_layers`); state layers have none, as Transformers' own hybrids (Qwen3-Next,
        Jamba, Falcon-H1) record only their attention layers. A model none of whose layers forms them
        raises a ValueError."""
        cfg = self.config
        hidden = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        attentions = cfg.output_attentions if output_attentions is None else output_attentions
        ret = cfg.return_dict if return_dict is None else return_dict
        if attentions and not any(mixer(t).computes_attention_weights for t in cfg.mixer_types):
            kinds = ", ".join(map(repr, sorted(set(cfg.mixer_types))))
            raise ValueError(
                f"output_attentions is not available: every layer of this model is a state layer ({kinds}), which "
                "keeps a running state and forms no attention weights; call the model with output_attentions=False"
            )
        return bool(hidden), bool(attentions), ret is not False

    def weight_layers(self) -> list[int]:
        """The indices of the layers whose mixer forms attention weights: the entries of `attentions`."""
        return [i for i, kind in enumerate(self.config.mixer_types) if mixer(kind).computes_attention_weights]

    def set_plan(self, op: str, **fields) -> None:
        """Set fields of `op`'s plan (one of PLANNED_OPS) for every later forward of this model (a test's or
        a benchmark's explicit choice of a path): the keywords of its planner, e.g. `set_plan("sse",
        path="masked")`, or `set_plan("sse", device="cuda")` to plan the CUDA paths on any machine; no
        fields: plan from the inputs again. A CUDA graph captured before keeps the plans it was captured
        with."""
        if op not in PLANNED_OPS:
            raise ValueError(f"set_plan: op must be one of {', '.join(PLANNED_OPS)}; got {op!r}")
        settings = self.base_model.plan_settings
        if fields:
            settings[op] = dict(fields)
        else:
            settings.pop(op, None)

    def new_cache(self, max_length: int | None = None, cuda_graph: bool = True, fuse: bool = True) -> SubquadraticCache:
        """An empty cache with one state layer per decoder layer: growing, or with `max_length` static
        (allocated once for that many tokens; on CUDA, with `cuda_graph`, one-token steps of the
        causal LM replay one captured CUDA graph of the whole model step, whose elementwise chains
        torch.compile fuses where `fuse`)."""
        kinds = [mixer(t) for t in self.config.mixer_types]
        return SubquadraticCache(
            [cls.cache_layer_cls() for cls in kinds],
            track_key_positions=any(cls.needs_key_positions for cls in kinds),
            max_length=max_length, cuda_graph=cuda_graph, fuse=fuse,
        )

    #: a kept static cache serves a later generate() call that needs up to this much less room (a step
    #: on whole buffers costs up to this much more in the layers that read them: softmax, SPLA's selection)
    GENERATION_CACHE_SLACK = 1.25

    def _generation_static_cache(self, max_length: int, batch_size: int, cuda_graph: bool) -> SubquadraticCache:
        """The static cache of a generate() call: the one the previous call built, rewound
        (`SubquadraticCache.rewind`: same allocations, its captured decode step replayed without a new
        capture), when it fits (same batch size, graph setting and device, `max_length` <= its length <=
        GENERATION_CACHE_SLACK x `max_length`); else a new one, kept for the next call (the old one is
        dropped first). The cache a call returns (`return_dict_in_generate`) is emptied by the next
        call; `drop_generation_cache()` frees it."""
        kept = self.__dict__.setdefault("_generation_cache", KeptCache())
        if kept.cache is not None:
            # (a cache whose capture failed and fell back to eager steps is not reused by a call that asks
            # for the graph: that call captures again, and raises where a static cache was asked for)
            if kept.key == (batch_size, cuda_graph, self.device) and kept.cache.cuda_graph == cuda_graph and (
                    max_length <= kept.cache.max_length <= self.GENERATION_CACHE_SLACK * max_length):
                kept.cache.rewind()
                return kept.cache
            self.drop_generation_cache()
        kept.key, kept.cache = (batch_size, cuda_graph, self.device), self.new_cache(max_length=max_length,
                                                                                     cuda_graph=cuda_graph)
        return kept.cache

    def drop_generation_cache(self) -> None:
        """Free the static cache (and its captured decode step) that generate() keeps for its next call."""
        kept = self.__dict__.get("_generation_cache")
        if kept is not None:
            kept.key = kept.cache = None

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        """The cache of a generate() call (`generation_cache`): "static" (asked, or the default on
        CUDA) builds a static `SubquadraticCache` for the call's max_length (or `max_cache_len`),
        whose one-token steps replay a CUDA graph on CUDA unless `disable_compile=True`; the default
        one falls back to eager steps where the capture fails. "dynamic" and the default elsewhere
        leave the growing cache to the model's first forward; everything else goes to Transformers."""
        if model_kwargs.get(CACHE_FIELD) is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        implementation = generation_cache(generation_config, generation_mode, self.device)
        if implementation == "static":
            if generation_config.max_cache_len is not None:
                max_cache_length = max(max_cache_length, generation_config.max_cache_len)
            cache = self._generation_static_cache(max_cache_length, batch_size, not generation_config.disable_compile)
            # chosen by default, not asked for: a step that cannot be captured runs eagerly instead of raising
            cache.eager_fallback = generation_config.cache_implementation is None
            model_kwargs[CACHE_FIELD] = cache
            return
        if implementation is None:
            return  # the model's first forward makes a growing SubquadraticCache
        return super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)


class SubquadraticModel(SubquadraticPreTrainedModel):
    def __init__(self, config: SubquadraticConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(SubquadraticDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, config=config)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        #: Fields the caller sets on the plans of every forward, by op (`SequenceInfo.plan_settings`,
        #: `set_plan`); empty: every op plans from its inputs.
        self.plan_settings: dict[str, dict] = {}
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: SubquadraticCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        cache: SubquadraticCache | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        plan_settings: dict | None = None,
        **kwargs,
    ) -> SubquadraticModelOutput | tuple:
        """`plan_settings`: fields set on this call's plans, by op, over the model's (`set_plan`): a
        captured decode step's (`fused.captured_step`)."""
        cache = cache if cache is not None else past_key_values
        output_hidden_states, output_attentions, return_dict = self.output_options(
            output_hidden_states, output_attentions, return_dict
        )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T = inputs_embeds.shape[:2]
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("attention_mask must be a 2D [batch, length] padding mask (1 = token, 0 = padding)")
        full_valid = torch.ones(B, T, dtype=torch.bool, device=inputs_embeds.device)
        if attention_mask is not None:
            full_valid = attention_mask.to(inputs_embeds.device).bool()
        if position_ids is None and kwargs.get("cu_seq_lens_q") is not None and B == 1:
            position_ids = positions_from_cu_seqlens(kwargs["cu_seq_lens_q"].to(full_valid.device), T)
        docs = None
        if position_ids is not None and (cache is None or cache.get_seq_length() == 0):
            docs = find_documents(position_ids, full_valid)
        if docs is not None:  # a packed batch: each document runs as its own row
            if use_cache or cache is not None:  # by default (use_cache=None) a packed batch keeps no cache
                raise ValueError("a packed batch (position_ids restarting inside a row) cannot use a cache; "
                                 "call the model with use_cache=False")
            if output_attentions:
                raise ValueError("output_attentions is not available for a packed batch (position_ids restarting "
                                 "inside a row); pass one document per row")
            return self._forward_documents(docs, inputs_embeds, position_ids, output_hidden_states, return_dict,
                                           plan_settings)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if use_cache and cache is None:
            cache = self.new_cache()
        if cache is not None and not isinstance(cache, SubquadraticCache):
            raise TypeError(
                f"{type(self).__name__} needs a SubquadraticCache (model.new_cache()), got {type(cache).__name__}"
            )
        if cache is not None:
            valid = full_valid[:, -T:]
            q_pos, k_pos = cache.advance(valid, known_real=attention_mask is None)
        else:
            q_pos = positions_from_mask(full_valid)[:, -T:]
            valid, k_pos = full_valid[:, -T:], q_pos
        if position_ids is None:
            position_ids = q_pos.clamp(min=0)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        causal = (cache.causal_call if cache is not None
                  else all_real(full_valid if attention_mask is not None else None, sync=T > 1))
        seq = SequenceInfo(positions=q_pos, valid=valid, key_positions=k_pos, causal=causal,
                           attentions={} if output_attentions else None,
                           consecutive=causal or (cache is not None and cache.static is not None),
                           length=cache.length if cache is not None and causal else None,
                           new_real=T == 1 and cache is not None and cache.static is not None and cache.length > 1,
                           plan_settings=self.call_plan_settings(plan_settings))

        hidden, all_hidden, aux_total = self._run_layers(inputs_embeds, position_embeddings, seq, cache,
                                                         output_hidden_states)
        out = SubquadraticModelOutput(
            last_hidden_state=hidden, hidden_states=all_hidden, aux_loss=aux_total,
            attentions=tuple(seq.attentions.get(i) for i in self.weight_layers()) if output_attentions else None,
            **{CACHE_FIELD: cache if use_cache else None},
        )
        return out if return_dict else out.to_tuple()

    def _run_layers(self, hidden, position_embeddings, seq, cache, output_hidden_states, restore=None):
        """The decoder layers and the final norm: (hidden, all hidden states or None, summed aux loss or
        None). `restore` maps each recorded hidden state back to the caller's layout."""
        restore = restore or (lambda x: x)
        all_hidden = (restore(hidden),) if output_hidden_states else None
        aux_total, pending = None, None
        for i, layer in enumerate(self.layers):
            # each layer leaves its MLP output for the next norm to add (`pending`, positional: under reentrant
            # gradient checkpointing only positional tensors get gradients)
            hidden, pending, aux = layer(
                hidden, pending, position_embeddings=position_embeddings, seq=seq,
                cache_layer=cache.layers[i] if cache is not None else None,
            )
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
            if output_hidden_states:
                all_hidden += (restore(hidden + pending),)
        plan = forward_plan(seq, self.config, hidden, self.norm.weight)
        hidden = self.norm(hidden, plan) if pending is None else self.norm.add_and_norm(hidden, pending, plan)[1]
        if output_hidden_states:
            all_hidden = all_hidden[:-1] + (restore(hidden),)
        return hidden, all_hidden, aux_total

    def call_plan_settings(self, settings: dict | None) -> dict:
        """The plan settings of a call: the model's (`plan_settings`) with the call's `settings` over them,
        op by op."""
        if not settings:
            return self.plan_settings
        return {op: {**self.plan_settings.get(op, {}), **settings.get(op, {})}
                for op in {*self.plan_settings, *settings}}

    def _forward_documents(self, docs, inputs_embeds, position_ids, output_hidden_states, return_dict,
                           plan_settings=None):
        """A packed batch (`packing.py`): the residual stream, the norms and the MLPs stay on the packed
        tokens; each mixer runs one document per right-padded row (`SubquadraticDecoderLayer`), so the
        padding of the longest document costs only inside the mixers."""
        valid = docs.valid
        q_pos = positions_from_mask(valid)
        # RoPE of the packed positions, and of each document's row (for the mixers given their input so)
        packed_rope = self.rotary_emb(inputs_embeds, position_ids.to(valid.device).expand(docs.shape))
        position_embeddings = tuple(docs.unpack(t) for t in packed_rope)
        seq = SequenceInfo(positions=q_pos, valid=valid, key_positions=q_pos, documents=docs, packed_rope=packed_rope,
                           plan_settings=self.call_plan_settings(plan_settings))
        hidden, all_hidden, aux_total = self._run_layers(inputs_embeds, position_embeddings, seq, None,
                                                         output_hidden_states)
        if docs.flat.numel() < docs.shape[0] * docs.shape[1]:  # the packed batch's own padding (a right-padded
            # row): zero, as a mixer's output is there
            real = docs.packed_valid[..., None]
            hidden = hidden * real.to(hidden.dtype)
            all_hidden = None if all_hidden is None else tuple(h * real.to(h.dtype) for h in all_hidden)
        out = SubquadraticModelOutput(last_hidden_state=hidden, hidden_states=all_hidden,
                                      aux_loss=aux_total, **{CACHE_FIELD: None})
        return out if return_dict else out.to_tuple()


#: Tokens (rows x new tokens) of one cached call without gradients past which the causal LM runs its prompt
#: in chunks of at most this many tokens over the cache (`SubquadraticForCausalLM.prefill_chunk_tokens`):
#: the activations of a chunk, not of the whole batch, are live at once. 131072 keeps one row of 128k
#: tokens in one call.
PREFILL_CHUNK_TOKENS = 131072


class SubquadraticForCausalLM(SubquadraticPreTrainedModel, GenerationMixin):
    """The decoder plus the LM head. PreTrainedModel does not bring GenerationMixin, so each causal-LM
    class names it among its direct bases (Transformers' `can_generate()` looks there first).

    A cached call without gradients, labels, hidden states or attention weights whose rows x new tokens
    exceed `prefill_chunk_tokens` (set it on the model; None or 0: never) runs in consecutive chunks of
    the rows' tokens over its cache, each chunk's activations freed before the next: the logits and cache
    of the one call (e.g. generate()'s prefill of 4 rows of 128k tokens)."""

    base_model_class = SubquadraticModel
    prefill_chunk_tokens: int | None = PREFILL_CHUNK_TOKENS
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: SubquadraticConfig) -> None:
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def new_cache(self, max_length: int | None = None, cuda_graph: bool = True, fuse: bool = True) -> SubquadraticCache:
        return self.model.new_cache(max_length, cuda_graph, fuse)

    def decode_logits(self, input_ids: torch.LongTensor, cache: SubquadraticCache,
                      plan_settings: dict | None = None) -> torch.Tensor:
        """Logits [B, 1, V] of one real new token per row on `cache`, eagerly: the step that
        `cuda_graph.DecodeGraph` captures, with its `plan_settings` (`fused.captured_step`)."""
        hidden = self.model(input_ids=input_ids, cache=cache, use_cache=True, return_dict=True,
                            plan_settings=plan_settings).last_hidden_state
        return self.lm_head(hidden[:, -1:])

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: SubquadraticCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: SubquadraticCache | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SubquadraticCausalLMOutput | tuple:
        output_hidden_states, output_attentions, return_dict = self.output_options(
            output_hidden_states, output_attentions, return_dict
        )
        cache = cache if cache is not None else past_key_values
        if cache is not None and replays_decode(cache, input_ids, inputs_embeds, labels, logits_to_keep,
                                                output_hidden_states or output_attentions):
            result = SubquadraticCausalLMOutput(logits=decode_step(self, cache, input_ids), **{CACHE_FIELD: cache})
            return result if return_dict else result.to_tuple()
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        step = self._prefill_chunk(input_ids if input_ids is not None else inputs_embeds, labels, use_cache,
                                   output_hidden_states or output_attentions, kwargs)
        if step:
            hidden, out = self._chunked_prefill(step, input_ids, inputs_embeds, attention_mask, position_ids, cache,
                                                logits_to_keep)
        else:
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states,
                output_attentions=output_attentions, cache=cache, return_dict=True,
                cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
            )
            hidden = out.last_hidden_state
        logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                num_items_in_batch=kwargs.get("num_items_in_batch"),
            )
            if out.aux_loss is not None and self.config.aux_loss_weight:
                loss = loss + self.config.aux_loss_weight * out.aux_loss
        result = SubquadraticCausalLMOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions,
            aux_loss=out.aux_loss, **{CACHE_FIELD: getattr(out, CACHE_FIELD)},
        )
        return result if return_dict else result.to_tuple()

    def _prefill_chunk(self, x, labels, use_cache, outputs, kwargs) -> int:
        """New tokens per row of each chunk of this call of inputs `x` (ids or embeddings; the
        `prefill_chunk_tokens` bound), or 0: one call."""
        limit = self.prefill_chunk_tokens
        if not limit or x is None or torch.is_grad_enabled() or labels is not None or outputs:
            return 0
        if kwargs.get("cu_seq_lens_q") is not None or not (self.config.use_cache if use_cache is None else use_cache):
            return 0  # a packed batch, or a call that keeps no cache
        B, T = x.shape[:2]
        return max(1, limit // B) if B * T > limit else 0

    def _chunked_prefill(self, step: int, input_ids, inputs_embeds, attention_mask, position_ids, cache,
                         logits_to_keep):
        """The decoder over the call's new tokens in chunks of `step` per row, in order over one cache:
        (the hidden states the logits need, the last chunk's output with that cache)."""
        x = input_ids if input_ids is not None else inputs_embeds
        T = x.shape[1]
        past = 0 if attention_mask is None else attention_mask.shape[1] - T  # a mask may cover cached tokens too
        tail = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep > 0 else None
        kept, aux = [], None
        for s in range(0, T, step):
            e = min(T, s + step)
            out = self.model(
                input_ids=None if input_ids is None else input_ids[:, s:e],
                inputs_embeds=None if inputs_embeds is None else inputs_embeds[:, s:e],
                attention_mask=None if attention_mask is None else attention_mask[:, :past + e],
                position_ids=None if position_ids is None else position_ids[:, s:e],
                use_cache=True, cache=cache, return_dict=True,
            )
            cache = getattr(out, CACHE_FIELD)
            if out.aux_loss is not None:
                aux = out.aux_loss if aux is None else aux + out.aux_loss
            kept.append(out.last_hidden_state)
            if tail is not None:  # only the last `tail` positions are kept
                kept = [torch.cat(kept, 1)[:, -tail:]]
        out.aux_loss = aux
        return torch.cat(kept, 1), out


