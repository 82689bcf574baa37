"""The command line: every failure is one line naming the problem and the fix, exit status 2, and
nothing half-written; a failed push keeps the complete folder and says how to push it later;
`convert --help` answers without importing torch."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from subquadratic.cli import main

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("subquadratic"), err
    return lines[0]


def test_help_is_fast_lists_every_family_and_imports_no_torch():
    t0 = time.perf_counter()
    r = run_cli("-X", "importtime", "-m", "subquadratic.cli", "convert", "--help")
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert not {"torch", "transformers", "safetensors"} & imported
    for flag in ("--spla-top-k-blocks", "--sse-top-k", "--sse-softmax-every", "--hla-softmax-every", "--dtype"):
        assert flag in r.stdout
    assert "float16" in r.stdout and "source's" in r.stdout  # --dtype says what it does
    assert elapsed < 2.0, f"convert --help took {elapsed:.1f} s"


@pytest.mark.parametrize(("argv", "expect"), [
    (["convert", "a", "b", "--to", "spla2"], "invalid choice: 'spla2' (choose from 'hla', 'spla', 'sse', 'sse-h')"),
    (["convert", "a", "b"], "required: --to"),
    (["convert", "a", "b", "--to", "spla", "--spla-block-size", "x"], "invalid int value: 'x'"),
    (["nope"], "invalid choice: 'nope'"),
])
def test_usage_errors_are_one_line(argv, expect, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    out = capsys.readouterr()
    line = one_error_line(out.err)
    assert expect in line and "--help" in line and out.out == ""


def test_usage_error_from_the_command_is_one_line(tmp_path):
    r = run_cli("-m", "subquadratic.cli", "convert", str(tmp_path / "a"), str(tmp_path / "b"), "--to", "spla2")
    assert r.returncode == 2 and "choose from" in one_error_line(r.stderr) and r.stdout == ""
    assert not (tmp_path / "b").exists()


def _no_leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize(("extra", "expect"), [
    (["--spla-block-size", "3"], "block_size must be a power of two"),
    (["--sse-top-k", "2"], "--sse-top-k is an option of --to sse, not --to spla"),
    (["--private"], "--private applies to --push-to-hub"),
])
def test_conversion_errors_are_one_line_and_write_nothing(dense_checkpoint, tmp_path, capsys, extra, expect):
    _, src = dense_checkpoint("llama")
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["convert", str(src), str(out), "--to", "spla", "--no-progress", *extra]) == 2
    assert expect in one_error_line(capsys.readouterr().err)
    assert not out.exists() and not _no_leftovers(tmp_path)


def test_gguf_source_gets_a_hint(tmp_path, capsys):
    (tmp_path / "smollm2").mkdir()
    gguf = tmp_path / "smollm2" / "model-q4.gguf"
    gguf.write_bytes(b"GGUF")
    for src in (gguf, gguf.parent):
        assert main(["convert", str(src), str(tmp_path / "out"), "--to", "spla"]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "GGUF" in line and "gguf_file='model-q4.gguf'" in line and "save_pretrained" in line


def test_mistyped_hub_id_is_one_line(tmp_path, capsys, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    def missing(repo_id, **kw):
        err = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its constructor differs across versions
        Exception.__init__(err, f"404 Client Error.\n\nRepository Not Found for url: {repo_id}.\nPlease check")
        raise err

    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    assert main(["convert", "metaa-llama/Llama-3.2-1B", str(tmp_path / "out"), "--to", "spla"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "metaa-llama/Llama-3.2-1B not found" in line and "check the id" in line

    def offline(repo_id, **kw):
        raise OSError("Got: ConnectError: name not known\nAn error happened while trying to locate the files")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert main(["convert", "org/name", str(tmp_path / "out"), "--to", "spla"]) == 2
    assert "check the id and the network" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_failed_push_keeps_the_complete_folder_and_says_how_to_push_later(dense_checkpoint, tmp_path, capsys,
                                                                           monkeypatch):
    import huggingface_hub

    def no_credentials(self, *a, **kw):
        raise huggingface_hub.errors.LocalTokenNotFoundError("Token is required (`token=True`), but no token found.\n"
                                                             "You need to log in")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", no_credentials)
    _, src = dense_checkpoint("llama")
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["convert", str(src), str(out), "--to", "spla", "--no-progress", "--push-to-hub", "me/llama-spla",
                 "--private"])
    captured = capsys.readouterr()
    assert code == 2 and f"wrote {out}" in captured.out
    line = one_error_line(captured.err)
    assert f"complete at {out}" in line and f"subquadratic push {out} me/llama-spla --private" in line
    assert AutoModelForCausalLM.from_pretrained(out) is not None  # the folder is complete and loads
    capsys.readouterr()

    uploads = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: f"https://hf.co/{repo_id}")
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **kw: uploads.append(kw))
    assert main(["push", str(out), "me/llama-spla", "--private"]) == 0
    assert uploads[0]["folder_path"] == str(out) and uploads[0]["repo_id"] == "me/llama-spla"
    assert main(["push", str(tmp_path), "me/x"]) == 2
    assert "has no config.json" in one_error_line(capsys.readouterr().err)
