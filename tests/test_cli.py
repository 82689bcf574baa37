"""The command line: every failure is one line, `subquadratic COMMAND: error: ...`, naming the
problem and the fix, exit status 2, and nothing half-written; what needs no model is refused before
torch is imported (in well under a second), an unknown or renamed option gets the nearest real one;
a failed push keeps the complete folder and says how to push it later; `--help` answers without
importing torch and shows readable value names."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
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


#: the one error prefix: the command's name, then "error:"
ERROR_PREFIX = re.compile(r"^subquadratic( (convert|adapt|eval|push|demo|serve))?: error: ")


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert ERROR_PREFIX.match(lines[0]), err
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
    for command in ("convert", "adapt", "eval", "push", "demo"):  # no internal names as value names
        shown = r.stdout if command == "convert" else run_cli("-m", "subquadratic", command, "--help").stdout
        assert not re.findall(r"(?<!\$)\b[A-Z0-9]+_[A-Z0-9_]+\b", shown), shown
    for shown in ("--spla-block-size N", "--sse-partitions N", "--sse-top-k K", "--hla-softmax-layers I,J",
                  "--sse-softmax-layers retrieval:1/6"):  # value names, and the preset said in flags
        assert shown in r.stdout


def test_top_level_help_says_the_whole_first_sentence():
    r = run_cli("-m", "subquadratic", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "`eval` models, `push` a folder to the Hub, `demo` the embedded default." in text


def test_the_light_tables_of_the_command_line_follow_the_evaluation_suite():
    from subquadratic.cli import EVAL_LENGTHS, EVAL_TASKS
    from subquadratic.evaluation.retrieval import KEYS
    from subquadratic.evaluation.suite import DEFAULT_LENGTHS, TASKS

    assert EVAL_TASKS == TASKS and EVAL_LENGTHS == DEFAULT_LENGTHS and len(KEYS) == 16  # --needles 1..16


def _folder(path: Path, config: dict | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_input_errors_are_refused_before_torch_is_imported(tmp_path):
    """Every mistake that needs no model: one line with the fix, exit 2, torch never imported, each
    answered well under a second (the whole command, interpreter start included, is timed too)."""
    dense = _folder(tmp_path / "dense", {"model_type": "llama"})
    student = _folder(tmp_path / "student", {"model_type": "spla"})
    full = _folder(tmp_path / "full", None)
    (full / "x").write_text("x")
    text = tmp_path / "a.txt"
    text.write_text("hello")
    d, s, f, t = map(str, (dense, student, full, text))
    cases = [
        (["convert", d, f, "--to", "spla"], "output " + f + " is not empty; pass --overwrite"),
        (["convert", d, "o", "--to", "spla", "--spla-block-size", "48"],
         "argument --spla-block-size: 48 is not a power of two; give 32 or 64"),
        (["convert", d, "o", "--to", "spla", "--block-size", "64"], "did you mean --spla-block-size?"),
        (["convert", d, "o", "--to", "spla", "--top-k-blocks", "8"], "did you mean --spla-top-k-blocks?"),
        (["convert", d, "o", "--to", "sse-h", "--softmax-every", "3"], "did you mean --sse-softmax-every?"),
        (["convert", d, "o", "--to", "spla", "--spla-blok-size", "8"], "did you mean --spla-block-size"),
        (["convert", d, "o", "--to", "spla", "--sse-top-k", "2"], "--sse-top-k is an option of --to sse"),
        (["convert", d, "o", "--to", "hla", "--hla-softmax-layers", "1;2"], "not a comma list of layer indices"),
        (["convert", str(tmp_path / "none"), "o", "--to", "spla"], "does not exist; give a checkpoint folder"),
        (["convert", t, "o", "--to", "spla"], "is a file; give the checkpoint folder (or a .gguf file)"),
        (["convert", d, "o", "--to", "spla", "--push-to-hub", "bad id!!"], "is not a valid Hub repo id"),
        (["convert", d, "o", "--to", "spla", "--private"], "--private applies to --push-to-hub"),
        (["convert", d, "o", "--to", "spla", "--eval-data", "none.txt"], "--eval-data none.txt does not exist"),
        (["push", s, "bad id!!"], "REPO 'bad id!!' is not a valid Hub repo id"),
        (["push", f, "me/x"], "is not a checkpoint folder (no config.json)"),
        (["adapt", s, "-o", f, "--data", t], "is not empty; pass --resume to continue its run or --overwrite"),
        (["adapt", s, "-o", "o", "--data", str(tmp_path / "missing.txt")], "missing.txt does not exist"),
        (["adapt", s, "-o", "o", "--data", t, "--loss", "kl"], "--loss kl distils from the dense model"),
        (["adapt", d, "-o", "o", "--data", t], "is a llama model, not a converted one; convert it first"),
        (["adapt", s, "-o", "o", "--data", t, "--teacher", f], "has no config.json"),
        (["adapt", s, "-o", "o", "--data", t, "--max-steps", "0"], "argument --max-steps: 0 is below 1"),
        (["eval", s, "--tasks", "ppl"], "tasks ppl, kl and copy need held-out text: pass --data FILE"),
        (["eval", s, "--tasks", "mqar,bleu"], "unknown task(s) bleu"),
        (["eval", f], "is not a checkpoint folder (no config.json)"),
        (["eval", s, "--device", "gpu0"], "unknown device 'gpu0'"),
        (["eval", s, "--needles", "17"], "--needles must be in 1..16"),
        (["eval", s, "--seq-ln", "64"], "did you mean --seq-len?"),
        (["eval", s, "--seq-len", "1"], "argument --seq-len: 1 is below 2"),
        (["demo", "--max-new-tokens", "0"], "argument --max-new-tokens: 0 is below 1"),
    ]
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys, time
        from subquadratic.cli import main
        out = []
        for argv, _ in {cases!r}:
            err = io.StringIO()
            t0 = time.perf_counter()
            with contextlib.redirect_stderr(err):
                try:
                    code = main(argv)
                except SystemExit as e:
                    code = e.code
            out.append((code, err.getvalue(), time.perf_counter() - t0))
        heavy = sorted(m for m in ("torch", "transformers", "datasets", "safetensors") if m in sys.modules)
        print(json.dumps({{"results": out, "heavy": heavy}}))
    """)
    t0 = time.perf_counter()
    r = run_cli("-c", code)
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.splitlines()[-1])
    assert report["heavy"] == []  # no check imported torch, Transformers or datasets
    for (argv, expect), (code, err, seconds) in zip(cases, report["results"], strict=True):
        assert code == 2, (argv, err)
        assert expect in one_error_line(err), (argv, err)
        assert seconds < 0.5, (argv, seconds)
    assert elapsed < 5.0, f"{len(cases)} refusals took {elapsed:.1f} s in one interpreter"
    one = time.perf_counter()
    r = run_cli("-m", "subquadratic", "convert", d, f, "--to", "spla")
    assert r.returncode == 2 and "is not empty" in one_error_line(r.stderr)
    assert time.perf_counter() - one < 2.0  # the whole command, interpreter start included


