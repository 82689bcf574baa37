"""The conversion options that the length-generalisation ablations vary: the initial decay range of
SSE and HLA (`--sse-decay-init-min/max`, `--hla-decay-init-min/max`) and softmax layers chosen by
measurement (`--<family>-softmax-layers auto:K`). Each changes what it should and nothing else, the
conversion stays reproducible, and the config round-trips through save / load."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from subquadratic import layer_choice
from subquadratic.cli import main as cli_main
from subquadratic.conversion import ConversionError, convert
from subquadratic.families.hla.modeling import initial_decay_logits
from subquadratic.families.sse.modeling import gla_decay_bias, initial_decays
from subquadratic.layer_choice import Calibration, choose_softmax_layers
from tests.adaptation.conftest import VOCAB, corpus_files, train_tokenizer
from tests.adaptation.test_adapt import weights as tensors
from tests.conftest import make_dense
from tests.conversion.test_sse import dense_source

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("to, flags, fields, biases", [
    ("sse-h", ["--sse-decay-init-min", "0.99", "--sse-decay-init-max", "0.9999"],
     dict(sse_decay_init_min=0.99, sse_decay_init_max=0.9999), ("g1_bias", "g2_bias")),
    ("hla", ["--hla-decay-init-min", "0.5", "--hla-decay-init-max", "0.999"],
     dict(decay_init_min=0.5, decay_init_max=0.999), ("decay_bias",)),
])
def test_decay_range_sets_the_decay_biases_alone_and_round_trips(to, flags, fields, biases, tmp_path):
    dense_source("llama", tmp_path / "src")
    base, ranged, again = tmp_path / "base", tmp_path / "ranged", tmp_path / "again"
    softmax = ["--sse-softmax-every", "2"] if to == "sse-h" else ["--hla-softmax-every", "2"]
    for out, extra in ((base, []), (ranged, flags), (again, flags)):
        assert cli_main(["convert", str(tmp_path / "src"), str(out), "--to", to, "--no-progress", *softmax,
                         *extra]) == 0
    cfg = AutoConfig.from_pretrained(ranged)
    assert {k: getattr(cfg, k) for k in fields} == fields
    reloaded = AutoModelForCausalLM.from_pretrained(ranged).config
    assert {k: getattr(reloaded, k) for k in fields} == fields
    reloaded.save_pretrained(tmp_path / "saved")
    assert {k: getattr(AutoConfig.from_pretrained(tmp_path / "saved"), k) for k in fields} == fields

    a, b, c = tensors(base), tensors(ranged), tensors(again)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(b[k], c[k]) for k in b)  # reproducible
    changed = sorted(k for k in a if not torch.equal(a[k], b[k]))
    assert changed and all(k.rsplit(".", 1)[-1] in biases for k in changed)
    assert all(k.startswith(("model.layers.0.", "model.layers.2.")) for k in changed)  # the converted layers
    lo, hi = fields.values()
    if to == "sse-h":
        d = cfg.head_dim
        want = gla_decay_bias(initial_decays(d, lo, hi), cfg.sse_gate_normalizer).repeat(cfg.num_attention_heads)
        alpha = torch.sigmoid(b["model.layers.0.self_attn.g1_bias"].double()) ** (1 / cfg.sse_gate_normalizer)
        assert alpha.min().item() == pytest.approx(lo, abs=1e-6) and alpha.max().item() == pytest.approx(hi, abs=1e-6)
        g2 = b["model.layers.0.self_attn.g2_bias"]
        torch.testing.assert_close(g2, want.to(g2))
    else:
        alpha = torch.sigmoid(b["model.layers.0.self_attn.decay_bias"].double())
        assert alpha.min().item() == pytest.approx(lo, abs=1e-6) and alpha.max().item() == pytest.approx(hi, abs=1e-6)
        torch.testing.assert_close(b["model.layers.0.self_attn.decay_bias"],
                                   initial_decay_logits(cfg.num_attention_heads, lo, hi))


def test_decay_range_out_of_bounds_is_one_line(tmp_path, capsys):
    dense_source("llama", tmp_path / "src")
    capsys.readouterr()  # the source's save progress
    rc = cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "hla", "--no-progress",
                   "--hla-decay-init-min", "0.99", "--hla-decay-init-max", "0.9"])
    err = capsys.readouterr().err
    assert rc == 2 and "--hla-decay-init-min <= --hla-decay-init-max" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def priced_source(tmp_path_factory):
    """A 4-layer dense model with a tokenizer, whose layer 1 attends to nothing (o_proj = 0) and whose
    layer 2 writes 20 times louder into the residual stream: replacing layer 1 costs nothing, layer 2
    the most."""
    tmp = tmp_path_factory.mktemp("priced")
    files, _ = corpus_files(tmp / "corpus")
    tok = train_tokenizer(files)
    model = make_dense("llama", vocab_size=VOCAB, num_hidden_layers=4, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.zero_()
        model.model.layers[2].self_attn.o_proj.weight.mul_(20.0)
    model.save_pretrained(tmp / "dense")
    tok.save_pretrained(tmp / "dense")
    return tmp / "dense", [str(f) for f in files]


CALIBRATION = dict(steps=4, seq_len=32, batch_size=2, device="cpu")


@pytest.mark.parametrize("to", ["sse-h", "hla"])
def test_auto_layers_keep_softmax_where_replacement_costs_most(to, priced_source, tmp_path):
    src, files = priced_source
    prefix = "sse" if to == "sse-h" else "hla"
    # SSE-H's window shorter than the 32-token rows: a window that covers them is the source attention
    # exactly (a fresh prefill attends over the new tokens as causal rows), with nothing to price
    options = {"softmax_layers": "auto:2", **({"sse_sliding_window": 8} if to == "sse-h" else {})}
    outs = []
    for name in ("a", "b"):
        out = layer_choice.convert(str(src), str(tmp_path / name), to, options=options, progress=False,
                                   calibration=Calibration(data=files, **CALIBRATION))
        outs.append(out)
    costs = json.loads((outs[0] / "layer_costs.json").read_text())
    by_layer = {c["layer"]: c for c in costs["layers"]}
    assert sorted(by_layer) == [0, 1, 2, 3]  # every layer priced, with every layer replaced
    assert by_layer[1]["cost"] == 0.0 and by_layer[1]["relative_error"] is None
    assert all(by_layer[i]["cost"] > 0 for i in (0, 2, 3))
    assert max(by_layer, key=lambda i: by_layer[i]["cost"]) == 2
    chosen = costs["chosen"]
    assert 2 in chosen and 1 not in chosen and len(chosen) == 2
    assert chosen == choose_softmax_layers(costs["layers"], 2)
    assert json.loads((outs[1] / "layer_costs.json").read_text()) == costs  # reproducible
    cfg = AutoConfig.from_pretrained(outs[0])
    assert [i for i, t in enumerate(cfg.mixer_types) if t == "full_attention"] == chosen
    assert all(t == prefix for i, t in enumerate(cfg.mixer_types) if i not in chosen)
    card = (outs[0] / "README.md").read_text()
    assert f"`softmax_layers`: {','.join(map(str, chosen))} (auto:2" in card
    a, b = tensors(outs[0]), tensors(outs[1])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_auto_layers_from_the_command_line_and_its_errors(priced_source, tmp_path, capsys):
    src, files = priced_source
    out = tmp_path / "out"
    rc = cli_main(["convert", str(src), str(out), "--to", "hla", "--hla-softmax-layers", "auto:1", "--no-progress",
                   "--calibration-data", *files, "--calibration-steps", "2"])
    assert rc == 0
    costs = json.loads((out / "layer_costs.json").read_text())
    assert costs["settings"]["steps"] == 2 and costs["settings"]["data"] == files
    assert AutoConfig.from_pretrained(out).mixer_types.count("full_attention") == 1
    for value, text in (("auto:0", "choose K in 1..3"), ("auto:4", "choose K in 1..3"), ("auto:x", "auto:K")):
        capsys.readouterr()
        rc = cli_main(["convert", str(src), str(tmp_path / "bad"), "--to", "sse-h", "--sse-softmax-layers", value,
                       "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 2 and text in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "bad").exists()
    capsys.readouterr()
    rc = cli_main(["convert", str(src), str(tmp_path / "bad"), "--to", "sse-h", "--calibration-steps", "3",
                   "--no-progress"])
    assert rc == 2 and "auto:K" in capsys.readouterr().err
    with pytest.raises(ConversionError, match="steps must be at least 2"):
        layer_choice.convert(str(src), str(tmp_path / "bad"), "hla", options={"softmax_layers": "auto:1"},
                             progress=False, calibration=Calibration(data=files, steps=1))
    # the converter alone does not measure: it refuses a measured layout, naming what does
    with pytest.raises(ConversionError, match="subquadratic.layer_choice.convert"):
        convert(str(src), str(tmp_path / "bad"), "hla", options={"softmax_layers": "auto:1"}, progress=False)
    assert not (tmp_path / "bad").exists()


def test_layer_costs_on_rows_that_pack_several_documents(priced_source, tmp_path):
    """Short calibration documents pack several to a row: the residual stream is then in the packed
    layout and the mixers run one document per row, and the pricing hooks mask each in its own layout."""
    from subquadratic.data import batches, load_texts, tokenize_and_pack
    from subquadratic.layer_choice import layer_costs

    src, files = priced_source
    lines = [ln for ln in open(files[0]).read().splitlines() if len(ln.strip()) > 20][:120]
    short = []
    for i in range(0, len(lines), 3):
        f = tmp_path / f"doc{i}.txt"
        f.write_text("\n".join(lines[i:i + 3]))
        short.append(str(f))
    tok = AutoTokenizer.from_pretrained(src)
    batch = next(batches(tokenize_and_pack(load_texts(short), tok, 64), 2, 0))
    assert batch["position_ids"].eq(0).sum() > 2  # more documents than rows: a packed batch
    costs = layer_costs(src, "hla", {"softmax_layers": "auto:1"},
                        Calibration(data=short, steps=2, seq_len=64, batch_size=2, device="cpu"))
    by_layer = {c["layer"]: c for c in costs["layers"]}
    assert sorted(by_layer) == [0, 1, 2, 3]
    assert by_layer[1]["cost"] == 0.0
    assert all(0 < by_layer[i]["cost"] < float("inf") for i in (0, 2, 3))
    assert max(by_layer, key=lambda i: by_layer[i]["cost"]) == 2


def test_the_pricing_hook_sees_the_whole_residual_stream_entering_a_layer():
    """The residual energy the layer pricing records for layer i is that of the stream entering it (the
    model's hidden state i), though each layer leaves its MLP output for the next norm to add."""
    from subquadratic.layer_choice import _residual

    from ..models.sse.test_modeling_sse import model as sse_model

    model = sse_model("tiny-h", 0)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    sums: dict = {}
    handles = [model.model.layers[i].register_forward_pre_hook(_residual(i, sums), with_kwargs=True) for i in (0, 2)]
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True, use_cache=False).hidden_states
    for h in handles:
        h.remove()
    for i in (0, 2):
        torch.testing.assert_close(sums[i][1], (hidden[i].double() ** 2).sum(), rtol=1e-5, atol=1e-5)
