"""Registration of the built-in families: once, at the registry's first read; Transformers' Auto
classes know them after `import subquadratic` in either import order; the command line answers
`--help` and usage errors without importing torch or Transformers. Each check that depends on what
a process has imported runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Every built-in model type through AutoConfig and AutoModelForCausalLM, in the current process.
CHECK_AUTO = textwrap.dedent("""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    for model_type, name in (("spla", "SPLA"), ("sse", "SSE"), ("hla", "HLA")):
        config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=64)
        assert type(config).__name__ == name + "Config", type(config)
        assert type(AutoModelForCausalLM.from_config(config)).__name__ == name + "ForCausalLM"
        assert type(AutoModel.from_config(config)).__name__ == name + "Model"
    print("auto classes ok")
""")


def run_python(code: str) -> str:
    """Run `code` in a fresh interpreter with this checkout first on the path; returns its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize("first", [
    "import subquadratic",  # the package first, then Transformers
    "import transformers\nfrom transformers import AutoModelForCausalLM\nimport subquadratic",  # the other way round
    "from subquadratic import SPLAForCausalLM",  # Transformers first imported by the package's own model code
    "from subquadratic.families.sse.configuration import SSEConfig",  # ... by a configuration module alone
    "import subquadratic.modeling.base",  # ... by the shared decoder
])
def test_auto_classes_know_every_family_after_import_subquadratic(first):
    assert "auto classes ok" in run_python(first + "\n" + CHECK_AUTO)


def test_import_subquadratic_imports_no_torch_and_registers_at_the_first_read():
    out = run_python(textwrap.dedent("""
        import sys
        import subquadratic
        from subquadratic import registry
        assert "torch" not in sys.modules and "transformers" not in sys.modules
        assert registry.families(load=False) == []  # nothing registered before the first read
        spla = registry.get_family("spla")  # the first read registers every built-in, once
        assert [f.name for f in registry.families(load=False)] == ["spla", "sse", "hla"]
        assert registry.get_family("spla") is spla and registry.mixer("hla").__name__ == "HLAAttention"
        assert registry.convert_target("sse-h")[0] is registry.get_family("sse")
        print("lazy ok")
    """))
    assert "lazy ok" in out


@pytest.mark.parametrize("argv", [
    ["convert", "--help"],  # help: exit 0
    ["convert", "a", "b"],  # a usage error: --to missing, exit 2
    ["convert", "a", "b", "--to", "sse-h", "--sse-top-k", "x"],  # a bad option value, exit 2
])
def test_command_line_answers_help_and_usage_errors_without_torch(argv):
    code = textwrap.dedent(f"""
        import sys
        from subquadratic.cli import main
        try:
            main({argv!r})
        except SystemExit as e:
            print("exit", e.code)
        print("imported", sorted(m for m in ("torch", "transformers", "safetensors") if m in sys.modules))
    """)
    out = run_python(code)
    assert ("exit 0" if "--help" in argv else "exit 2") in out
    assert "imported []" in out


def test_builtin_declarations_name_their_model_type():
    from subquadratic import families
    from subquadratic.registry import get_family

    for module in families.BUILTIN:
        assert families.config_class(module).model_type == module.NAME
        family = get_family(module.NAME)
        assert family.name == family.model_type == module.NAME and family.card == module.CARD
        assert family.card.is_file() and family.cli_options() == {f"--{module.NAME}-{k}": v for k, v in
                                                                   ((k, {"dest": k.replace("-", "_"), **kw})
                                                                    for k, kw in module.OPTIONS.items())}


def test_a_family_may_not_take_another_family_s_target_name():
    from subquadratic.registry import Family, get_family, register_family

    sse = get_family("sse")
    clone = Family(config_class=type("HybridConfig", (sse.config_class,), {"model_type": "sse_clone"}),
                   model_class=sse.model_class, causal_lm_class=sse.causal_lm_class, mixers={},
                   convert_presets={"sse-h": {}})
    with pytest.raises(ValueError, match=r"target name\(s\) \['sse-h'\] already taken by family 'sse'"):
        register_family(clone, auto_classes=False)
