"""Configuration of SSE / SSE-H (Sparse State Expansion), with the paper's layouts and tiny presets.

SSE-H is not a separate model type: it is an `SSEConfig` whose `mixer_types` put a softmax
("full_attention") layer among the SSE layers, by default one after every five SSE layers
(`sse_h_mixer_types`).
"""

from __future__ import annotations

from typing import ClassVar

from ...configuration.base import SOFTMAX_MIXERS, SubquadraticConfig, hybrid_mixer_types


class SSEConfig(SubquadraticConfig):
    """SSE: a shared gated linear-attention state plus `sse_num_partitions` (N) partition states, of
    which a softmax router picks `sse_top_k` (K) per token for both writing and reading
    (docs/design.md "SSE and SSE-H").

    `sse_base`: "gla" (per-key-dim decays, keys through a softmax over the head dim) or "gdn"
    (gated delta rule: per-head decays, L2-normalised q and k, a write strength beta).
    `sse_key_topk` > 0 keeps only that many entries of each key before its softmax (row-sparse
    write; GLA only). q2 = q1 + B_q A_q x and k2 = k1 + B_k A_k x with rank `sse_lora_rank`
    (None: head_dim; 0: no offsets). Decays are low rank (`sse_gate_rank`) with
    log alpha = logsigmoid(.) / `sse_gate_normalizer` (GLA); at initialisation the per-channel
    alphas are spread over [`sse_decay_init_min`, `sse_decay_init_max`] (long memory). The output
    is RMSNorm(o) * SiLU(W_g x), W_g of rank `sse_output_gate_rank` (None: head_dim), then o_proj.
    `sse_sliding_window` > 0 adds an in-layer sliding-window softmax branch with its own
    projections (`swa.*`), merged by `sse_window_merge`: "norm", (RMSNorm(o_sse) + RMSNorm(o_swa)) / 2,
    the SSE authors' form; or "sum", o_swa + o_sse, with the output gate's up projection
    initialised to 0, so that a fresh conversion is exactly the source's sliding-window softmax.
    `sse_window_sinks`: the window branch also sees the first that many tokens (attention sinks;
    `convert` gives 4 with a window unless told otherwise).
    `sse_kv_heads`: the heads of the SSE layers' k and v projections: "query" (as many as the query
    heads; a conversion repeats each source K/V head to its query heads) or "source" (the source's
    num_key_value_heads, each read by its G query heads: k_proj and v_proj keep the source's shapes,
    and k1, v are repeated to the query heads after the projection; the same values at conversion, a
    smaller projection, K / V tied within each group when trained).
    `sse_window_qkv`: where the window branch's q, k, v come from: "own" (projections of its own,
    `swa.q_proj` / `k_proj` / `v_proj`, copies of the source's) or "shared" (the SSE layer's q / k / v
    projections, which then serve both branches: the same values at conversion, three projections
    fewer; needs `sse_kv_heads` "source", the window's GQA heads).
    `aux_loss_weight` scales the router load-balance loss (summed over SSE layers) that the model
    adds to the LM loss in training. The kernels follow `kernel_backend` ("torch": the recurrent
    step for one token and the sorted variable-length form otherwise; "naive": the serial
    recurrence at every length).
    """

    model_type = "sse"
    default_mixer: ClassVar[str] = "sse"

    sse_num_partitions: int = 4
    sse_top_k: int = 1
    sse_lora_rank: int | None = None
    sse_base: str = "gla"
    sse_key_topk: int = 0
    sse_sliding_window: int | None = None
    sse_window_merge: str = "norm"
    sse_window_sinks: int = 0
    sse_kv_heads: str = "query"
    sse_window_qkv: str = "own"
    sse_gate_rank: int = 16
    sse_gate_normalizer: float = 16.0
    sse_output_gate_rank: int | None = None
    sse_decay_init_min: float = 0.9
    sse_decay_init_max: float = 0.999
    sse_chunk_size: int = 64
    aux_loss_weight: float = 0.01

    def check(self) -> None:
        super().check()
        n, k = self.sse_num_partitions, self.sse_top_k
        if n < 1 or not 1 <= k <= n:
            raise ValueError(f"need sse_num_partitions >= 1 and 1 <= sse_top_k <= sse_num_partitions; got N={n}, K={k}")
        if self.sse_base not in ("gla", "gdn"):
            raise ValueError(f"sse_base must be 'gla' or 'gdn', got {self.sse_base!r}")
        if not 0 <= self.sse_key_topk <= self.head_dim:
            raise ValueError(f"sse_key_topk must be in [0, head_dim={self.head_dim}], got {self.sse_key_topk}")
        if self.sse_window_merge not in ("norm", "sum"):
            raise ValueError(f"sse_window_merge must be 'norm' or 'sum', got {self.sse_window_merge!r}")
        if self.sse_kv_heads not in ("query", "source"):
            raise ValueError(f"sse_kv_heads must be 'query' or 'source', got {self.sse_kv_heads!r}")
        if self.sse_window_qkv not in ("own", "shared"):
            raise ValueError(f"sse_window_qkv must be 'own' or 'shared', got {self.sse_window_qkv!r}")
        if self.sse_window_qkv == "shared" and self.sse_kv_heads != "source":
            raise ValueError("sse_window_qkv 'shared' needs sse_kv_heads 'source' (the window branch reads k / v at "
                             "the source's KV heads): add --sse-kv-heads source, or --sse-window-qkv own")
        if self.sse_key_topk and self.sse_base != "gla":
            raise ValueError("sse_key_topk (row-sparse softmax keys) applies to sse_base='gla' only; set it to 0")
        for name in ("sse_lora_rank", "sse_output_gate_rank", "sse_sliding_window", "sse_window_sinks"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 (or None), got {value}")
        if self.sse_output_gate_rank == 0:
            raise ValueError("sse_output_gate_rank must be >= 1 (or None for head_dim)")
        if self.sse_gate_rank < 1 or self.sse_gate_normalizer <= 0:
            raise ValueError(f"need sse_gate_rank >= 1 and sse_gate_normalizer > 0; got {self.sse_gate_rank}, "
                             f"{self.sse_gate_normalizer}")
        if not 0.0 < self.sse_decay_init_min <= self.sse_decay_init_max < 1.0:
            raise ValueError(f"need 0 < sse_decay_init_min <= sse_decay_init_max < 1, got "
                             f"{self.sse_decay_init_min}, {self.sse_decay_init_max}")
        if self.sse_chunk_size < 1:
            raise ValueError(f"sse_chunk_size must be >= 1, got {self.sse_chunk_size}")

    @property
    def lora_rank(self) -> int:
        return self.head_dim if self.sse_lora_rank is None else self.sse_lora_rank

    @property
    def output_gate_rank(self) -> int:
        return self.head_dim if self.sse_output_gate_rank is None else self.sse_output_gate_rank

    @property
    def softmax_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mixer_types) if t in SOFTMAX_MIXERS]


