"""Configuration of HLA (second-order Higher-order Linear Attention), plus tiny presets for tests."""

from __future__ import annotations

from typing import ClassVar

from ...configuration.base import SubquadraticConfig


class HLAConfig(SubquadraticConfig):
    """HLA: masked second-order linear attention with a fixed-size state per layer (docs/design.md "HLA").

    `hla_variant`: "hla2" (second order: S = sum k k^T, F = sum (S q) v^T) or "ahla" (asymmetric,
    linear attention applied twice). `decay_mode`: "data" (per-head gate
    log alpha = logsigmoid(W_a x + b), GLA-style) or "constant" (a learnable per-head alpha); the
    initial alphas are spread over [decay_init_min, decay_init_max] across heads. `qk_norm_l2`
    L2-normalises q and k (after the source's optional qk-norm) and multiplies them by `qk_scale`,
    which keeps S bounded. `hla_normalize` divides by q^T eta with the signed-eps clamp `hla_eps`
    (|q^T eta| >= eps; the denominator is not sign-definite and passes near 0, so eps bounds the
    amplification at 1/eps: 1e-3 against typical |q^T eta| of 0.1-1 with unit q and k).
    The mixer output goes through a per-head RMSNorm (`output_norm`) times SiLU(W_g x)
    (`output_gate`). `hla_rope` applies the source's RoPE to q and k (off by default: HLA is
    order-aware through its decays and needs no positions). `hla_chunk_size` is the chunk of the
    training / prefill form. `hla_sliding_window` > 0 adds an in-layer sliding-window softmax branch
    over that many tokens (`swa.*`, a copy of the source attention, `modeling.window`) to the HLA
    output; the gate W_g starts at 0, so a fresh conversion is exactly the source's sliding-window
    softmax (it needs `output_gate`); it also sees the first `hla_window_sinks` tokens (attention
    sinks; `convert` gives 4 with a window unless told otherwise). The kernels follow
    `kernel_backend` ("naive": the serial recurrence at every length).
    """

    model_type = "hla"
    default_mixer: ClassVar[str] = "hla"

    hla_variant: str = "hla2"
    decay_mode: str = "data"
    decay_init_min: float = 0.9
    decay_init_max: float = 0.99
    qk_norm_l2: bool = True
    qk_scale: float = 1.0
    hla_normalize: bool = False
    hla_eps: float = 1e-3
    hla_chunk_size: int = 64
    output_norm: bool = True
    output_gate: bool = True
    hla_rope: bool = False
    hla_sliding_window: int | None = None
    hla_window_sinks: int = 0

    def check(self) -> None:
        super().check()
        if self.hla_variant not in ("hla2", "ahla"):
            raise ValueError(f"hla_variant must be 'hla2' or 'ahla', got {self.hla_variant!r}")
        if self.decay_mode not in ("data", "constant"):
            raise ValueError(f"decay_mode must be 'data' or 'constant', got {self.decay_mode!r}")
        if not 0.0 < self.decay_init_min <= self.decay_init_max < 1.0:
            raise ValueError(
                f"need 0 < decay_init_min <= decay_init_max < 1, got {self.decay_init_min}, {self.decay_init_max}"
            )
        if self.hla_chunk_size < 1:
            raise ValueError(f"hla_chunk_size must be >= 1, got {self.hla_chunk_size}")
        if self.hla_sliding_window is not None and self.hla_sliding_window < 0:
            raise ValueError(f"hla_sliding_window must be >= 0 (or None), got {self.hla_sliding_window}")
        if self.hla_window_sinks is not None and self.hla_window_sinks < 0:
            raise ValueError(f"hla_window_sinks must be >= 0, got {self.hla_window_sinks}")
        if self.hla_sliding_window and not self.output_gate:
            raise ValueError("hla_sliding_window needs output_gate (the HLA branch starts at 0 through its gate)")
        if self.hla_eps <= 0 or self.qk_scale <= 0:
            raise ValueError(f"hla_eps and qk_scale must be > 0, got {self.hla_eps}, {self.qk_scale}")


#: Tiny shapes for tests and smoke runs (CPU, seconds).
TINY_PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, hla_chunk_size=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    ),
    "tiny-hybrid": dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, hla_chunk_size=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, mixer_types=["hla", "full_attention", "hla"],
    ),
}


def tiny_hla_config(preset: str = "tiny", **overrides) -> HLAConfig:
    """An `HLAConfig` of a tiny preset ("tiny", "tiny-hybrid"), fields overridable by keyword."""
    if preset not in TINY_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(TINY_PRESETS)}")
    return HLAConfig(**{**TINY_PRESETS[preset], **overrides})
