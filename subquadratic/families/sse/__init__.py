"""SSE (`sse`): Sparse State Expansion, declared once; SSE-H is its convert preset `sse-h`.

The whole declaration is data: `NAME`, `OPTIONS`, `CONVERT_PRESETS`, `CARD` (read by the command line
without torch), then `PARTS` and `MIXERS`, naming where `families.family()` finds the rest of the
`registry.Family` in this folder: `configuration.py` (SSEConfig, presets), `modeling.py` (the mixer,
its cache layer, the model classes), `conversion.py` (the Converter); `card.md` is the model card
template.

`convert --to sse` makes every layer an SSE layer (pure SSE, like `--to hla`); `--to sse-h` keeps
softmax attention in a sixth of the layers (the paper's SSE-H has one softmax layer after every five SSE
layers), those holding the dense source's strongest retrieval heads.
"""

from pathlib import Path

from ...checks import int_at_least, layer_list_or_auto, nonnegative_int, positive_int

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
        help="every K-th layer keeps softmax attention (default: none with --to sse; --to sse-h keeps a sixth of "
             "the layers, chosen by retrieval:1/6)",
    ),
    "softmax-layers": dict(
        type=layer_list_or_auto,
        help="comma list of the layers that keep softmax attention, or auto:K: the K layers whose replacement "
             "costs the most, measured by a short attention transfer (--calibration-data), or retrieval:K: the K "
             "layers holding the source's strongest retrieval heads (scored on needle prompts; retrieval:1/N: "
             "a N-th of the layers)",
    ),
    "sliding-window": dict(
        type=int_at_least(0, "W"), dest="sse_sliding_window",
        help="add an in-layer sliding-window softmax branch of this many tokens",
    ),
    "window-merge": dict(
        choices=["norm", "sum"], dest="sse_window_merge",
        help="how the window branch joins the SSE branch: norm, (RMSNorm + RMSNorm) / 2 (default); sum, added, "
             "so that a fresh conversion starts as the sliding-window softmax",
    ),
    "window-sinks": dict(
        type=int_at_least(0, "N"), dest="sse_window_sinks",
        help="the window branch also sees the first N tokens, the attention sinks (default 4 with a window)",
    ),
    "kv-heads": dict(
        choices=["query", "source"], dest="sse_kv_heads",
        help="heads of the SSE layers' k / v projections: query, each source K/V head repeated to its query "
             "heads (the default of --to sse); source, the source's K/V heads, repeated after the projection "
             "(smaller matmuls; the default of --to sse-h)",
    ),
    "window-qkv": dict(
        choices=["own", "shared"], dest="sse_window_qkv",
        help="the window branch's q / k / v: own, projections of its own (the default of --to sse); shared, the "
             "SSE layer's (needs --sse-kv-heads source; the default of --to sse-h)",
    ),
    "base": dict(choices=["gla", "gdn"], dest="sse_base", help="linear-attention base (default gla)"),
    "key-topk": dict(type=nonnegative_int, dest="sse_key_topk",
                     help="row-sparse keys: softmax over the top N entries only"),
    "lora-rank": dict(type=int_at_least(0, "R"), dest="sse_lora_rank",
                      help="rank of the q2/k2 offsets (default head_dim)"),
    "decay-init-min": dict(
        type=float, dest="sse_decay_init_min",
        help="initial decay rate of the shortest-memory key channel (default 0.9; the channels of each head "
             "spread geometrically in 1 - alpha up to --sse-decay-init-max)",
    ),
    "decay-init-max": dict(
        type=float, dest="sse_decay_init_max",
        help="initial decay rate of the longest-memory key channel (default 0.999: a memory of ~1000 tokens)",
    ),
}
#: Conversion targets beside `sse`: option sets under the given options. SSE-H keeps softmax attention in
#: a sixth of the layers, those holding the source's strongest retrieval heads (`retrieval:1/6`: the
#: recall rows of docs/results.md; `--sse-softmax-every 6` keeps every 6th layer), and adds a 64-token
#: window branch (with 4 sinks) to the SSE output of the others: the
#: real-model ablation (docs/results.md) found the window what keeps a conversion good past the length
#: it was adapted at (`--sse-sliding-window 0` converts without it). Its SSE layers keep the source's K/V
#: heads and give the window branch their q / k / v: the same model at conversion, the same quality after
#: adaptation (docs/results.md, 2026-12-04), and fewer projections.
CONVERT_PRESETS: dict[str, dict] = {
    "sse-h": {"softmax_layers": "retrieval:1/6", "sse_sliding_window": 64, "sse_window_merge": "sum",
              "sse_kv_heads": "source", "sse_window_qkv": "shared"},
}
#: Where the rest of the declaration lives: `registry.Family` field -> "module:attribute" of this
#: folder, imported by `families.family()` (the config class alone by `families.config_class()`).
PARTS: dict[str, str] = {
    "config_class": "configuration:SSEConfig",
    "model_class": "modeling:SSEModel",
    "causal_lm_class": "modeling:SSEForCausalLM",
    "converter": "conversion:CONVERTER",
    "presets": "configuration:PRESETS",
}
#: The token mixers the family adds: name in `config.mixer_types` -> "module:class" (cache layer: SSELayer).
MIXERS: dict[str, str] = {"sse": "modeling:SSEAttention"}
