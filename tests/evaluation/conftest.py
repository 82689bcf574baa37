"""Tiny checkpoints with a tokenizer: a 128-token BPE (printable ASCII plus merges) trained here on a
few sentences, saved beside tiny random dense models and their conversions."""

from __future__ import annotations

import json
import string

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from subquadratic.conversion import convert
from subquadratic.evaluation.retrieval import TEMPLATES

from ..conftest import make_dense

VOCAB = 128  # the TINY config's vocab_size
TEXT = [
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "Once upon a time there was a little model that read long documents and remembered them.",
    "def area(width, height):\n    return width * height\n",
] + [t.intro + t.filler for t in TEMPLATES.values()]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    tok.decoder = decoders.Fuse()
    alphabet = list(string.printable[:-2])  # letters, digits, punctuation, space, tab, newline
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<eos>"], initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet), show_progress=False)
    tok.train_from_iterator(TEXT, trainer)
    assert tok.get_vocab_size() <= VOCAB
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A held-out .jsonl file of a few thousand tokens."""
    path = tmp_path_factory.mktemp("data") / "heldout.jsonl"
    lines = [json.dumps({"text": f"{TEXT[i % len(TEXT)]} Number {i}."}) for i in range(120)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer):
    """{"dense": folder, "dense2": another dense model, "spla": the dense model converted to SPLA}."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, seed in (("dense", 0), ("dense2", 1)):
        model = make_dense("llama", seed=seed)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out[name] = root / name
    out["spla"] = convert(str(out["dense"]), str(root / "spla"), "spla", options={"block_size": 8, "top_k_blocks": 4},
                          progress=False)
    return out
