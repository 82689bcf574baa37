"""SSE (`sse`): Sparse State Expansion, declared once; SSE-H is its convert preset `sse-h`.

The light part (`NAME`, `OPTIONS`, `CONVERT_PRESETS`, `CARD`; no torch needed: the command line
reads it), then `config_class()` (the configuration module alone) and `family()`, the full
declaration (`registry.Family`), which import the folder's modules: `configuration.py` (SSEConfig,
presets), `modeling.py` (the mixer, its cache layer, the model classes), `conversion.py` (the
Converter); `card.md` is the model card template.

`convert --to sse` makes every layer an SSE layer (pure SSE, like `--to hla`); `--to sse-h` keeps
softmax attention in every 6th layer (five SSE layers, then one softmax layer: the paper's SSE-H).
"""

from pathlib import Path

from ...checks import int_at_least, layer_list, nonnegative_int, positive_int
from ...registry import Family

#: The family's one name: its model type and `convert --to` target.
NAME = "sse"
CARD = Path(__file__).with_name("card.md")
#: `convert` options (`--sse-<key>`; `dest`: the SSEConfig field each one sets, but for the layout).
OPTIONS: dict[str, dict] = {
    "partitions": dict(type=positive_int, dest="sse_num_partitions", help="state partitions N (default 4)"),
    "top-k": dict(type=int_at_least(1, "K"), dest="sse_top_k",
                  help="partitions written and read per token K (default 1)"),
    "softmax-every": dict(
        type=int_at_least(0, "K"),
        help="every K-th layer keeps softmax attention (default: none with --to sse, 6 with --to sse-h: five SSE "
             "layers then one softmax)",
    ),
    "softmax-layers": dict(type=layer_list, help="comma list of the layers that keep softmax attention"),
    "sliding-window": dict(
        type=int_at_least(0, "W"), dest="sse_sliding_window",
        help="add an in-layer sliding-window softmax branch of this many tokens",
    ),
    "base": dict(choices=["gla", "gdn"], dest="sse_base", help="linear-attention base (default gla)"),
    "key-topk": dict(type=nonnegative_int, dest="sse_key_topk",
                     help="row-sparse keys: softmax over the top N entries only"),
    "lora-rank": dict(type=int_at_least(0, "R"), dest="sse_lora_rank",
                      help="rank of the q2/k2 offsets (default head_dim)"),
}
#: Conversion targets beside `sse`: option sets under the given options.
CONVERT_PRESETS: dict[str, dict] = {"sse-h": {"softmax_every": 6}}


def config_class() -> type:
    """The config class alone (what AutoConfig needs; imports no model code)."""
    from .configuration import SSEConfig

    return SSEConfig


def family() -> Family:
    """The full declaration (imports the configuration, model and converter modules)."""
    from .configuration import PRESETS, SSEConfig
    from .conversion import CONVERTER
    from .modeling import SSEAttention, SSEForCausalLM, SSEModel

    return Family(
        config_class=SSEConfig,
        model_class=SSEModel,
        causal_lm_class=SSEForCausalLM,
        mixers={"sse": SSEAttention},  # cache layer: SSELayer
        converter=CONVERTER,
        card=CARD,
        presets=PRESETS,
        options=OPTIONS,
        convert_presets=CONVERT_PRESETS,
    )
