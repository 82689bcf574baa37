"""A family registered from outside the package through `register_family` alone: converted from a
tiny Llama (Python API and CLI), saved, loaded with and without remote code, and generating."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from subquadratic.cli import main
from subquadratic.conversion import Converter, convert
from subquadratic.registry import Family, get_family, mixer, register_family, unregister_family

from .swa_family import LocalSoftmax, SWAConfig, SWAForCausalLM, SWAModel

CARD = "# {{model_type}} from {{base_model}}\n\nwindow: {{window}} tokens\n\n{{settings}}\n"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    card = tmp_path_factory.mktemp("card") / "swa.md"
    card.write_text(CARD)
    fam = register_family(Family(
        config_class=SWAConfig,
        model_class=SWAModel,
        causal_lm_class=SWAForCausalLM,
        mixers={"local_softmax": LocalSoftmax},
        converter=Converter(
            lambda fields, options: SWAConfig(**fields, **{k: v for k, v in options.items() if v is not None}),
            card_notes=lambda config: {"window": str(config.window)},
        ),
        card=card,
        option_prefix="swa",
        options={"window": dict(type=int, help="tokens each layer attends to")},
        presets={"tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, window=6)},
    ))
    yield fam
    unregister_family(fam.name)
    with pytest.raises(KeyError, match="local_softmax.*is not available"):
        mixer("local_softmax")


def test_registration_reaches_config_validation_and_auto_classes(family):
    assert get_family("swa_test") is family and mixer("local_softmax") is LocalSoftmax
    assert AutoConfig.for_model("swa_test").__class__ is SWAConfig
    with pytest.raises(ValueError, match="local_softmax"):  # the error lists the registered mixers
        SWAConfig(mixer_types=["nope"] * 4)
    model = AutoModelForCausalLM.from_config(family.preset("tiny"))
    assert type(model) is SWAForCausalLM
    assert all(torch.equal(layer.self_attn.out_gain, torch.ones(64)) for layer in model.model.layers)


def test_convert_save_load_remote_code_and_generate(family, dense_checkpoint, tmp_path):
    dense, src = dense_checkpoint("llama")
    x = torch.randint(1, 128, (1, 20))
    # a window covering the context: exactly the dense model
    out = convert(str(src), str(tmp_path / "wide"), "swa_test", options={"window": 64}, progress=False)
    assert "window: 64 tokens" in (out / "README.md").read_text()
    wide = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(wide) is SWAForCausalLM and wide.config.mixer_types == ["local_softmax"] * 2
    with torch.no_grad():
        assert (wide(x).logits - dense(x).logits).abs().max().item() < 1e-4

    # the CLI spells the family's option --swa-window; a window of 6 changes the model
    narrow_dir = tmp_path / "narrow"
    assert main(["convert", str(src), str(narrow_dir), "--to", "swa_test", "--swa-window", "6", "--no-progress"]) == 0
    narrow = AutoModelForCausalLM.from_pretrained(narrow_dir).eval()
    with torch.no_grad():
        want = narrow(x).logits
    assert narrow.config.window == 6 and (want - dense(x).logits).abs().max().item() > 1e-3

    # save -> load, in the package and as remote code without it
    narrow.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        assert torch.equal(again(x).logits, want)
    torch.save((x, want), tmp_path / "io.pt")
    code = (
        "import sys, torch; sys.modules['subquadratic'] = None; sys.modules['tests'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'saved')!r}, trust_remote_code=True).eval()\n"
        "assert not type(m).__module__.startswith(('subquadratic', 'tests')), type(m).__module__\n"
        f"x, want = torch.load({str(tmp_path / 'io.pt')!r})\n"
        "print('maxdiff', (m(x).logits - want).abs().max().item())\n"
        "out = m.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)\n"
        "print('generated', out.shape[1])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert float(res.stdout.split("maxdiff")[1].split()[0]) < 1e-5 and "generated 24" in res.stdout

    # cached greedy generation == argmax of the full forward at every step (the window slides past the prompt)
    gen = narrow.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for t in range(x.shape[1], gen.shape[1]):
            assert narrow(gen[:, :t]).logits[0, -1].argmax().item() == gen[0, t].item()
