"""Plot what one layer of a model folder attends to exactly, from the weights that
`output_attentions=True` returns: for an SPLA layer, the softmax over the key blocks its selection
picked (zeros elsewhere), so the picture shows the selected blocks of every query; for a softmax
layer, its full attention map.

    python -m scripts.tools.plot_attention ./llama-spla --file doc.txt --max-tokens 2048 --layer 5 --out layer5.png

Both panels show one KV head's group of query heads (`--kv-head`, default 0; SPLA selects the
blocks once per group). Left: the weights averaged over the group (log scale). Right: per query
(row) and key block (column), whether the selection took the block. Prints the budget and how many
blocks the last query read. Runs on CPU; needs matplotlib (`pip install 'subquadratic[eval]'`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def selected_blocks(weights, block_size: int):
    """weights [G, T, S] of one group -> bool [T, ceil(S / block_size)]: the key blocks any head put weight on."""
    import torch.nn.functional as F

    touched = (weights > 0).any(0).float()  # [T, S]
    nb = -(-touched.shape[-1] // block_size)
    touched = F.pad(touched, (0, nb * block_size - touched.shape[-1]))
    return touched.view(touched.shape[0], nb, block_size).amax(-1) > 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="model folder with tokenizer files")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the text to run")
    source.add_argument("--file", help="a text file to run")
    p.add_argument("--max-tokens", type=int, default=1024, help="first N tokens of the text (default 1024)")
    p.add_argument("--layer", type=int, default=None, help="layer index (default: the first SPLA layer)")
    p.add_argument("--kv-head", type=int, default=0, help="KV head whose query heads are shown (default 0)")
    p.add_argument("--out", default="attention.png", help="PNG to write (default attention.png)")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import subquadratic  # noqa: F401  (registers the model types)

    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    text = args.text if args.text is not None else Path(args.file).read_text()
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, : args.max_tokens]
    kinds = model.config.mixer_types
    layer = args.layer if args.layer is not None else next((i for i, k in enumerate(kinds) if k == "spla"), 0)
    with_weights = model.weight_layers()  # `attentions` holds one entry per such layer, in order
    if layer not in with_weights:
        print(f"plot_attention: layer {layer} is a {kinds[layer]!r} layer, which keeps a state and forms no attention "
              f"weights; choose --layer from {with_weights}", file=sys.stderr)
        return 2
    with torch.no_grad():
        out = model(ids, output_attentions=True, use_cache=False)
    weights = out.attentions[with_weights.index(layer)]
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    weights = weights[0, args.kv_head * group:(args.kv_head + 1) * group].float()  # [G, T, S]
    block = getattr(model.config, "block_size", None) if kinds[layer] == "spla" else None
    fig, axes = plt.subplots(1, 2 if block else 1, figsize=(12 if block else 6, 5), squeeze=False)
    shown = weights.mean(0).clamp(min=1e-6).log10()
    im = axes[0, 0].imshow(shown.numpy(), aspect="auto", interpolation="nearest", cmap="viridis")
    axes[0, 0].set(title=f"layer {layer} ({kinds[layer]}), KV head {args.kv_head}: log10 weight", xlabel="key",
                   ylabel="query")
    fig.colorbar(im, ax=axes[0, 0])
    if block:
        sel = selected_blocks(weights, block)
        axes[0, 1].imshow(sel.numpy(), aspect="auto", interpolation="nearest", cmap="Greys")
        axes[0, 1].set(title=f"selected blocks of {block} keys (budget {model.config.top_k_blocks})",
                       xlabel="key block", ylabel="query")
        print(f"layer {layer}: {ids.shape[1]} tokens, budget {model.config.top_k_blocks} blocks of {block}; "
              f"the last query read {int(sel[-1].sum())} of {sel.shape[1]} blocks")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
