"""SSE token mixer and model classes (docs/design.md "SSE and SSE-H").

Per layer (HQ heads of dim D for q, k and v, so a dense checkpoint converts by repeating its K/V
heads; with sse_kv_heads "source" W_k, W_v keep the source's KV heads and k1, v are repeated to the
HQ heads after them): q1 = W_q x, k1 = W_k x, v = W_v x, q2 = q1 + B_q A_q x, k2 = k1 + B_k A_k x (B = 0 at
initialisation), the source's qkv bias and qk-norm (Qwen3: applied to q1, q2 and k1, k2 alike),
feature maps (GLA: q -> SiLU, k -> softmax over D, optionally top-`sse_key_topk` only; GDN: SiLU then
L2 norm), v -> SiLU, decays for the shared state and for the partitions, a softmax router with
top-K, then `sse_attention` (kernels/sse) and out = W_o(RMSNorm(o) * SiLU(W_g x)). SSE-H layers that
keep softmax attention are the shared "full_attention" mixer of `base`.

Padding (seq.valid False) gets q = k = v = 0, log decays = 0 and no selected partition, so it
neither writes nor decays any state and does not count in the routing statistics.
Cache per layer (`SSELayer`): "shared" [B, HQ, D, D] and "parts" [B, N, HQ, D, D] in fp32, plus,
with the sliding-window branch, a ring of the last `sse_sliding_window` keys/values and their
positions: a size independent of the context length.
The router's load-balance loss is returned in training (self.training) only, so evaluation losses
stay pure LM losses; the model sums it over layers and adds aux_loss_weight times it to the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ...kernels.norm_gate import norm_gate
from ...kernels.sse import SSEPlan, SSEState, plan_sse, router_topk, sse_attention, sse_from_projections
from ...kernels.sse.features import sse_gla_features
from ...kernels.utils import acc_dtype
from ...modeling.base import (
    AttentionBase,
    SequenceInfo,
    SubquadraticForCausalLM,
    SubquadraticModel,
    autocast_operands,
    decay_spread,
)
from ...modeling.cache import RecurrentLayer
from ...modeling.projections import QKV, input_projections, linear_plus, stacked_linears
from ...modeling.window import WINDOW_FIELDS, WindowBranch
from .configuration import SSEConfig

#: The low-rank offsets' down projections (with lora_rank > 0).
LORA_DOWN = ("q2_down", "k2_down")


class SSELayer(RecurrentLayer):
    """SSE cache: shared [B, HQ, D, D] and parts [B, N, HQ, D, D] (fp32). With the window branch, the
    ring of each row's last W real tokens (`window.WindowRing`). Every tensor has a fixed size."""

    fields = ("shared", "parts", *WINDOW_FIELDS)

    def read(self) -> SSEState | None:
        return SSEState(self.tensors["shared"], self.tensors["parts"]) if "shared" in self.tensors else None

    def write(self, state: SSEState) -> None:
        self.tensors["shared"], self.tensors["parts"] = state.shared, state.parts


def initial_decays(n: int, alpha_min: float, alpha_max: float) -> torch.Tensor:
    """n decay rates alpha (float64) with 1 - alpha spread geometrically (`decay_spread`)."""
    return 1.0 - decay_spread(n, alpha_min, alpha_max)


def gla_decay_bias(alpha: torch.Tensor, normalizer: float) -> torch.Tensor:
    """b with logsigmoid(b) / normalizer = log alpha (the GLA gate at zero input)."""
    s = alpha.double() ** normalizer
    return (s.log() - (-s).log1p()).float()


def gdn_dt_bias(alpha: torch.Tensor) -> torch.Tensor:
    """b with -softplus(b) = log alpha (the GDN gate at zero input with A = 1)."""
    y = -alpha.double().log()
    return (y + (-torch.expm1(-y)).log()).float()


