"""HLA token mixer and model classes (docs/design.md "HLA").

Per layer: q = W_q x (HQ heads), k = W_k x, v = W_v x (H heads, repeated to HQ), the source's
optional qk-norm, then q and k L2-normalised and scaled, a per-head decay alpha_t (data-dependent
logsigmoid gate or a learnable constant), second-order HLA through `hla_attention` (chunked for
training / prefill, recurrent for decode), a per-head RMSNorm gated by SiLU(W_g x), and W_o.

RoPE is off by default (`hla_rope`): HLA is order-aware through its decays and counts no
positions, so a pure-HLA model needs none. Padding (seq.valid False) gets q = k = v = 0 and
log alpha = 0, which leaves every state unchanged, so left-padded batches match unpadded rows.
Cache per layer (`HLALayer`): S, F (and eta, z for the normalised form) as fp32 [B, ...], a size
independent of the context length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as Fn
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init

from ...kernels.hla import HLAPlan, HLAState, hla_attention, plan_hla
from ...kernels.hla.features import hla_features, hla_features_and_decay, log_alpha_reference
from ...kernels.norm_gate import norm_gate
from ...modeling.base import (
    AttentionBase,
    SequenceInfo,
    SubquadraticForCausalLM,
    SubquadraticModel,
    decay_spread,
)
from ...modeling.cache import RecurrentLayer
from ...modeling.fused import HeadNorm, forward_plan
from ...modeling.projections import QKV, input_projections, linear_plus
from ...modeling.window import WINDOW_FIELDS, WindowBranch
from .configuration import HLAConfig


class HLALayer(RecurrentLayer):
    """HLA cache: S [B, H', D, D] and F [B, HQ, D, D] (fp32), plus eta and z of the normalised form,
    and with the window branch its ring (`window.WindowRing`)."""

    state_fields = ("S", "F", "eta", "z")
    fields = (*state_fields, *WINDOW_FIELDS)

    def read(self) -> HLAState | None:
        return HLAState(**{n: self.tensors.get(n) for n in self.state_fields}) if "S" in self.tensors else None

    def write(self, state: HLAState) -> None:
        ring = {n: self.tensors[n] for n in WINDOW_FIELDS if n in self.tensors}
        self.tensors = {**ring, **{n: t for n in self.state_fields if (t := getattr(state, n)) is not None}}


def initial_decay_logits(num_heads: int, alpha_min: float, alpha_max: float) -> torch.Tensor:
    """Per-head logit(alpha) with 1 - alpha spread geometrically from 1 - alpha_min to 1 - alpha_max."""
    one_minus = decay_spread(num_heads, alpha_min, alpha_max)
    return (torch.log1p(-one_minus) - torch.log(one_minus)).float()


class HLAAttention(WindowBranch, AttentionBase):
    """Second-order HLA mixer. q_proj/k_proj/v_proj/o_proj (and q_norm/k_norm) come from
    `AttentionBase`, so a dense checkpoint converts by name; new parameters: the decay (`decay_bias` [HQ],
    plus `decay_proj` [HQ, hidden] when data-dependent), the gate `g_proj` and the output norm `o_norm`;
    with `hla_sliding_window`, the window branch `swa.*` (a copy of the source attention), added to the
    output."""

    cache_layer_cls = HLALayer
    #: a packed batch's hidden states come packed: the projections, decays, gate and output run on the
    #: real tokens, the recurrence one document per row
    takes_packed = True
    needs_key_positions = False
    input_projection_names = (*QKV, "decay_proj", "g_proj")
    concat_with_grad = True  # a call with gradients off the pack: the members as one matmul (`modeling.projections`)

    def __init__(self, config: HLAConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        h, hq, d = config.hidden_size, self.num_heads, self.head_dim
        # log alpha = logsigmoid(decay_bias [+ decay_proj(x)]). The bias is a parameter of this module,
        # not of decay_proj: Transformers skips the init of custom-code modules without own parameters.
        self.decay_bias = nn.Parameter(initial_decay_logits(hq, config.decay_init_min, config.decay_init_max))
        if config.decay_mode == "data":
            self.decay_proj = nn.Linear(h, hq, bias=False)
        if config.output_gate:
            self.g_proj = nn.Linear(h, hq * d, bias=False)
        if config.output_norm:
            self.o_norm = HeadNorm(hq, d, eps=config.rms_norm_eps)
        self.add_window(config, layer_idx, config.hla_sliding_window, config.hla_window_sinks or 0)
        self.reset_mixer_parameters()

    def reset_mixer_parameters(self) -> None:
        """Initialise every parameter a dense checkpoint does not provide (model init and conversion):
        decays spread over [decay_init_min, decay_init_max], decay and gate projections small random,
        output norm 1; with the window branch the gate starts at 0 (SiLU(0) = 0: the layer starts as
        the window alone). The `transformers.initialization` functions leave loaded weights alone."""
        cfg = self.config
        logits = initial_decay_logits(self.num_heads, cfg.decay_init_min, cfg.decay_init_max)
        init.copy_(self.decay_bias, logits.to(self.decay_bias.device, self.decay_bias.dtype))
        if cfg.decay_mode == "data":
            init.normal_(self.decay_proj.weight, std=cfg.initializer_range)
        if cfg.output_gate and self.window:
            init.zeros_(self.g_proj.weight)
        elif cfg.output_gate:
            init.normal_(self.g_proj.weight, std=cfg.initializer_range)
        if cfg.output_norm:
            init.ones_(self.o_norm.weight)

    def decay_logits(self, x: torch.Tensor, inputs: dict | None = None) -> torch.Tensor | None:
        """decay_proj(x) [B, T, HQ] (from the input projections' outputs `inputs` where they hold it), or None
        for a constant decay."""
        if self.config.decay_mode != "data":
            return None
        out = None if inputs is None else inputs.get("decay_proj")
        return self.decay_proj(x) if out is None else out

    def log_alpha(self, x: torch.Tensor, projected: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, hidden] -> log alpha [B, T, HQ] (<= 0; fp32, or fp64 for an fp64 model);
        `projected`: decay_proj(x) when already computed (`decay_logits`). The model's forward takes it
        from the feature kernel where that runs (`hla_features_and_decay`, the same values)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        if projected is None:
            projected = self.decay_logits(x)
        proj = None if projected is None else projected.to(dtype)
        return log_alpha_reference(self.decay_bias.to(dtype), proj, (*x.shape[:2], self.num_heads))

    def plan(self, q: torch.Tensor, seq: SequenceInfo, packed: bool) -> HLAPlan:
        """This call's `HLAPlan` (`plan_hla`), made once per forward for every HLA layer
        (`SequenceInfo.plan`), from the shape and dtype of the queries q, the layer's settings and the
        caller's `plan_settings`."""
        cfg = self.config
        return seq.plan("hla", plan_hla, tuple(q.shape), dtype=q.dtype, device=q.device,
                        chunk_size=cfg.hla_chunk_size, backend=cfg.kernel_backend, precision=cfg.kernel_precision,
                        grad=torch.is_grad_enabled(), packed=packed, qk_norm_l2=cfg.qk_norm_l2,
                        output_norm_gate=cfg.output_norm and cfg.output_gate)

    def forward(self, hidden_states, position_embeddings, seq: SequenceInfo, cache_layer: HLALayer | None = None):
        """hidden_states [B, T, hidden] -> (out [B, T, hidden], None): project, features, HLA, norm and
        gate, window, on the paths of this forward's `HLAPlan`."""
        cfg = self.config
        B, T, _ = hidden_states.shape
        # q [B, T, HQ, D], k, v [B, T, H, D]: the source's qk-norm, RoPE only with hla_rope
        packed = seq.is_packed(hidden_states)
        rope = (seq.packed_rope if packed else position_embeddings) if cfg.hla_rope else None
        p = input_projections(self, hidden_states)  # without gradients one matmul
        q, k, v = self.project(hidden_states, rope, heads_first=False, inputs=p,
                               plan=forward_plan(seq, cfg, hidden_states, self.o_proj.weight))
        plan = self.plan(q, seq, packed)
        # qk_norm_l2: q and k L2-normalised and scaled, in the projections' dtype (CUDA autocast computes
        # the norm in fp32); one state per query head: k, v [B, T, H, D] -> [B, T, HQ, D] (KV head j
        # serves query heads jG..jG+G-1). On the kernel one launch forward and one backward, with
        # log alpha [B, T, HQ] (the decay projection read from the packed projection in place).
        proj = self.decay_logits(hidden_states, p)
        if plan.features == "kernel":
            q, k, v, log_alpha = hla_features_and_decay(q, k, v, cfg.qk_scale, self.decay_bias, proj,
                                                        backend="triton")
        else:
            q, k, v = hla_features(q, k, v, cfg.qk_scale, cfg.qk_norm_l2, backend="torch")
            log_alpha = self.log_alpha(hidden_states, proj)  # [B, T, HQ]
        if packed:  # the recurrence runs one document per right-padded row
            q, k, v, log_alpha = (seq.documents.unpack(t) for t in (q, k, v, log_alpha))

        # padding: q = k = v = 0 and log alpha = 0 leave every state unchanged (not needed where no real
        # token reads the padding: `padding_unread`)
        valid = seq.valid[:, :, None]  # [B, T, 1]
        if not seq.padding_unread:
            q, k, v = (torch.where(valid[..., None], x, 0.0) for x in (q, k, v))
            log_alpha = torch.where(valid, log_alpha, 0.0)

        state = cache_layer.read() if cache_layer is not None else None
        o, state = hla_attention(
            q, k, v, log_alpha, state, chunk_size=cfg.hla_chunk_size, normalize=cfg.hla_normalize,
            eps=cfg.hla_eps, variant=cfg.hla_variant, plan=plan,
        )  # o: [B, T, HQ, D]
        if cache_layer is not None:
            cache_layer.write(state)
        if packed:
            o = seq.documents.pack(o)

        gate = p["g_proj"].view(B, T, self.num_heads, self.head_dim) if cfg.output_gate else None
        if plan.norm_gate == "kernel":  # the norm and the gate in one kernel, the values of the two lines below
            o = norm_gate(o, self.o_norm.weight, gate, self.o_norm.eps, backend="triton")
        else:
            if cfg.output_norm:
                o = self.o_norm(o.transpose(1, 2)).transpose(1, 2)
            if gate is not None:
                o = o * Fn.silu(gate)
        if not seq.padding_unread:
            o = o * valid[..., None]
        o = o.reshape(B, T, self.num_heads * self.head_dim)
        if not self.window:
            return self.o_proj(o), None
        o_swa = self.window_attention(hidden_states, position_embeddings, seq, cache_layer)
        return linear_plus(self.o_proj, o, o_swa), None  # o_proj(o) + o_swa in one GEMM


class HLAModel(SubquadraticModel):
    config_class = HLAConfig


class HLAForCausalLM(SubquadraticForCausalLM, GenerationMixin):
    config_class = HLAConfig
    base_model_class = HLAModel
