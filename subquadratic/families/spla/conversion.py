"""Dense -> SPLA: the weights keep their names; each layer gains gamma = 0 (rla_norm.weight, from
`SPLAAttention.reset_mixer_parameters`), so the converted model is exactly sparse attention, and the
dense model while the budget covers the context."""

from __future__ import annotations

from ...conversion.core import Converter
from .configuration import SPLAConfig


def build_config(fields: dict, options: dict) -> SPLAConfig:
    """Every option (`OPTIONS` of the declaration) is an SPLAConfig field."""
    return SPLAConfig(**fields, **options)


def _blocks(n: int, what: str) -> str:
    return f"the {what} block" if n == 1 else f"the {n} {what} blocks"


def _within_budget(dtype: str) -> str:
    """What the card may say of a context inside the budget, in the weights' dtype."""
    if dtype == "float32":
        return ("While the context fits the budget, the model computes what the dense model computes: in float32 "
                "its logits equal the dense model's up to rounding (the package's tests allow 1e-4).")
    return (f"While the context fits the budget, every layer attends to every key, as the dense layer does; in "
            f"{dtype} the two may round differently, so the logits match the dense model's closely but not bit "
            "for bit (an Evaluation section, where present, gives the measured KL).")


def card_notes(config: SPLAConfig) -> dict[str, str]:
    """The model card's description of the selection, filled from the converted config, and the
    one-line summary of the settings."""
    forced = [_blocks(config.num_local_blocks, "most recent")]
    if config.num_sink_blocks:
        forced.insert(0, _blocks(config.num_sink_blocks, "first"))
    window = config.sliding_window
    return {
        "budget": f"{config.top_k_blocks} blocks x {config.block_size} tokens = {config.budget_tokens} tokens",
        "block_size": str(config.block_size),
        "top_k_blocks": str(config.top_k_blocks),
        "forced_blocks": " and ".join(forced) + " always included, the current partial block among the recent ones",
        "selection": {"taylor": "a second-order Taylor score (block mean and variance)",
                      "mean": "a first-order score (the block mean)"}[config.selection],
        "residual": ("the tokens it skips are summarised by a residual linear-attention term whose per-head "
                     "RMSNorm gain gamma is initialised to zero" if config.use_rla else
                     "the tokens it skips are not attended (the residual linear-attention term is off)"),
        "window_note": (f"The source attended over a sliding window of {window} tokens; SPLA layers attend over "
                        "the whole context, so beyond the window the conversion differs from the source."
                        if window and "sliding_attention" not in config.mixer_types else ""),
        "within_budget": _within_budget(str(config.dtype).removeprefix("torch.")),
        "summary": (f"budget {config.top_k_blocks} blocks x {config.block_size} tokens = {config.budget_tokens} "
                    f"tokens, {config.selection} selection, residual term {'on' if config.use_rla else 'off'}"),
    }


CONVERTER = Converter(build_config, card_notes=card_notes)
