"""A tiny dense checkpoint with a real tokenizer, trained on real text (Python standard-library
sources, present wherever Python is), and converted copies of it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import make_dense

VOCAB = 384
#: standard-library modules of different styles: prose-heavy docstrings and code
SOURCES = ["textwrap.py", "argparse.py", "fractions.py", "shlex.py", "calendar.py", "ipaddress.py"]


def corpus_files(tmp: Path) -> tuple[list[Path], Path]:
    """Training files (copies of standard-library modules) and a held-out one."""
    lib = Path(os.__file__).parent
    tmp.mkdir(parents=True, exist_ok=True)
    out = []
    for name in SOURCES:
        dst = tmp / name.replace(".py", ".txt")
        dst.write_text((lib / name).read_text())
        out.append(dst)
    held = tmp / "heldout.txt"
    held.write_text((lib / "string.py").read_text())
    return out[:-1] + [out[-1]], held


def train_tokenizer(files: list[Path]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return corpus_files(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def dense_folder(tmp_path_factory, corpus):
    files, _ = corpus
    tok = train_tokenizer(files)
    model = make_dense("llama", vocab_size=VOCAB, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    folder = tmp_path_factory.mktemp("dense") / "llama"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def converted(tmp_path_factory, dense_folder):
    """Factory: the dense folder converted to `to` with `options` (cached per setting)."""
    from subquadratic.conversion import convert

    made = {}

    def make(to: str, **options):
        key = (to, tuple(sorted(options.items())))
        if key not in made:
            out = tmp_path_factory.mktemp("converted") / f"{to}-{len(made)}"
            made[key] = convert(str(dense_folder), str(out), to, options=options, progress=False)
        return made[key]

    return make