class SSERMSNorm(LlamaRMSNorm):
    """RMSNorm computing in float32, or float64 for float64 inputs (so the fp64 oracle checks stay fp64)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(acc_dtype(x))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.to(xf.dtype) * xf).to(x.dtype)


class SSEAttention(WindowBranch, AttentionBase):
    """Sparse State Expansion mixer: shared state + N router-selected partition states.

    Source names (converted from a dense layer), from `AttentionBase`: q_proj, k_proj, v_proj, o_proj
    (k/v with HQ heads), q_norm, k_norm (Qwen3). New: q2_down/q2_up and k2_down/k2_up (low-rank offsets, up = 0 at
    init), router, the decays (GLA: g1_down/g1_up/g1_bias and g2_*; GDN: a_proj, A_log, dt_bias,
    b_proj), g_proj (low-rank output gate), o_norm; with a window: swa.* (a softmax attention
    layer with the source's GQA shapes) and the merge norms.
    """

    cache_layer_cls = SSELayer
    needs_key_positions = False
    # the offsets' down projections and the gate's adjacent (one width: their up projections stack), then the decays'
    input_projection_names = (*QKV, *LORA_DOWN, "g_proj.0", "g1_down", "g2_down", "router")
    concat_with_grad = True  # a call with gradients off the pack: the members as one matmul (`modeling.projections`)
    #: a packed batch's hidden states come packed: every per-token step (projections, feature maps, decays,
    #: router, gate, output) runs on the real tokens, the state recurrence one document per row
    takes_packed = True

    def __init__(self, config: SSEConfig, layer_idx: int) -> None:
        kv_heads = config.num_attention_heads if config.sse_kv_heads == "query" else config.num_key_value_heads
        super().__init__(config, layer_idx, num_kv_heads=kv_heads)
        h, hq, d = config.hidden_size, self.num_heads, self.head_dim
        r = config.lora_rank
        if r:
            self.q2_down, self.q2_up = nn.Linear(h, r, bias=False), nn.Linear(r, hq * d, bias=False)
            self.k2_down, self.k2_up = nn.Linear(h, r, bias=False), nn.Linear(r, hq * d, bias=False)
        self.router = nn.Linear(h, config.sse_num_partitions, bias=False)
        if config.sse_base == "gla":
            gr = config.sse_gate_rank
            self.g1_down, self.g1_up = nn.Linear(h, gr, bias=False), nn.Linear(gr, hq * d, bias=False)
            self.g2_down, self.g2_up = nn.Linear(h, gr, bias=False), nn.Linear(gr, hq * d, bias=False)
            # the decay biases are parameters of this module (Transformers skips the init of custom-code
            # modules that own no parameter)
            self.g1_bias = nn.Parameter(torch.zeros(hq * d))
            self.g2_bias = nn.Parameter(torch.zeros(hq * d))
        else:
            self.a_proj = nn.Linear(h, 2 * hq, bias=False)  # shared and partition decays
            self.b_proj = nn.Linear(h, hq, bias=False)  # delta-rule write strength
            self.A_log = nn.Parameter(torch.zeros(2 * hq))
            self.dt_bias = nn.Parameter(torch.zeros(2 * hq))
        self.g_proj = nn.Sequential(
            nn.Linear(h, config.output_gate_rank, bias=False), nn.Linear(config.output_gate_rank, hq * d, bias=False)
        )
        self.o_norm = SSERMSNorm(d, eps=config.rms_norm_eps)
        self.add_window(config, layer_idx, config.sse_sliding_window, config.sse_window_sinks or 0,
                        own_qkv=config.sse_window_qkv == "own")
        if self.window:
            if config.sse_window_merge == "norm":
                self.sse_merge_norm = SSERMSNorm(h, eps=config.rms_norm_eps)
                self.swa_merge_norm = SSERMSNorm(h, eps=config.rms_norm_eps)
        self.reset_mixer_parameters()

    # --- initialisation -------------------------------------------------------------------------
    def reset_mixer_parameters(self) -> None:
        """Initialise every parameter a dense checkpoint does not provide: LoRA up = 0, router and
        gate projections small random, decays spread for long memory, norms = 1. Uses the
        `transformers.initialization` functions, which leave weights loaded from a checkpoint alone."""
        cfg = self.config
        std = cfg.initializer_range
        hq, d = self.num_heads, self.head_dim
        if cfg.lora_rank:
            init.normal_(self.q2_down.weight, std=std)
            init.normal_(self.k2_down.weight, std=std)
            init.zeros_(self.q2_up.weight)
            init.zeros_(self.k2_up.weight)
        init.normal_(self.router.weight, std=std)
        alpha = initial_decays(d if cfg.sse_base == "gla" else hq, cfg.sse_decay_init_min, cfg.sse_decay_init_max)
        if cfg.sse_base == "gla":
            bias = gla_decay_bias(alpha, cfg.sse_gate_normalizer).repeat(hq)  # each head spans the range
            for i in (1, 2):
                init.normal_(getattr(self, f"g{i}_down").weight, std=std)
                init.normal_(getattr(self, f"g{i}_up").weight, std=std)
                init.copy_(getattr(self, f"g{i}_bias"), bias.to(self.g1_bias))
        else:
            init.normal_(self.a_proj.weight, std=std)
            init.normal_(self.b_proj.weight, std=std)
            init.zeros_(self.A_log)
            init.copy_(self.dt_bias, gdn_dt_bias(alpha).repeat(2).to(self.dt_bias))
        for lin in self.g_proj:
            init.normal_(lin.weight, std=std)
        if self.window and cfg.sse_window_merge == "sum":
            # the SSE branch starts at exactly 0 (SiLU(0) = 0), so that the layer starts as the
            # sliding-window softmax; the down projection stays random, so the up one gets a gradient
            init.zeros_(self.g_proj[1].weight)
        init.ones_(self.o_norm.weight)
        if self.window and cfg.sse_window_merge == "norm":
            init.ones_(self.sse_merge_norm.weight)
            init.ones_(self.swa_merge_norm.weight)

    # --- the SSE branch -------------------------------------------------------------------------
    def project_sse(self, x: torch.Tensor, inputs: dict[str, torch.Tensor] | None = None,
                    offsets: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """x: [B, T, hidden] -> q1, k1, q2, k2, v: [B, T, HQ, D] before the feature maps (qk-norm applied),
        in the autocast dtype under autocast (`autocast_operands`). `inputs`: x's `input_projections`
        when already computed; `offsets`: q2's and k2's low-rank offsets (`lora_offsets`) when already
        computed."""
        if inputs is None:
            inputs = input_projections(self, x, (*QKV, *LORA_DOWN) if self.config.lora_rank else QKV)
        q1, k1, v = self.qkv(x, inputs)
        if self.num_key_value_groups > 1:  # sse_kv_heads "source": KV head j serves query heads jG..jG+G-1
            k1, v = (t.repeat_interleave(self.num_key_value_groups, dim=2) for t in (k1, v))
        q2, k2 = q1, k1
        if self.config.lora_rank:
            dq2, dk2 = self.lora_offsets(x, inputs) if offsets is None else offsets
            q2, k2 = q1 + dq2, k1 + dk2
        if self.config.qk_norm:
            q1, q2 = self.q_norm(q1), self.q_norm(q2)
            k1, k2 = self.k_norm(k1), self.k_norm(k2)
        return autocast_operands(q1, k1, q2, k2, v)

    def lora_offsets(self, x: torch.Tensor, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """q2's and k2's low-rank offsets B_q A_q x, B_k A_k x [B, T, HQ, D] from x's `input_projections`."""
        shape = (*x.shape[:2], self.num_heads, self.head_dim)
        return self.q2_up(inputs["q2_down"]).view(shape), self.k2_up(inputs["k2_down"]).view(shape)

    def key_map(self, k: torch.Tensor) -> torch.Tensor:
        """GLA keys: softmax over D (the row classification), over the top `sse_key_topk` entries only if set."""
        top = self.config.sse_key_topk
        if not top or top >= k.shape[-1]:
            return torch.softmax(k, -1, dtype=acc_dtype(k)).to(k.dtype)  # the cast inside the softmax
        kf = k.to(acc_dtype(k))
        keep = torch.zeros_like(kf, dtype=torch.bool).scatter(-1, kf.topk(top, dim=-1).indices, True)
        return kf.masked_fill(~keep, float("-inf")).softmax(-1).to(k.dtype)

    def decays(self, x: torch.Tensor, projected: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Log decays (fp32, fp64 for fp64 inputs; <= 0) of the shared state and the partitions, and
        beta (GDN). GLA: [B, T, HQ, D] each, beta None (`projected`: the decay projections z1, z2 of x
        before their biases, when already computed). GDN: [B, T, HQ] each."""
        cfg = self.config
        B, T, _ = x.shape
        dt = acc_dtype(x)
        if cfg.sse_base == "gla":
            shape = (B, T, self.num_heads, self.head_dim)
            if projected is None:
                projected = self.g1_up(self.g1_down(x)), self.g2_up(self.g2_down(x))
            z1 = projected[0].to(dt) + self.g1_bias.to(dt)
            z2 = projected[1].to(dt) + self.g2_bias.to(dt)
            norm = cfg.sse_gate_normalizer
            return (F.logsigmoid(z1) / norm).view(shape), (F.logsigmoid(z2) / norm).view(shape), None
        a = -self.A_log.to(dt).exp() * F.softplus(self.a_proj(x).to(dt) + self.dt_bias.to(dt))  # [B, T, 2 HQ]
        g1, g2 = a.split(self.num_heads, dim=-1)
        return g1, g2, torch.sigmoid(self.b_proj(x).to(dt))

    def plan(self, x: torch.Tensor, inputs: dict[str, torch.Tensor], seq: SequenceInfo,
             cache_layer: SSELayer | None) -> SSEPlan:
        """This call's `SSEPlan` (`plan_sse`), made once per forward for every SSE layer (`SequenceInfo.plan`),
        from the shapes and dtype of x's projections `inputs`, the layer's settings and the caller's
        `plan_settings`."""
        cfg = self.config
        return seq.plan("sse", plan_sse, (*x.shape[:2], self.num_heads, self.head_dim), dtype=inputs[QKV[0]].dtype,
                        device=x.device, num_partitions=cfg.sse_num_partitions, base=cfg.sse_base,
                        chunk_size=cfg.sse_chunk_size, backend=cfg.kernel_backend, precision=cfg.kernel_precision,
                        grad=torch.is_grad_enabled(), cached=cache_layer is not None, packed=seq.is_packed(x),
                        key_topk=cfg.sse_key_topk, qk_norm=cfg.qk_norm, lora=bool(cfg.lora_rank))

    def features(self, x: torch.Tensor, p: dict[str, torch.Tensor], plan: SSEPlan
                 ) -> tuple[tuple, torch.Tensor | None, torch.Tensor | None]:
        """(xs, beta, gate) of x and its `input_projections` p as `plan` says: xs the inputs of the SSE op,
        (q1, k1, q2, k2, v, g1, g2) after the feature maps and decays, or where `plan.fused` the
        projections the SSE kernels compute them from (q1, k1, q2, k2 as `plan.q2_mode` says, v, z1, z2
        and the decay biases); beta the GDN write strength (None for GLA); gate the output gate's up
        projection where it ran stacked with the low-rank offsets' (else None)."""
        cfg = self.config
        if cfg.sse_base == "gdn":
            q1, k1, q2, k2, v = self.project_sse(x, p)
            q1, q2, k1, k2 = (F.normalize(F.silu(t), dim=-1) for t in (q1, q2, k1, k2))
            g1, g2, beta = self.decays(x)
            return (q1, k1, q2, k2, F.silu(v), g1, g2), beta, None
        # the low-rank up projections of one width run as one batched matmul each (with gradients too)
        z = stacked_linears(self, ("g1_up", "g2_up"), (p["g1_down"], p["g2_down"]))
        z1, z2 = z or (self.g1_up(p["g1_down"]), self.g2_up(p["g2_down"]))
        q1, k1, v = self.qkv(x, p)
        offsets, gate = None, None
        if cfg.lora_rank:
            B, T, _ = x.shape
            downs = (p["q2_down"], p["k2_down"], p["g_proj.0"])
            ups = (stacked_linears(self, ("q2_up", "k2_up", "g_proj.1"), downs)
                   or stacked_linears(self, ("q2_up", "k2_up"), downs[:2]))
            shape = (B, T, self.num_heads, self.head_dim)
            offsets = (ups[0].view(shape), ups[1].view(shape)) if ups else self.lora_offsets(x, p)
            gate = ups[2] if ups and len(ups) == 3 else None
        if plan.features == "kernel" and plan.q2_mode != "full":
            # the kernel reads q1 / k1 / v where the projection wrote them, K / V at their own heads and q2 / k2
            # as q1 / k1 plus their low-rank offsets (no repeat, no add)
            xs = (q1, k1, *(offsets or (None, None)), v, z1, z2, self.g1_bias, self.g2_bias)
        else:  # qk-norm (applied to q2 / k2 after the offsets) on `project_sse`'s outputs
            xs = (*self.project_sse(x, p, offsets), z1, z2, self.g1_bias, self.g2_bias)
        if plan.fused:  # the features computed inside the SSE kernels (padding's zeroed there)
            return xs, None, gate
        if plan.features == "kernel":
            return sse_gla_features(*xs, cfg.sse_gate_normalizer, backend="triton", q2_mode=plan.q2_mode), None, gate
        q1, k1, q2, k2, v = xs[:5]
        g1, g2, _ = self.decays(x, (z1, z2))
        return (F.silu(q1), self.key_map(k1), F.silu(q2), self.key_map(k2), F.silu(v), g1, g2), None, gate

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        seq: SequenceInfo,
        cache_layer: SSELayer | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states [B, T, hidden] -> (out [B, T, hidden], load-balance loss in training else None):
        project, features, route, SSE, norm and gate, window, on the paths of this forward's `SSEPlan`.
        position_embeddings (cos, sin) are used by the sliding-window branch only. With a cache, the
        states are read from and written back to `cache_layer` (in place at decode, without grad)."""
        cfg = self.config
        x = hidden_states
        B, T, _ = x.shape
        p = input_projections(self, x)  # without gradients one matmul
        plan = self.plan(x, p, seq, cache_layer)
        xs, beta, gate = self.features(x, p, plan)
        logits = p["router"]
        if plan.packed:  # the recurrence runs one document per right-padded row (not the decay biases)
            unpack = seq.documents.unpack
            xs = (*(None if t is None else unpack(t) for t in xs[:7]), *xs[7:])
            logits, beta = unpack(logits), None if beta is None else unpack(beta)
        # [B, T, N], sel False at padding; in training also the load-balancing loss over the valid tokens (all of
        # them where seq.causal); fused also the grouping's selection counts (its first launch, in the router's)
        probs, sel, *aux = router_topk(logits, cfg.sse_top_k, None if seq.causal else seq.valid,
                                       backend="triton" if plan.router == "kernel" else "torch",
                                       aux=self.training, counts=plan.fused)
        counts = aux.pop() if plan.fused else None
        valid = seq.valid
        tok = valid[:, :, None, None]
        if not seq.padding_unread and not plan.fused:
            # padding: no read, no write, no decay (nothing to mask where no real token reads the padding)
            gmask = tok if xs[5].dim() == 4 else valid[:, :, None]
            xs = (*(torch.where(tok, t, 0.0) for t in xs[:5]), *(torch.where(gmask, g, 0.0) for g in xs[5:]))
            beta = None if beta is None else torch.where(valid[:, :, None], beta, 0.0)

        state = cache_layer.read() if cache_layer is not None else None
        gate = (self.g_proj[1](p["g_proj.0"]) if gate is None else gate).view(B, T, self.num_heads, self.head_dim)
        w, eps = self.o_norm.weight, self.o_norm.variance_epsilon
        if plan.fused:  # padding zeroed in the kernels: a packed batch's too (unread; zero keeps the two-step values)
            o, state = sse_from_projections(*xs, cfg.sse_gate_normalizer, probs, sel, state, q2_mode=plan.q2_mode,
                                            chunk_size=cfg.sse_chunk_size, topk=cfg.sse_top_k,
                                            precision=plan.precision,
                                            valid=None if seq.causal or seq.new_real else valid,
                                            norm_gate=(w, gate, eps) if plan.norm_gate == "combine" else None,
                                            counts=counts, recompute=plan.recompute)
        else:
            o, state = sse_attention(*xs, probs, sel, state, base=cfg.sse_base, beta=beta,
                                     chunk_size=cfg.sse_chunk_size, topk=cfg.sse_top_k, plan=plan)  # [B, T, HQ, D]
        if cache_layer is not None:
            cache_layer.write(state)
        if plan.packed:
            o = seq.documents.pack(o)
        if plan.norm_gate == "kernel":
            o = norm_gate(o, w, gate, eps, backend="triton")  # one kernel (a decode step's too), the same values
        elif plan.norm_gate == "torch":
            o = self.o_norm(o) * F.silu(gate)
        o = (o if seq.padding_unread else o * tok).reshape(B, T, -1)
        if not self.window:
            return self.o_proj(o), aux[0] if aux else None
        o_swa = self.window_attention(x, position_embeddings, seq, cache_layer,
                                      inputs=None if cfg.sse_window_qkv == "own" else p)
        if cfg.sse_window_merge == "sum":
            out = linear_plus(self.o_proj, o, o_swa)  # o_proj(o) + o_swa in one GEMM
        else:
            out = (self.sse_merge_norm(self.o_proj(o)) + self.swa_merge_norm(o_swa)) / 2
        return out, aux[0] if aux else None



class SSEModel(SubquadraticModel):
    config_class = SSEConfig


class SSEForCausalLM(SubquadraticForCausalLM, GenerationMixin):
    config_class = SSEConfig
    base_model_class = SSEModel
