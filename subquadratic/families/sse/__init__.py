"""SSE / SSE-H (`sse`, converted to as `sse-h`): Sparse State Expansion, declared once."""

from pathlib import Path

from ...registry import Family

NAME = "sse-h"
OPTION_PREFIX = "sse"
#: Model card template of converted checkpoints.
CARD = Path(__file__).with_name("card.md")
#: `convert` options (`--sse-<key>`), readable without importing the model code.
OPTIONS: dict[str, dict] = {
    "partitions": dict(type=int, dest="sse_num_partitions", help="state partitions N (default 4)"),
    "top-k": dict(type=int, dest="sse_top_k", help="partitions written and read per token K (default 1)"),
    "softmax-every": dict(
        type=int,
        help="every K-th layer keeps softmax attention (default 6: five SSE layers then one softmax; 0: pure SSE)",
    ),
    "softmax-layers": dict(help="comma list of the layers that keep softmax attention"),
    "sliding-window": dict(
        type=int, dest="sse_sliding_window",
        help="add an in-layer sliding-window softmax branch of this many tokens",
    ),
    "base": dict(choices=["gla", "gdn"], dest="sse_base", help="linear-attention base (default gla)"),
    "key-topk": dict(type=int, dest="sse_key_topk", help="row-sparse keys: softmax over the top entries only"),
    "lora-rank": dict(type=int, dest="sse_lora_rank", help="rank of the q2/k2 offsets (default head_dim)"),
}


def family() -> Family:
    """The full declaration (imports the configuration, model and converter modules)."""
    from .configuration import PRESETS, SSEConfig
    from .conversion import CONVERTER
    from .modeling import SSEAttention, SSEForCausalLM, SSEModel

    return Family(
        name=NAME,
        config_class=SSEConfig,
        model_class=SSEModel,
        causal_lm_class=SSEForCausalLM,
        mixers={"sse": SSEAttention},  # cache layer: SSELayer
        converter=CONVERTER,
        card=CARD,
        presets=PRESETS,
        options=OPTIONS,
        option_prefix=OPTION_PREFIX,
    )
