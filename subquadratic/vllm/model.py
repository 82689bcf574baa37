"""vLLM model classes of the SPLA, SSE / SSE-H and HLA / HLA-H families (docs/design.md "Serving with vLLM").

The model is the package's own: the Transformers model class of the folder's family is built inside
vLLM's model (same module names, so a converted folder's weights load as they are) and its decoder
runs on vLLM's flat batch of tokens (the requests of one step, prefills and decodes mixed). Only the
token mixers are wrapped:

- a state mixer (SSE, HLA, SPLA) becomes a `StateMixer`, a vLLM `MambaBase` layer: vLLM's hybrid
  cache manager gives every running sequence a state slot, which holds the mixer's recurrent state
  and, with the window branch, the ring of the last W keys / values and the sink keys / values
  (fixed sizes: the window needs no paged cache); SPLA's keys, values, block sums and Sbar, sized
  for max_model_len tokens (not paged). Each step calls the package's mixer with that state as
  its cache layer: the mixer's math and the kernels' dispatch (PyTorch forms on the CPU, Triton on
  CUDA) are the package's, not copies;
- a softmax layer (`full_attention`, `sliding_attention`) keeps the package's projections, qk-norm
  and RoPE and attends with vLLM's `Attention` over its paged key / value cache.

The state layout (names, shapes, dtypes) is read off the package's cache layer by running the mixer
once on two tokens of a tiny copy of the config (`state_layout`), so it follows the family's code.
The ring's positions are not stored: after n tokens, ring slot s holds position
n - 1 - ((n - 1 - s) mod W) and sink slot s position s (`ring_positions`), as the package's ring
keeps them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..configuration.base import SOFTMAX_MIXERS
from ..modeling.base import SequenceInfo
from ..modeling.cache import GrowingBuffer
from ..registry import get_family
from ..registry import mixer as mixer_class

#: The ring's position tensors, derived from the sequence's length instead of stored (`ring_positions`).
POSITION_FIELDS = {"swa_pos": "swa_k", "swa_sink_pos": "swa_sink_k"}
#: The families served (model types).
SERVED = ("sse", "hla", "spla")


class ServeError(ValueError):
    """A folder or setting the vLLM plugin cannot serve: one line naming it and the fix."""


def state_mixer_types(config) -> list[str]:
    return [t for t in config.mixer_types if t not in SOFTMAX_MIXERS]


def check_config(config, vllm_config: VllmConfig | None = None) -> None:
    """Raise ServeError for what the plugin does not serve (one line each)."""
    if config.model_type not in SERVED:
        raise ServeError(f"the vLLM plugin serves {', '.join(SERVED)} folders; this one is {config.model_type!r} "
                         "(serve it with `subquadratic serve FOLDER`, Transformers' server)")
    kinds = set(state_mixer_types(config))
    if len(kinds) > 1:
        raise ServeError(f"the vLLM plugin serves one state mixer type per model; this one has {sorted(kinds)}")
    if vllm_config is not None:
        par = vllm_config.parallel_config
        if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
            raise ServeError("the vLLM plugin runs the package's layers on one device: use --tensor-parallel-size 1 "
                             "--pipeline-parallel-size 1")


def _probe_config(config):
    """A one-layer copy of `config` with a narrow hidden size: the mixer's state does not depend on it."""
    fields = config.to_dict()
    kind = state_mixer_types(config)[0]
    fields.update(num_hidden_layers=1, mixer_types=[kind], hidden_size=16, intermediate_size=16,
                  head_dim=config.head_dim)
    fields.pop("layer_types", None)
    return type(config).from_dict(fields)


