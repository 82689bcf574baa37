"""Model cards say what the converted checkpoint is, and only what holds for it: every field filled
from the converted config (SPLA's forced blocks and selection, kept softmax layers and their windows,
the source's qk-norm and biases where it has them, exactness only in float32), the source's Hub id
and license where known, `pipeline_tag`, the package version and the command that made the folder;
nothing left blank."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from subquadratic.conversion import convert


def _card(src, out, to, **options) -> str:
    folder = convert(str(src), str(out), to, options=options, progress=False)
    text = (folder / "README.md").read_text()
    assert "{{" not in text and "}}" not in text
    assert "pypi.org" not in text  # not published there yet
    return text


def test_spla_card_describes_the_settings(dense_checkpoint, tmp_path):
    _, src = dense_checkpoint("llama")
    text = _card(src, tmp_path / "a", "spla")
    assert "the first block and the 2 most recent blocks always included" in text
    assert "second-order Taylor score" in text and "16 blocks x 64 tokens = 1024 tokens" in text
    text = _card(src, tmp_path / "b", "spla", num_sink_blocks=0, num_local_blocks=3, top_k_blocks=8,
                 block_size=16, selection="mean")
    assert "the 3 most recent blocks always included" in text and "first block" not in text
    assert "first-order score" in text and "8 blocks x 16 tokens = 128 tokens" in text
    assert "sliding window" not in text


def test_spla_card_says_a_source_window_is_not_kept(dense_checkpoint, tmp_path):
    _, src = dense_checkpoint("mistral", sliding_window=6)
    assert "sliding window of 6 tokens" in _card(src, tmp_path / "o", "spla")


@pytest.mark.parametrize(("to", "options"), [("sse-h", {"softmax_layers": "1"}), ("hla", {"softmax_layers": "1"})])
def test_hybrid_cards_name_kept_layers_and_windows(dense_checkpoint, tmp_path, to, options):
    _, src = dense_checkpoint("mistral", sliding_window=6)
    assert "softmax layers are: 1 (sliding window 6)" in _card(src, tmp_path / "o", to, **options)


def _front_matter(card: str) -> dict:
    from huggingface_hub import metadata_load

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "README.md").write_text(card)
        return metadata_load(Path(d) / "README.md")


def test_card_metadata_has_the_license_pipeline_version_and_command(dense_checkpoint, tmp_path):
    from subquadratic import __version__

    _, src = dense_checkpoint("llama")
    text = _card(src, tmp_path / "a", "spla", block_size=16)
    meta = _front_matter(text)
    assert meta["pipeline_tag"] == "text-generation" and meta["library_name"] == "transformers"
    assert meta["license"] == "other" and "base_model" not in meta  # a local folder of unknown origin
    assert "the source's card and config name none" in text
    assert f"Converted by subquadratic {__version__} with:" in text
    assert f"subquadratic convert {src} {tmp_path / 'a'} --to spla --spla-block-size 16\n" in text
    text = _card(src, tmp_path / "b", "spla", use_rla=False, num_sink_blocks=0)
    assert "--to spla --spla-sink-blocks 0 --spla-no-rla\n" in text  # in the family's order


def test_card_names_the_hub_id_and_license_of_the_source(dense_checkpoint, tmp_path):
    import shutil

    _, src = dense_checkpoint("llama")
    cached = tmp_path / "hub" / "models--some-org--Tiny-Llama" / "snapshots" / "0123abcd"
    shutil.copytree(src, cached)
    (cached / "README.md").write_text("---\nlicense: other\nlicense_name: tiny-license\nlicense_link: LICENSE\n"
                                      "---\n# Tiny\n")
    meta = _front_matter(_card(cached, tmp_path / "a", "spla"))
    assert meta["base_model"] == "some-org/Tiny-Llama" and meta["license"] == "other"
    assert meta["license_name"] == "tiny-license" and meta["license_link"] == "LICENSE"
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "_name_or_path": "other-org/Llama-Tiny"}))
    (src / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    text = _card(src, tmp_path / "b", "hla")
    meta = _front_matter(text)
    assert meta["base_model"] == "other-org/Llama-Tiny" and meta["license"] == "apache-2.0"
    assert "# other-org/Llama-Tiny converted to HLA" in text and "read from its model card" in text


def test_spla_card_states_exactness_only_in_float32(dense_checkpoint, tmp_path):
    from subquadratic.conversion import convert

    _, src = dense_checkpoint("llama")
    fp32 = _card(src, tmp_path / "a", "spla")
    assert "computes what the dense model computes: in float32" in fp32 and "Weights dtype: float32" in fp32
    bf16 = (convert(str(src), str(tmp_path / "b"), "spla", dtype="bfloat16", progress=False) / "README.md").read_text()
    assert "computes what the dense model computes" not in bf16
    assert "in bfloat16 the two may round differently" in bf16 and "Weights dtype: bfloat16" in bf16


@pytest.mark.parametrize(("kind", "said"), [
    ("llama", None),
    ("llama-bias-tied", "; the source's q/k/v and o biases kept and applied"),
    ("qwen2", "; the source's q/k/v biases kept and applied"),
    ("qwen3", "; the source's qk-norm kept and applied"),
])
@pytest.mark.parametrize("to", ["sse-h", "hla"])
def test_cards_say_only_the_source_attention_parts_that_exist(dense_checkpoint, tmp_path, kind, said, to):
    _, src = dense_checkpoint(kind)
    text = _card(src, tmp_path / "o", to, softmax_layers="1")
    assert ("kept and applied" in text) == (said is not None) and "qk-norm and biases" not in text
    if said:
        assert said in " ".join(text.split())


def test_sse_card_tags_sse_h_only_for_a_hybrid(dense_checkpoint, tmp_path):
    _, src = dense_checkpoint("llama")
    assert _front_matter(_card(src, tmp_path / "a", "sse"))["tags"] == ["subquadratic", "sse", "linear-attention",
                                                                        "long-context"]
    assert "sse-h" in _front_matter(_card(src, tmp_path / "b", "sse-h", softmax_layers="1"))["tags"]
    assert "sse-h" not in _front_matter(_card(src, tmp_path / "c", "sse-h"))["tags"]  # 2 layers: no 6th layer


def test_the_card_records_the_command_line_as_given(dense_checkpoint, tmp_path):
    from subquadratic.cli import main

    _, src = dense_checkpoint("llama")
    out = tmp_path / "my out"
    assert main(["convert", str(src), str(out), "--to", "sse-h", "--sse-top-k", "1", "--no-progress"]) == 0
    assert f"subquadratic convert {src} '{out}' --to sse-h --sse-top-k 1 --no-progress\n" in \
        (out / "README.md").read_text()


def test_a_local_sources_card_gives_its_base_model_and_license(dense_checkpoint, tmp_path):
    """A local folder of unknown Hub id whose card names what it was made from: the conversion's card
    names that model as its base and keeps the source's license; the title names the folder."""
    _, src = dense_checkpoint("llama")
    (src / "README.md").write_text("---\nbase_model: some-org/Base-Llama\nlicense: llama3.2\n---\n# my fine-tune\n")
    text = _card(src, tmp_path / "a", "spla")
    meta = _front_matter(text)
    assert meta["base_model"] == "some-org/Base-Llama" and meta["license"] == "llama3.2"
    assert f"# {src.name} converted to SPLA" in text and "read from its model card" in text
    (src / "README.md").write_text("---\nbase_model:\n- org/a\n- org/b\nlicense: mit\n---\n")  # a merge: no one base
    assert "base_model" not in _front_matter(_card(src, tmp_path / "b", "spla"))


