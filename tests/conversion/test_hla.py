"""`subquadratic convert --to hla`: every layer softmax equals the dense model; the HLA hybrid copies
every source weight, initialises the new ones as documented, and decodes like its full forward."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from subquadratic import HLAForCausalLM


def rand_ids(B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (B, T), generator=g)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_convert_dense_to_hla(kind, dense_checkpoint, tmp_path):
    from subquadratic.cli import main
    from subquadratic.families.hla.modeling import initial_decay_logits

    dense, src = dense_checkpoint(kind)
    convert = ["convert", str(src), "--to", "hla", "--no-progress"]
    # every layer kept as softmax attention: exactly the dense model (the common weights convert by name)
    assert main([*convert[:2], str(tmp_path / "soft"), *convert[2:], "--hla-softmax-every", "1"]) == 0
    soft = AutoModelForCausalLM.from_pretrained(tmp_path / "soft").eval()
    x = rand_ids(2, 24)
    with torch.no_grad():
        assert (soft(x).logits - dense(x).logits).abs().max().item() <= 1e-4

    out = tmp_path / "hla"
    assert main([*convert[:2], str(out), *convert[2:], "--hla-softmax-layers", "1"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "hla" and cfg["mixer_types"] == ["hla", "full_attention"]
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_hla.HLAForCausalLM"
    assert "must be distilled before use" in (out / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model) is HLAForCausalLM and model.config.source_model_type == kind
    dense_sd, sd = dense.state_dict(), model.state_dict()
    for name, t in dense_sd.items():  # every source weight copied unchanged (HLA and softmax layers)
        if not name.endswith("rotary_emb.inv_freq"):
            assert torch.equal(sd[name], t), name
    attn = model.model.layers[0].self_attn
    assert torch.equal(attn.decay_bias.detach(), initial_decay_logits(4, 0.9, 0.99))
    assert torch.equal(attn.o_norm.weight.detach(), torch.ones(4, model.config.head_dim))
    assert 0 < attn.g_proj.weight.std().item() < 0.05
    with torch.no_grad():  # the converted hybrid runs: cached decode equals the full forward
        full = model(x, use_cache=False).logits
        cache = model.new_cache()
        steps = [model(x[:, :20], cache=cache).logits] + [model(x[:, t : t + 1], cache=cache).logits for t in range(20, 24)]  # noqa: E501
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-4
    assert main([*convert[:2], str(tmp_path / "bad"), *convert[2:], "--hla-softmax-layers", "7"]) == 2