@pytest.mark.parametrize(("argv", "expect"), [
    (["convert", "a", "b", "--to", "spla2"],
     "invalid choice: 'spla2' (choose from 'hla', 'hla-h', 'spla', 'sse', 'sse-h')"),
    (["convert", "a", "b"], "required: --to"),
    (["convert", "a", "b", "--to", "spla", "--spla-block-size", "x"], "argument --spla-block-size: 'x' is not an "
                                                                      "integer"),
    (["nope"], "invalid choice: 'nope'"),
    (["convert", "a", "b", "--to", "SSE_H"], "invalid choice: 'sse_h' (choose from 'hla', 'hla-h', 'spla', 'sse', "
                                             "'sse-h'): did you mean 'sse-h'?"),
    (["demo", "--to", "Spla2"], "did you mean 'spla'?"),
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
    # a setting the config refuses, its field names spelled as the flags
    (["--spla-top-k-blocks", "2"], "subquadratic convert: error: invalid settings: --spla-top-k-blocks (2) is "
                                   "smaller than sink + local blocks (1 + 2); raise --spla-top-k-blocks"),
    (["--spla-sink-blocks", "0", "--spla-local-blocks", "1", "--spla-top-k-blocks", "1"], None),
])
def test_conversion_errors_are_one_line_and_write_nothing(dense_checkpoint, tmp_path, capsys, extra, expect):
    _, src = dense_checkpoint("llama")
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["convert", str(src), str(out), "--to", "spla", "--no-progress", *extra])
    if expect is None:  # the smallest valid setting converts
        assert code == 0 and out.is_dir()
        return
    assert code == 2
    assert expect in one_error_line(capsys.readouterr().err)
    assert not out.exists() and not _no_leftovers(tmp_path)


def test_a_file_that_is_not_gguf_is_one_line(tmp_path, capsys):
    (tmp_path / "smollm2").mkdir()
    gguf = tmp_path / "smollm2" / "model-q4.gguf"
    gguf.write_bytes(b"GGUF")
    for src in (gguf, gguf.parent):
        assert main(["convert", str(src), str(tmp_path / "out"), "--to", "spla", "--no-progress"]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "model-q4.gguf is not a readable GGUF file" in line and "download it again" in line
    assert not (tmp_path / "out").exists() and not _no_leftovers(tmp_path)


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
    warned, err = captured.err.split("\n", 1)  # the source has no tokenizer: one warning line first
    assert warned.startswith("subquadratic convert: warning: ") and "no tokenizer files" in warned
    line = one_error_line(err)
    assert f"complete at {out}" in line and f"subquadratic push {out} me/llama-spla --private" in line
    assert AutoModelForCausalLM.from_pretrained(out) is not None  # the folder is complete and loads
    capsys.readouterr()

    uploads = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: f"https://hf.co/{repo_id}")
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **kw: uploads.append(kw))
    assert main(["push", str(out), "me/llama-spla", "--private"]) == 0
    assert uploads[0]["folder_path"] == str(out) and uploads[0]["repo_id"] == "me/llama-spla"
    assert main(["push", str(tmp_path), "me/x"]) == 2
    assert "no config.json" in one_error_line(capsys.readouterr().err)