def test_the_recorded_command_has_no_absolute_path_a_shorter_one_says(dense_checkpoint, tmp_path, monkeypatch):
    import shutil

    from subquadratic.cli import main

    _, src = dense_checkpoint("llama")
    home, work = tmp_path / "home", tmp_path / "home" / "work"
    work.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    mine = shutil.copytree(src, home / "models" / "my llama")
    assert main(["convert", str(mine), str(work / "out"), "--to", "spla", "--no-progress"]) == 0
    card = (work / "out" / "README.md").read_text()
    assert "subquadratic convert ~/'models/my llama' out --to spla --no-progress\n" in card
    cached = shutil.copytree(src, home / ".cache" / "huggingface" / "hub" / "models--some-org--Tiny-Llama" / "snapshots"
                             / "0123abcd")
    convert(str(cached), str(work / "b"), "spla", progress=False)  # from Python: the equivalent command
    assert "subquadratic convert some-org/Tiny-Llama b --to spla\n" in (work / "b" / "README.md").read_text()
    outside = tmp_path / "elsewhere"
    convert(str(cached), str(outside), "spla", progress=False)
    assert f"subquadratic convert some-org/Tiny-Llama {outside} --to spla\n" in (outside / "README.md").read_text()


@pytest.mark.parametrize(("to", "before"), [("hla", "must be distilled before use"),
                                            ("sse-h", "not ready to use as it is"), ("spla", None)])
def test_the_adapted_card_describes_the_adapted_model(dense_checkpoint, tmp_path, to, before):
    from subquadratic.cards import ADAPTED_NOTE, adapted_card

    _, src = dense_checkpoint("llama")
    text = _card(src, tmp_path / "a", to)
    if before:
        assert before in text
    adapted = adapted_card(text)
    assert adapted_card(adapted) == adapted  # an adapted model adapted again keeps one note
    title = next(line for line in adapted.splitlines() if line.startswith("# "))
    assert title.endswith(", adapted") and "before use" not in title and "<!--" not in title, title
    assert "before use" not in adapted and "not ready to use" not in adapted and "<!--" not in adapted
    assert adapted.count(ADAPTED_NOTE) == (1 if before else 0)
    assert _front_matter(adapted) == _front_matter(text)


@pytest.mark.parametrize("to", ["spla", "sse-h", "hla"])
def test_the_card_names_the_model_code_files_the_folder_holds(dense_checkpoint, tmp_path, to):
    import re

    _, src = dense_checkpoint("llama")
    folder = convert(str(src), str(tmp_path / to), to, progress=False)
    text = (folder / "README.md").read_text()
    named = set(re.findall(r"`([\w*]+\.py)`", text))
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    assert named == {f"configuration_{model_type}.py", f"modeling_{model_type}.py", "subquadratic_support.py",
                     "subquadratic_triton.py"}, named
    for name in named:
        assert list(folder.glob(name)), name
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert {v.split(".")[0] for v in auto_map.values()} == {f"configuration_{model_type}", f"modeling_{model_type}"}
    assert {p.name for p in folder.glob("*.py")} == named  # the card names every file of the model code
