"""The vLLM plugin's footprint where vLLM is not installed: importing the package and its plugin
module works and imports no vLLM, and pyproject declares the `vllm` extra and the
`vllm.general_plugins` entry point vLLM reads (the plugin itself: tests/vllm/, in .venv-vllm)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_CHECK = ("import sys, subquadratic, subquadratic.vllm; subquadratic.SSEForCausalLM; "
                "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")


def import_check() -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_package_and_plugin_module_import_no_vllm():
    assert import_check() == "[]"


def test_pyproject_declares_the_extra_and_the_entry_point():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"subquadratic": "subquadratic.vllm:register"}
    assert any(r.startswith("vllm") for r in project["optional-dependencies"]["vllm"])


def test_serve_engine_option_and_its_refusals(tmp_path, monkeypatch, capsys):
    from subquadratic import serving

    assert serving.split_engine(["--port", "8000", "--engine", "vllm"]) == ("vllm", ["--port", "8000"])
    assert serving.split_engine(["--engine=transformers"]) == ("transformers", [])
    (tmp_path / "config.json").write_text("{}")
    assert serving.main(str(tmp_path), ["--engine", "sglang"]) == 2
    assert capsys.readouterr().err.strip() == ("subquadratic serve: error: --engine must be one of transformers, vllm, "
                                               "got 'sglang'")
    monkeypatch.setattr(serving, "find_spec", lambda name: None)
    assert serving.main(str(tmp_path), ["--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'subquadratic[vllm]'" in err
    assert serving.main(str(tmp_path / "nowhere"), ["--engine", "vllm"]) == 2
    assert "no config.json" in capsys.readouterr().err
