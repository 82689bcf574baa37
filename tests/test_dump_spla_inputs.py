"""scripts/tools/dump_spla_inputs.py: the captured q, k, v are the post-RoPE projections the SPLA mixer computes,
and the --quick run writes a loadable file with the documented shapes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .conftest import make_dense

ROOT = Path(__file__).resolve().parent.parent


def _script():
    return importlib.import_module("scripts.tools.dump_spla_inputs")


def test_capture_returns_post_rope_projections(tmp_path):
    from transformers import AutoModelForCausalLM

    from subquadratic.conversion import convert

    make_dense("qwen3").save_pretrained(tmp_path / "dense")  # qk-norm too
    convert(str(tmp_path / "dense"), str(tmp_path / "spla"), "spla", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "spla", dtype=torch.float32).eval()
    ids = torch.randint(1, 128, (1, 40))
    got = _script().capture(model, ids, [1])
    attn, cfg = model.model.layers[1].self_attn, model.config
    with torch.no_grad():  # layer 1's input, then its projections, qk-norm and RoPE by hand
        hidden = model(ids, output_hidden_states=True, use_cache=False).hidden_states[1]
        x = model.model.layers[1].input_layernorm(hidden)
        q = attn.q_norm(attn.q_proj(x).view(1, 40, cfg.num_attention_heads, -1))
        k = attn.k_norm(attn.k_proj(x).view(1, 40, cfg.num_key_value_heads, -1))
        v = attn.v_proj(x).view(1, 40, cfg.num_key_value_heads, -1)
        cos, sin = model.model.rotary_emb(x, torch.arange(40)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    for name, ref in zip("qkv", (q, k, v), strict=True):
        assert got[name].shape == (1, 40, *ref.shape[2:])
        torch.testing.assert_close(got[name][0], ref[0], rtol=1e-5, atol=1e-5)
    assert attn.project.__func__ is type(attn).project  # the wrapper is removed afterwards


def test_quick_run_writes_the_file(tmp_path):
    out = tmp_path / "inputs.safetensors"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-m", "scripts.tools.dump_spla_inputs", str(out), "--quick"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        meta, shapes = f.metadata(), {k: tuple(f.get_tensor(k).shape) for k in f.keys()}
        assert f.get_tensor("q").dtype == torch.bfloat16
    assert shapes == {"q": (2, 256, 4, 16), "k": (2, 256, 2, 16), "v": (2, 256, 2, 16)}
    assert json.loads(meta["layers"]) == [0, 1] and meta["tokens"] == "256"
