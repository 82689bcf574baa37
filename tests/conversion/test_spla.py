"""`subquadratic convert --to spla`: fidelity on every supported source while the budget covers the
context, what the converted folder holds, and the untouched residual gains."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from .test_core import convert, tree_digest


@pytest.mark.parametrize("kind", ["llama", "llama-bias-tied", "mistral", "qwen2", "qwen3"])
def test_logits_equal_dense_while_budget_covers_context(kind, dense_checkpoint, tmp_path):
    dense, src = dense_checkpoint(kind)
    before = tree_digest(src)
    out = tmp_path / "spla"
    assert convert(src, out, "--spla-block-size", "16", "--spla-top-k-blocks", "4") == 0
    assert tree_digest(src) == before  # the source is never touched
    assert len(list(out.glob("model-*.safetensors"))) > 1  # streamed shard by shard
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "README.md", "generation_config.json", "modeling_spla.py", "configuration_spla.py"} <= files
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "spla" and cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_spla.SPLAForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.source_model_type == dense.config.model_type
    x = torch.randint(0, 128, (2, 64))  # budget 4 x 16 = 64 tokens
    with torch.no_grad():
        diff = (model(x).logits - dense(x).logits).abs().max().item()
        assert diff <= 1e-4
        y = torch.randint(0, 128, (1, 200))  # beyond the budget: sparse attention from position 64 on
        got, ref = model(y).logits, dense(y).logits
        # gamma = 0: the residual term adds exactly nothing, the conversion is exactly sparse attention
        spa = AutoModelForCausalLM.from_pretrained(out, use_rla=False).eval()
        assert torch.equal(spa(y).logits, got)
    assert (got[:, :64] - ref[:, :64]).abs().max().item() <= 1e-4  # causal: these positions see <= 64 keys
    assert (got[:, 64:] - ref[:, 64:]).abs().max().item() > 1e-2  # later ones do not see every key
    card = (out / "README.md").read_text()
    assert "# dense-" in card and "`block_size`: 16" in card


def test_dtype_option_and_untouched_gamma(dense_checkpoint, tmp_path):
    _, src = dense_checkpoint("qwen3")
    assert convert(src, tmp_path / "o", "--dtype", "bfloat16") == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "o")
    assert model.dtype == torch.bfloat16 and model.config.use_rla
    assert convert(src, tmp_path / "spa", "--spla-no-rla") == 0  # the SPA ablation, declared with the options
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "spa").config.use_rla is False
    gammas = [p for n, p in model.named_parameters() if "rla_norm" in n]
    assert len(gammas) == 2 and all(torch.equal(g, torch.zeros_like(g)) for g in gammas)


def test_beam_search_matches_dense_when_budget_covers_context(dense_checkpoint, tmp_path):
    from subquadratic.cli import main

    dense, src = dense_checkpoint("llama")
    assert main(["convert", str(src), str(tmp_path / "s"), "--to", "spla", "--no-progress"]) == 0
    spla = AutoModelForCausalLM.from_pretrained(tmp_path / "s").eval()
    x = torch.randint(1, 128, (1, 20))
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(spla.generate(x, **kw), dense.generate(x, **kw))
