"""`subquadratic convert`: one-line errors that leave nothing behind, overwrite rules, clean-up after a
failure, push to the Hub (SPLA as the target)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from subquadratic.cli import main
from subquadratic.conversion import core


def tree_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def convert(src, out, *extra):
    return main(["convert", str(src), str(out), "--to", "spla", "--no-progress", *extra])


def _siblings(path: Path) -> set[str]:
    return {p.name for p in path.parent.iterdir()}


def expect_error(capsys, args, text, out):
    before = _siblings(out)
    inside = tree_digest(out) if out.exists() else None
    capsys.readouterr()  # drop earlier output (e.g. progress bars of the fixture's save)
    try:
        code = main(["convert", *map(str, args), "--no-progress"])
    except SystemExit as e:  # a usage error (a bad option value): refused while the arguments are parsed
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0], err
    assert _siblings(out) == before  # nothing half-written next to OUT
    assert (tree_digest(out) if out.exists() else None) == inside  # OUT untouched


def test_errors_are_one_line_exit_2_and_leave_nothing(dense_checkpoint, tmp_path, capsys):
    _, src = dense_checkpoint("llama")
    out = tmp_path / "out"
    expect_error(capsys, [src, out, "--to", "spla", "--spla-block-size", "48"], "power of two", out)
    expect_error(capsys, [src, out, "--to", "spla", "--spla-top-k-blocks", "2"], "smaller than sink + local", out)
    expect_error(capsys, [tmp_path / "nope", out, "--to", "spla"], "does not exist", out)
    expect_error(capsys, [src, src / "inside", "--to", "spla"], "overlaps the source", out)
    expect_error(capsys, [src, src, "--to", "spla"], "overlaps the source", out)

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    expect_error(capsys, [gpt2, out, "--to", "spla"], "'gpt2' is not supported; supported: llama", out)

    noconf = tmp_path / "noconf"
    noconf.mkdir()
    expect_error(capsys, [noconf, out, "--to", "spla"], "no config.json", out)

    # a missing shard, a corrupt shard, weights that disagree with the config
    for name, damage, text in [
        ("missing", lambda d: next(d.glob("model-00002-*")).unlink(), "is missing"),
        ("corrupt", lambda d: next(d.glob("model-00001-*")).write_bytes(b"garbage"), "not a readable safetensors"),
        ("gqa", lambda d: _edit_config(d, num_key_value_heads=1), "do not match the weights"),
        ("badjson", lambda d: (d / "config.json").write_text("{"), "not valid JSON"),
    ]:
        bad = tmp_path / name
        bad.mkdir()
        for p in src.iterdir():
            (bad / p.name).write_bytes(p.read_bytes())
        damage(bad)
        expect_error(capsys, [bad, out, "--to", "spla"], text, out)


def _edit_config(folder: Path, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_overwrite_rules(dense_checkpoint, tmp_path, capsys):
    _, src = dense_checkpoint("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    expect_error(capsys, [src, out, "--to", "spla"], "pass --overwrite", out)
    assert (out / "keep.txt").read_text() == "user data"
    assert convert(src, out, "--overwrite") == 0
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert _siblings(out) == {"out", "dense-llama"}


def test_failure_mid_conversion_cleans_up(dense_checkpoint, tmp_path, monkeypatch):
    _, src = dense_checkpoint("llama")
    out = tmp_path / "out"

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(core, "save_file", boom)
    with pytest.raises(RuntimeError):
        core.convert(str(src), str(out), "spla", progress=False)
    assert _siblings(out) == {"dense-llama"}


def test_push_to_hub_uploads_finished_folder(dense_checkpoint, tmp_path, monkeypatch):
    _, src = dense_checkpoint("llama")
    calls = {}

    class FakeApi:
        def create_repo(self, repo_id, private=False, exist_ok=False):
            calls["create"] = (repo_id, private)
            return f"https://hub.example/{repo_id}"

        def upload_folder(self, folder_path, repo_id, commit_message=""):
            calls["upload"] = (sorted(p.name for p in Path(folder_path).iterdir()), repo_id)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    assert convert(src, tmp_path / "o", "--push-to-hub", "me/tiny-spla", "--private") == 0
    assert calls["create"] == ("me/tiny-spla", True)
    assert "config.json" in calls["upload"][0] and calls["upload"][1] == "me/tiny-spla"


def test_option_of_another_family_is_refused(dense_checkpoint, tmp_path, capsys):
    from subquadratic.registry import families

    others = [f for f in families() if f.name != "spla" and f.options]
    if not others:
        pytest.skip("only SPLA conversion is registered")
    flag = next(iter(others[0].cli_options()))
    _, src = dense_checkpoint("llama")
    out = tmp_path / "o"
    value = "2"
    expect_error(capsys, [src, out, "--to", "spla", flag, value], f"{flag} is an option of --to", out)