class StateEntry(NamedTuple):
    """One tensor of a state slot: the cache layer's name, its shape without the batch, its dtype, and for
    a growing buffer (`GrowingBuffer`) its growing dimension (the batch's counted) and tokens per entry."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    grows: tuple[int, int] | None = None


@functools.lru_cache(maxsize=8)
def _state_layout(config_json: str, model_type: str, dtype: torch.dtype, max_len: int) -> tuple[StateEntry, ...]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _probe_config(get_family(model_type).config_class.from_dict(json.loads(config_json)))
    config._attn_implementation = "sdpa"
    with torch.device("cpu"), torch.no_grad():
        mixer = mixer_class(config.mixer_types[0])(config, 0).to(dtype).eval()
        layer = mixer.cache_layer_cls()
        layer.defer_updates = False  # every tensor written by the probe's call
        x = torch.randn(1, 2, config.hidden_size, dtype=dtype)
        pos = torch.arange(2)[None]
        rope = LlamaRotaryEmbedding(config=config)(x, pos)
        seq = SequenceInfo(positions=pos, valid=torch.ones(1, 2, dtype=torch.bool), key_positions=pos, causal=True,
                           consecutive=True, length=2)
        mixer(x, rope, seq, layer)
    fields = getattr(layer, "fields", ())
    order = [n for n in fields if n in layer.tensors] + [n for n in layer.tensors if n not in fields]
    entries = [StateEntry(n, tuple(layer.tensors[n].shape[1:]), layer.tensors[n].dtype)
               for n in order if n not in POSITION_FIELDS]
    for name, buf in layer.buffers.items():  # sized for max_len tokens
        shape = list(buf.data.shape[1:])
        shape[buf.dim - 1] = -(-max_len // buf.slots_per_entry)
        entries.append(StateEntry(name, tuple(shape), buf.data.dtype, (buf.dim, buf.slots_per_entry)))
    return tuple(entries)


def state_layout(config, dtype: torch.dtype, max_len: int) -> tuple[StateEntry, ...]:
    """The tensors of a state mixer's cache layer (`StateEntry`), in the model's dtype `dtype`, less the
    ring's positions (`POSITION_FIELDS`); growing buffers (SPLA's keys, values and block sums) sized
    for `max_len` tokens."""
    return _state_layout(config.to_json_string(use_diff=False), config.model_type, dtype, max_len)


def ring_positions(length: torch.Tensor, size: int, sinks: bool = False) -> torch.Tensor:
    """[B, size] positions the package's ring holds after `length` [B] tokens (-1: empty): ring slot s
    the last position p < length with p % size == s; a sink slot s position s."""
    s = torch.arange(size, device=length.device)
    if sinks:
        p = s.expand(len(length), size)
        return torch.where(p < length[:, None], p, -1)
    last = (length - 1)[:, None]
    p = last - (last - s) % size
    return torch.where(p >= 0, p, -1)


class StateMixer(nn.Module, MambaBase):
    """A state mixer of the package as a vLLM `MambaBase` layer: its state tensors (`state_layout`)
    live in the sequence's state slot; `forward` runs the package's mixer on the step's sequences
    (the decodes, one token each, as one batch; each prefill or prefill chunk alone)."""

    def __init__(self, mixer: nn.Module, layout, prefix: str) -> None:
        super().__init__()
        object.__setattr__(self, "mixer", mixer)  # not a submodule: its parameters stay under model.layers
        self.layout = layout
        self.prefix = prefix
        self.kv_cache: tuple[torch.Tensor, ...] = ()
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name: {prefix}")
        context[prefix] = self

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return tuple(e.shape for e in self.layout)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return tuple(e.dtype for e in self.layout)

    @property
    def grows(self) -> bool:
        """Whether the state holds growing buffers (SPLA): each sequence then runs alone, on views of its slot."""
        return any(e.grows for e in self.layout)

    def _cache_layer(self, slots: torch.Tensor, length: torch.Tensor | None):
        """The package's cache layer of these slots after `length` tokens each (None: fresh sequences,
        an empty layer); a single slot's tensors are views of the slot, so in-place updates land there."""
        layer = self.mixer.cache_layer_cls()
        layer.defer_updates = False  # rebuilt from the slots at every call: nothing may wait in Python
        if length is None and not self.grows:
            return layer
        if length is None:
            length = torch.zeros(1, dtype=torch.long, device=slots.device)
        fresh = slots[length == 0]
        tensors = {}
        for entry, state in zip(self.layout, self.kv_cache, strict=True):
            if len(fresh):  # a new sequence whose slot is read (a one-token prompt, which vLLM counts among the
                # decodes; a growing state): it starts at zero, as the buffers' unwritten entries must be
                state[fresh] = 0
            t = state[slots[0]:slots[0] + 1] if len(slots) == 1 else state.index_select(0, slots)
            if entry.grows:  # the slot as the buffer's allocation, its first entries in use
                dim, per_entry = entry.grows
                buf = GrowingBuffer(dim, per_entry)
                buf.data, buf.length = t, -(-int(length[0]) // per_entry)
                layer.buffers[entry.name] = buf
            else:
                tensors[entry.name] = t
        for pos_name, ring in POSITION_FIELDS.items():
            if ring in tensors:
                tensors[pos_name] = ring_positions(length, tensors[ring].shape[2], sinks=pos_name == "swa_sink_pos")
        layer.tensors = tensors
        return layer

    def _store(self, layer, slots: torch.Tensor) -> None:
        for entry, state in zip(self.layout, self.kv_cache, strict=True):
            t = layer.buffers[entry.name].data if entry.grows else layer.tensors[entry.name]
            if len(slots) == 1 and t.data_ptr() == state[slots[0]].data_ptr():
                continue  # updated in place
            state.index_copy_(0, slots, t.to(state.dtype))

    def _run(self, x, positions, rope, slots, length, fresh_prefill: bool) -> torch.Tensor:
        """x [B, T, hidden] of B sequences at positions [B, T] with `length` [B] tokens before them."""
        B, T = positions.shape
        layer = self._cache_layer(slots, None if fresh_prefill else length)
        known = int(length[0]) + T if B == 1 else None
        # every key of the sequence (SPLA reads them): the cached ones, then the new
        keys = positions if known is None else torch.arange(known, device=x.device)[None]
        seq = SequenceInfo(positions=positions, valid=torch.ones(B, T, dtype=torch.bool, device=x.device),
                           key_positions=keys, causal=True, consecutive=True, length=known)
        out, _ = self.mixer(x, rope, seq, layer)
        self._store(layer, slots)
        return out

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
        """x [N, hidden] (the step's tokens, decodes first), positions [N], rope: (cos, sin) [1, N, D]."""
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata.get(self.prefix)
        if metadata is None:  # a dummy run (profiling, warm-up): the tokens as one sequence, no state
            seq = SequenceInfo(positions=positions[None], valid=torch.ones_like(positions[None], dtype=torch.bool),
                               key_positions=positions[None], causal=True)
            return self.mixer(x[None], rope, seq, None)[0][0]
        out = torch.zeros_like(x)
        nd, np_ = metadata.num_decodes, metadata.num_prefills
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.to(torch.long)
        slots = metadata.state_indices_tensor.to(torch.long)
        cos, sin = rope
        if nd and not self.grows:
            d = slice(0, metadata.num_decode_tokens)
            length = seq_lens[:nd] - 1
            out[d] = self._run(x[d, None], positions[d, None], (cos[0, d, None], sin[0, d, None]), slots[:nd],
                               length, fresh_prefill=False)[:, 0]
        for i in range(nd if not self.grows else 0, nd + np_):
            s, e = starts[i], starts[i + 1]
            length = seq_lens[i:i + 1] - (e - s)
            out[s:e] = self._run(x[None, s:e], positions[None, s:e], (cos[:, s:e], sin[:, s:e]), slots[i:i + 1],
                                 length, fresh_prefill=int(length[0]) == 0)[0]
        return out


class SoftmaxMixer(nn.Module):
    """A softmax layer of the package on vLLM's `Attention`: the package's projections, qk-norm and
    RoPE, vLLM's paged key / value cache and attention kernels, the package's output projection."""

    def __init__(self, mixer: nn.Module, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        object.__setattr__(self, "mixer", mixer)
        self.attn = Attention(mixer.num_heads, mixer.head_dim, mixer.scaling, num_kv_heads=mixer.num_kv_heads,
                              cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config,
                              per_layer_sliding_window=mixer.window or None, prefix=f"{prefix}.attn")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
        q, k, v = self.mixer.project(x[None], rope, heads_first=False)  # [1, N, heads, D]
        o = self.attn(q.flatten(2)[0], k.flatten(2)[0], v.flatten(2)[0])
        return self.mixer.o_proj(o)


class SubquadraticForVLLM(nn.Module, HasInnerState, IsHybrid):
    """A converted folder of a served family (`SERVED`) in vLLM: the package's model with its mixers
    wrapped (`StateMixer`, `SoftmaxMixer`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_config(config, vllm_config)
        config._attn_implementation = "sdpa"
        hf = get_family(config.model_type).causal_lm_class(config).eval()
        self.config = config
        self.model, self.lm_head = hf.model, hf.lm_head
        layout = state_layout(config, vllm_config.model_config.dtype, vllm_config.model_config.max_model_len)
        mixers = []
        for i, layer in enumerate(self.model.layers):
            name = f"{prefix}model.layers.{i}.mixer" if not prefix else f"{prefix}.model.layers.{i}.mixer"
            if config.mixer_types[i] in SOFTMAX_MIXERS:
                mixers.append(SoftmaxMixer(layer.self_attn, vllm_config, name))
            else:
                mixers.append(StateMixer(layer.self_attn, layout, name))
        self.mixers = nn.ModuleList(mixers)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The decoder of `modeling.base.SubquadraticModel` on the step's tokens [N] (positions [N])."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.model.rotary_emb(hidden[None], positions[None])
        pending = None
        for layer, mixer in zip(self.model.layers, self.mixers, strict=True):
            if pending is None:
                x = layer.input_layernorm(hidden)
            else:
                hidden, x = layer.input_layernorm.add_and_norm(hidden, pending)
            hidden, x = layer.post_attention_layernorm.add_and_norm(hidden, mixer(x, positions, rope))
            pending = layer.mlp(x)
        return self.model.norm.add_and_norm(hidden, pending)[1]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The folder's tensors by their names (the package's: a converted folder loads as it is)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                raise ServeError(f"the folder holds {name!r}, which the {self.config.model_type} model does not "
                                 "have: is it a folder `subquadratic convert` or `adapt` wrote?")
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded

    # --- vLLM's hybrid interface -----------------------------------------------------------------
    @classmethod
    def _layout(cls, vllm_config: VllmConfig) -> tuple[StateEntry, ...]:
        model_config = vllm_config.model_config
        return state_layout(model_config.hf_config, model_config.dtype, model_config.max_model_len)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        return tuple(e.shape for e in cls._layout(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return tuple(e.dtype for e in cls._layout(vllm_config))

    @classmethod
    def get_mamba_state_copy_func(cls):
        # used by prefix caching's "align" mode only, which the plugin turns off (`config.py`)
        return (get_temporal_copy_spec,) * 8


class SSEForVLLM(SubquadraticForVLLM):
    """SSE and SSE-H folders."""


class HLAForVLLM(SubquadraticForVLLM):
    """HLA and HLA-H folders."""


class SPLAForVLLM(SubquadraticForVLLM):
    """SPLA folders: keys, values, block sums and Sbar in the sequence's state slot (`StateMixer.grows`)."""
