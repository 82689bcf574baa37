"""SPLA token mixer and model classes (docs/design.md "SPLA").

o = o_sp + RMSNorm_gamma(o_rla), then W_o: o_sp is exact softmax attention over the selected KV
blocks, o_rla the residual linear attention over everything else, obtained by subtraction. gamma
[HQ, D] are the only new parameters; they start at 0, so a converted model begins as exact sparse
attention (and as the dense model while the budget covers the context).

Asked for attention weights (`output_attentions=True`), the layer runs the masked PyTorch form
(`spla_parallel(..., return_weights=True)`) and records the exact branch's softmax weights over the
selected keys; otherwise the fast paths run as planned.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import GenerationMixin
from transformers import initialization as init

from ...kernels.spla import BlockStats, SPLAParams, append_token, spla_attention, spla_parallel
from ...kernels.spla.dense import fold_state
from ...kernels.spla.plan import UnionHint, plan_spla
from ...modeling.base import (
    AttentionBase,
    SequenceInfo,
    SubquadraticForCausalLM,
    SubquadraticModel,
)
from ...modeling.cache import StateLayer
from ...modeling.fused import HeadNorm, forward_plan
from .configuration import SPLAConfig


class SPLALayer(StateLayer):
    """SPLA cache: post-RoPE keys k and values v [B, H, S, D], running block sums (sum_k, sum_k2
    [B, H, NB, D], count [B, NB]) and the residual linear state sbar [B, H, D, D], all updated with the
    new tokens only. K, V and the block sums grow in place in preallocated buffers (`GrowingBuffer`);
    sbar (constant size) is replaced each step (written in place in a static cache).

    A growing cache defers the block sums and sbar while the context fits the budget (calls that run
    exact attention over every key need neither): the tokens since the last fold wait in K, V with
    their positions, and are folded in, in one pass, by the first call past the budget, or when the
    state is read (`state`, `nbytes`) or reordered, so every later call sees what incremental
    updates would have kept."""

    def __init__(self) -> None:
        super().__init__()
        self.folded, self.pending = 0, []

    def reset(self) -> None:
        super().reset()
        self.folded = 0  # token slots included in the block sums and sbar
        self.pending: list[torch.Tensor] = []  # positions [B, T] of the slots after them, call by call

    def update(self, k, v, pos, block_size, backend: str = "auto", defer_within: int | None = None):
        """Append new keys/values at logical positions pos [B, T]; returns (K, V, stats incl. new, sbar
        before), or (K, V, None, None) where the call is deferred: `defer_within` given (the budget, for a
        call that runs exact attention inside it and updates no sbar), a growing cache that may defer
        (`defer_updates`) and no more slots than that. A later call that is not deferred folds the
        deferred tokens in first.

        The stats have ceil(S / block_size) blocks for S cached slots (padding included): an upper
        bound of every row's blocks known without reading pos on the host. Blocks past a row's current
        block hold zeros and are never candidates for selection. In a static one-token step K, V and
        the stats are the whole buffers (`self.whole`); a static cache writes keys, values and sums
        with `append_token` (one launch for a token per row on CUDA)."""
        B, H, _, D = k.shape
        if not self.buffers:
            acc = torch.float64 if k.dtype == torch.float64 else torch.float32
            self.buffers = {
                "k": self.new_buffer(2), "v": self.new_buffer(2),  # along the slots
                "sum_k": self.new_buffer(2, block_size), "sum_k2": self.new_buffer(2, block_size),  # along the blocks
                "count": self.new_buffer(1, block_size),
            }
            self.tensors["sbar"] = torch.zeros(B, H, D, D, device=k.device, dtype=acc)
        self.block_size = block_size  # also where the buffers were handed in (vLLM's slots)
        bufs = self.buffers
        if self.static is None:
            K, V = bufs["k"].append(k), bufs["v"].append(v)
            if (defer_within is not None and self.defer_updates and K.shape[2] <= defer_within
                    and not torch.is_grad_enabled()):
                self.pending.append(pos)
                return K, V, None, None
            self.fold()
        else:
            K, V = bufs["k"].claim(k), bufs["v"].claim(v)
        stats = self._stats(K.shape[2], k)
        if self.static is None:
            stats.add_(k.transpose(1, 2), pos, block_size)
            self.folded = K.shape[2]
        else:
            append_token(K, V, stats, k, v, self.static.index, pos, block_size, backend=backend)
        return K, V, stats, self.tensors["sbar"]

    def _stats(self, slots: int, like: torch.Tensor) -> BlockStats:
        """The block sums over `slots` token slots, extended with zero blocks as needed."""
        bufs, nb = self.buffers, -(-slots // self.block_size)
        like = like.new_empty(like.shape[0], like.shape[1], 0, like.shape[3], dtype=self.tensors["sbar"].dtype)
        return BlockStats(bufs["sum_k"].extend(nb, like), bufs["sum_k2"].extend(nb, like),
                          bufs["count"].extend(nb, like[:, 0, :, 0]))

    def fold(self) -> None:
        """Fold the deferred tokens (the slots after `folded`) into the block sums and sbar, in one pass."""
        if not self.pending:
            return
        pos = torch.cat(self.pending, dim=1) if len(self.pending) > 1 else self.pending[0]
        start, n = self.folded, pos.shape[1]
        k = self.buffers["k"].view().narrow(2, start, n).transpose(1, 2)  # [B, n, H, D]
        v = self.buffers["v"].view().narrow(2, start, n).transpose(1, 2)
        self._stats(start + n, k.transpose(1, 2)).add_(k, pos, self.block_size)
        self.tensors["sbar"] = fold_state(self.tensors["sbar"], k, v, pos)
        self.folded, self.pending = start + n, []

    @property
    def state(self) -> dict[str, torch.Tensor]:
        self.fold()
        return super().state

    def nbytes(self, allocated: bool = False) -> int:
        self.fold()
        return super().nbytes(allocated)

    def _apply(self, fn) -> None:
        self.fold()
        super()._apply(fn)

    def set_sbar(self, sbar: torch.Tensor | None) -> None:
        if sbar is not None:
            self.tensors["sbar"] = sbar


class SPLAAttention(AttentionBase):
    """SPLA mixer: the source's q/k/v/o (`AttentionBase`) plus gamma (`rla_norm`), 0 at initialisation."""

    cache_layer_cls = SPLALayer
    computes_attention_weights = True  # the exact branch's softmax over the selected keys
    #: a packed batch's hidden states come packed: the projections and the output run on the real
    #: tokens, the sparse attention and the residual term one document per right-padded row
    takes_packed = True

    def __init__(self, config: SPLAConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        # gamma of the residual term's RMSNorm; 0 after conversion and at initialisation
        self.rla_norm = HeadNorm(self.num_heads, self.head_dim, eps=config.rms_norm_eps, init_value=0.0)
        self.reset_mixer_parameters()

    def reset_mixer_parameters(self) -> None:
        """gamma = 0: a fresh or converted model is exactly sparse attention."""
        init.zeros_(self.rla_norm.weight)

    def gamma_is_zero(self, recorded: bool = False) -> bool:
        """Whether gamma is exactly 0 (a converted model before adaptation), read on the host once per
        value of the weight: the answer is kept with the weight's storage and in-place version counter
        (an optimizer step, `load_state_dict` or any in-place write bumps it), so steady-state calls
        never synchronise with the device. False (the residual term is computed) while compiling, or
        warming up and recording a captured decode step (`recorded`: the forward's
        `fused.FusedPlan.recorded`; the warm-up then compiles what the recording needs), or capturing
        any CUDA graph: a compiled or captured step then stays right for any later gamma."""
        w = self.rla_norm.weight
        if torch.compiler.is_compiling() or recorded or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
            return False
        try:
            key = (w.data_ptr(), w.device, w._version)
        except RuntimeError:  # a tensor without storage (a sharded DTensor): no shortcut
            return False
        cached = getattr(self, "_gamma_zero", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        zero = not bool(w.detach().any())
        self._gamma_zero = (key, zero)
        return zero

    def forward(self, hidden_states, position_embeddings, seq: SequenceInfo, cache_layer=None):
        cfg = self.config
        q, k, v, packed = self.project_rows(hidden_states, position_embeddings, seq)
        new_kv = None
        params = SPLAParams.from_config(cfg)
        if cache_layer is not None:
            # inside the budget the "auto" / "torch" paths run exact attention (`plan.plan_spla`): the
            # block sums and sbar wait in the cache until a call leaves the budget
            exact = seq.attentions is None and cfg.kernel_backend in ("auto", "torch")
            K, V, stats, sbar = cache_layer.update(k, v, seq.positions, cfg.block_size, cfg.kernel_backend,
                                                   defer_within=params.budget_tokens if exact else None)
            if cache_layer.whole:  # the new tokens sit at their slots of the whole buffers, not last
                new_kv = (k.transpose(1, 2), v.transpose(1, 2))
        else:
            K, V = k, v
            acc = torch.float64 if k.dtype == torch.float64 else torch.float32
            B, H, _, D = k.shape
            nb = -(-k.shape[2] // cfg.block_size)  # an upper bound of the blocks, without a host sync
            stats = BlockStats.empty(B, H, D, k.device, acc, num_blocks=nb).add_(
                k.transpose(1, 2), seq.positions, cfg.block_size)
            sbar = torch.zeros(B, H, D, D, device=k.device, dtype=acc)
        if params.use_rla and not torch.is_grad_enabled() and self.gamma_is_zero(
                forward_plan(seq, cfg, hidden_states, self.o_proj.weight).recorded):
            # gamma = 0 (a converted model): o + RMSNorm_0(o_rla) is o exactly, so the residual term is not
            # computed (Sbar is still kept)
            cached = getattr(self, "_without_rla", None)  # (params, the same without the residual term)
            if cached is None or cached[0] != params:
                cached = self._without_rla = (params, dataclasses.replace(params, use_rla=False))
            params = cached[1]
        # the op takes [B, T, H, D]: transposed views of q and of the [B, H, S, D] cache, no copies
        args = (q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2), seq.positions, seq.key_positions, stats,
                sbar, params)
        if seq.attentions is not None:  # the exact branch's weights [B, HQ, T, S], through the PyTorch form
            o_sp, o_rla, sbar, seq.attentions[self.layer_idx] = spla_parallel(*args, new_kv=new_kv,
                                                                             return_weights=True)
        else:
            plan = None
            if seq.plan_settings.get("spla"):  # a caller's fields (`set_plan("spla", ...)`): planned with them
                grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
                plan = seq.plan("spla", plan_spla, tuple(args[0].shape), tuple(args[1].shape), q.dtype,
                                device=q.device, params=params, backend=cfg.kernel_backend, grad=grad,
                                precision=cfg.kernel_precision)
            # without gradients the kernels may add o + RMSNorm_gamma(o_rla) themselves (`SPLAPlan.fuse_norm`;
            # then o_rla is None)
            rla_norm = None if torch.is_grad_enabled() else (self.rla_norm.weight, self.rla_norm.eps)
            o_sp, o_rla, sbar = spla_attention(*args, backend=cfg.kernel_backend, k_offsets=seq.key_offsets,
                                               new_kv=new_kv, causal=seq.causal, precision=cfg.kernel_precision,
                                               union_hint=seq.shared.setdefault("spla_union", UnionHint()), plan=plan,
                                               rla_norm=rla_norm)
        if cache_layer is not None:
            cache_layer.set_sbar(sbar)
        o = o_sp.transpose(1, 2)  # [B, HQ, T, D]
        if o_rla is not None:
            # o + RMSNorm_gamma(o_rla), on the path of this forward's fused plan
            fused = forward_plan(seq, cfg, hidden_states, self.o_proj.weight)
            o = self.rla_norm.add(o, o_rla.transpose(1, 2), plan=fused)
        elif torch.is_grad_enabled() and self.rla_norm.weight.requires_grad:
            # the residual term is exactly zero here (inside the budget, or use_rla=False): gamma joins
            # the graph through an exact zero (an empty sum), so every parameter receives a gradient
            # and DDP needs no unused-parameter search
            o = o + self.rla_norm.weight[:0].sum()
        if packed:
            o = seq.documents.pack(o.transpose(1, 2))  # [B, T, HQ, D] on the packed tokens
            return self.o_proj(o.reshape(*o.shape[:2], -1)), None
        return self.output(o), None


class SPLAModel(SubquadraticModel):
    config_class = SPLAConfig


class SPLAForCausalLM(SubquadraticForCausalLM, GenerationMixin):
    config_class = SPLAConfig
    base_model_class = SPLAModel