def sse_h_mixer_types(num_layers: int, softmax_every: int = 6) -> list[str]:
    """The SSE-H layout (`hybrid_mixer_types`): softmax attention when (i + 1) % softmax_every == 0, SSE
    otherwise; 6 gives five SSE layers then one softmax layer (the paper's SSE-H); 0 gives pure SSE."""
    return hybrid_mixer_types(num_layers, "sse", softmax_every)


_TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    sse_chunk_size=16, sse_gate_rank=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
#: Routing of the paper's main settings: N partitions, top-K written and read.
ROUTING = {"n4k1": dict(sse_num_partitions=4, sse_top_k=1), "n4k2": dict(sse_num_partitions=4, sse_top_k=2)}
# Layout classes: the paper's SSE-H puts one softmax layer after every five SSE layers (its 2B model:
# 18 layers, 3 softmax). The widths are ours, chosen for ~0.6B and ~2B parameters with a 152k vocabulary.
_600M = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
_2B = dict(
    vocab_size=151936, hidden_size=2560, intermediate_size=8192, num_hidden_layers=18, num_attention_heads=20,
    num_key_value_heads=4, head_dim=128, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)

#: Named configurations: tiny ones for tests and smoke runs (CPU, seconds) and the paper's shapes.
PRESETS: dict[str, dict] = {
    "tiny": dict(_TINY, num_hidden_layers=2),
    "tiny-h": dict(_TINY, num_hidden_layers=6, mixer_types=sse_h_mixer_types(6)),
    "tiny-swa": dict(_TINY, num_hidden_layers=2, sse_sliding_window=8),
    "tiny-gdn": dict(_TINY, num_hidden_layers=2, sse_base="gdn"),
    **{f"sse-600m-{r}": dict(_600M, **ROUTING[r]) for r in ROUTING},
    **{f"sse-h-600m-{r}": dict(_600M, **ROUTING[r], mixer_types=sse_h_mixer_types(24)) for r in ROUTING},
    **{f"sse-2b-{r}": dict(_2B, **ROUTING[r]) for r in ROUTING},
    **{f"sse-h-2b-{r}": dict(_2B, **ROUTING[r], mixer_types=sse_h_mixer_types(18)) for r in ROUTING},
}


def sse_config(preset: str = "tiny", **overrides) -> SSEConfig:
    """An `SSEConfig` from a named preset (see `PRESETS`), with fields overridden by keyword."""
    if preset not in PRESETS:
        raise ValueError(f"unknown SSE preset {preset!r}; available: {', '.join(PRESETS)}")
    fields = dict(PRESETS[preset])
    if "num_hidden_layers" in overrides and "mixer_types" not in overrides and "mixer_types" in fields:
        fields.pop("mixer_types")
    return SSEConfig(**{**fields, **overrides})
