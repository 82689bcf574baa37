"""`subquadratic serve`: a converted folder behind Transformers' OpenAI-compatible server, end to
end over HTTP on 127.0.0.1 (chat and text completions, streaming and not, the same text as the
model's own greedy `generate()`), Transformers' model manager loading our classes, and the
one-line refusals."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from subquadratic import serving
from tests.conftest import CHAT_TEMPLATE, make_dense, word_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("fastapi", reason="serving needs subquadratic[serve]")
pytest.importorskip("uvicorn", reason="serving needs subquadratic[serve]")

ROOT = Path(__file__).resolve().parents[1]
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama with the word tokenizer, converted to SPLA with a 12-token budget (a chat prompt
    and its answer outgrow it, so decoding runs the sparse path)."""
    from subquadratic.conversion import convert

    tok = word_tokenizer()
    root = tmp_path_factory.mktemp("serve")
    dense = make_dense("llama", vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    dense.save_pretrained(root / "dense")
    tok.save_pretrained(root / "dense")
    out = convert(str(root / "dense"), str(root / "spla"), "spla", options={"block_size": 4, "top_k_blocks": 3},
                  progress=False)
    return str(out)


def greedy(folder: str, text: str, max_new_tokens: int) -> str:
    """What the model's own generate() writes after `text`, decoded as the server decodes it."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, stream: bool = False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        if not stream:
            return json.loads(resp.read())
        events = []
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
        return events


@contextlib.contextmanager
def running_server(server_args: list[str], log_path: Path, env: dict[str, str], *, wait: float = 120,
                   cwd: Path | None = None) -> Iterator[str]:
    """`python -m subquadratic serve SERVER_ARGS --host 127.0.0.1 --port P` (a free loopback port) as a
    subprocess, its output in `log_path`: yields its base URL once /health answers (a server that exits
    or does not answer within `wait` seconds fails the test), and stops it at the end."""
    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([sys.executable, "-m", "subquadratic", "serve", *server_args, "--host", "127.0.0.1",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait
        while True:
            assert proc.poll() is None, f"the server exited: {log_path.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"no /health within {wait:.0f} s: {log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()


@pytest.fixture(scope="module")
def server(folder):
    """`subquadratic serve FOLDER` as a subprocess on a free loopback port; killed at the end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with running_server([folder, "--device", "cpu"], Path(folder).parent / "server.log", env) as base:
        yield base


def test_chat_completions_streaming_and_not(server, folder):
    messages = [{"role": "user", "content": "the value of the first line"}]
    body = {"model": folder, "messages": messages, "max_tokens": 8, "temperature": 0}
    reply = post(server + "/v1/chat/completions", body)
    text = reply["choices"][0]["message"]["content"]
    prompt = word_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == greedy(folder, prompt, 8) and text.strip()
    assert reply["usage"]["completion_tokens"] <= 8
    events = post(server + "/v1/chat/completions", {**body, "stream": True}, stream=True)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert streamed == text
    assert any(e["choices"][0].get("finish_reason") for e in events if e.get("choices"))


def test_completions_streaming_and_not(server, folder):
    body = {"model": folder, "prompt": "a list of the data", "max_tokens": 6, "temperature": 0}
    reply = post(server + "/v1/completions", body)
    text = reply["choices"][0]["text"]
    assert text == greedy(folder, body["prompt"], 6) and text.strip()
    events = post(server + "/v1/completions", {**body, "stream": True}, stream=True)
    assert "".join(e["choices"][0].get("text") or "" for e in events if e.get("choices")) == text


def test_models_lists_the_pinned_folder(server, folder):
    from transformers.cli.serving.model_manager import ModelManager

    if not hasattr(ModelManager, "list_models"):
        pytest.skip("this Transformers' /v1/models lists the Hub cache only (and fails where there is none)")
    with urllib.request.urlopen(server + "/v1/models", timeout=30) as resp:
        listed = json.loads(resp.read())
    assert [m["id"] for m in listed["data"]] == [folder]


def test_transformers_model_manager_loads_the_family_classes(folder):
    """The class lookup of Transformers' server (`getattr(transformers, architectures[0])`) finds the
    family's class once exposed, on the module object the model manager holds; from Transformers 5.25
    (a process per model, loading with a copy of the server's loader) through `FamilyModelLoader`,
    which a spawned process unpickles by name and which exposes the classes there itself."""
    import pickle

    from transformers.cli.serving import model_manager

    from subquadratic import SPLAForCausalLM

    if hasattr(model_manager, "ModelLoader"):
        loader = pickle.loads(pickle.dumps(serving.FamilyModelLoader(device="cpu")))
        assert type(loader).__module__ == "subquadratic.serving"
        model, processor = loader.load_model_and_processor(folder)
        assert type(model) is SPLAForCausalLM and processor.chat_template == CHAT_TEMPLATE
        return
    serving.expose_model_classes()
    manager = model_manager.ModelManager(device="cpu")
    model, processor = manager.load_model_and_processor(manager.process_model_name(folder))
    try:
        assert type(model) is SPLAForCausalLM and processor.chat_template == CHAT_TEMPLATE
    finally:
        manager.shutdown()


def run_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "subquadratic", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_refusals_are_one_line(tmp_path, folder, monkeypatch):
    missing = run_cli("serve", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no config.json" in missing.stderr
    assert missing.stderr.startswith("subquadratic serve: error: ")
    batching = run_cli("serve", folder, "--continuous-batching")
    assert batching.returncode == 2 and "drop --continuous-batching" in batching.stderr
    monkeypatch.setattr(serving, "find_spec", lambda name: None if name in ("fastapi", "uvicorn") else object())
    with pytest.raises(serving.ServeError, match=r"needs fastapi, uvicorn .*pip install 'subquadratic\[serve\]'"):
        serving.check(folder, [])


def test_every_serve_failure_is_one_line_with_the_serve_prefix_and_help_names_the_command(folder, capsys):
    from subquadratic.cli import main

    for argv, said in ((["serve", folder, "--no-such-option"], "No such option '--no-such-option'"),
                       (["serve", folder, "--port", "eighty"], "'eighty' is not a valid integer"),
                       (["serve", "--bogus", folder], "unrecognized argument --bogus"),
                       (["serve", folder, "--continuous-batching"], "drop --continuous-batching")):
        try:
            code = main(argv)
        except SystemExit as e:  # a usage error of the command line itself
            code = e.code
        assert code == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("subquadratic serve: error: ") and said in err, (argv, err)
    assert main(["serve", folder, "--help"]) == 0
    shown = capsys.readouterr().out
    assert shown.splitlines()[0] == "Usage: subquadratic serve [OPTIONS] [FOLDER]" and "--port" in shown


def test_a_server_that_fails_to_start_is_one_line(folder, capsys, monkeypatch):
    from subquadratic.cli import main

    class Failing:
        def main(self, *a, **kw):
            raise OSError("[Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address already "
                          "in use")

    monkeypatch.setattr(serving, "_serve_command", Failing)
    assert main(["serve", folder, "--port", "8000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("subquadratic serve: error: the server stopped: OSError: ")
    assert "address already in use" in err and "the port is free" in err

    class Interrupted:
        def main(self, *a, **kw):
            raise KeyboardInterrupt

    monkeypatch.setattr(serving, "_serve_command", Interrupted)
    assert main(["serve", folder]) == 130
    assert capsys.readouterr().err == "subquadratic serve: interrupted; the server stopped\n"