def test_push_to_an_invalid_repo_id_is_refused_offline(dense_checkpoint, tmp_path, capsys, monkeypatch):
    """No login and no network before the id is known to be valid (huggingface_hub's own check)."""
    import huggingface_hub

    def online(*a, **kw):
        raise AssertionError("went online")

    for name in ("create_repo", "upload_folder", "whoami"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, online)
    _, src = dense_checkpoint("llama")
    capsys.readouterr()
    for repo in ("me/bad name", "a/b/c", "me/x--y"):
        assert main(["push", str(src), repo]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert line.startswith("subquadratic push: error: REPO") and "is not a valid Hub repo id" in line


def test_a_source_without_tokenizer_converts_with_one_warning_and_every_command_refuses_it(dense_checkpoint, tmp_path,
                                                                                          capsys):
    _, src = dense_checkpoint("llama")  # weights and config only
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["convert", str(src), str(out), "--to", "SPLA", "--no-progress"]) == 0  # family names in any case
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("subquadratic convert: warning: "), err
    assert f"{src} has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json)" in err[0]
    assert "tokenizer_config.json" in err[0] and (out / "config.json").is_file()
    data = tmp_path / "train.txt"
    data.write_text("some text\n")
    for argv in (["serve", str(out)], ["eval", str(out), "--seq-len", "64", "--no-progress"],
                 ["adapt", str(out), "-o", str(tmp_path / "adapted"), "--data", str(data)]):
        assert main(argv) == 2, argv
        line = one_error_line(capsys.readouterr().err)
        assert line.startswith(f"subquadratic {argv[0]}: error: ") and "has no tokenizer files" in line, line
        assert "save_pretrained(FOLDER)" in line
    assert not (tmp_path / "adapted").exists()


def test_ctrl_c_during_convert_is_one_line_exit_130_and_leaves_nothing(dense_checkpoint, tmp_path, capsys,
                                                                       monkeypatch):
    from subquadratic.conversion import core

    _, src = dense_checkpoint("llama")
    written = []

    def interrupted(tensors, path, **kw):  # Ctrl-C after the first shard is written
        if written:
            raise KeyboardInterrupt
        written.append(path)
        return save_file(tensors, path, **kw)

    save_file = core.save_file
    monkeypatch.setattr(core, "save_file", interrupted)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["convert", str(src), str(out), "--to", "spla", "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [
        "subquadratic convert: interrupted; nothing was written (the temporary folder is removed; an existing OUT "
        "is untouched)"], err
    assert written and not written[0].exists()  # the half-written temporary folder is gone
    assert not out.exists() and not _no_leftovers(tmp_path)


def test_a_real_ctrl_c_during_convert_is_one_line_exit_130_and_leaves_nothing(tmp_path):
    """SIGINT sent while the converted folder is being evaluated in its temporary folder (--eval-data):
    one line on stderr, no traceback, exit status 130, neither OUT nor a temporary folder left."""
    import os
    import signal

    from tests.conftest import WORDS, make_dense, word_tokenizer

    tok = word_tokenizer()
    make_dense("llama", vocab_size=len(tok), pad_token_id=tok.pad_token_id).save_pretrained(tmp_path / "dense")
    tok.save_pretrained(tmp_path / "dense")
    data = tmp_path / "held.txt"
    # enough text that the evaluation outlasts the signal's delay by far on any CPU (3000 windows of
    # 64 tokens took about a second on a quiet one, so the conversion could finish first)
    data.write_text(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(1_000_000)))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "subquadratic", "convert", str(tmp_path / "dense"), str(out),
                             "--to", "spla", "--no-progress", "--eval-data", str(data), "--eval-seq-len", "64",
                             "--eval-max-windows", "15000"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            # SIGINT as a terminal delivers it, even where this run was started in the
                            # background (`cmd &` in a script starts its children with SIGINT ignored)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not list(tmp_path.glob(".out.tmp-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()  # still converting: the temporary folder exists
    time.sleep(1.0)  # inside the evaluation of the finished temporary folder
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert [line for line in err.splitlines() if line.strip()][-1] == (
        "subquadratic convert: interrupted; nothing was written (the temporary folder is removed; an existing OUT "
        "is untouched)"), err
    assert "Traceback" not in err
    assert not out.exists() and not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")]
