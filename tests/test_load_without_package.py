"""A converted folder loads where only torch and Transformers are: the card's "How to load" snippet,
run as the card prints it in an isolated interpreter (`python -I`: no PYTHONPATH, no working folder
on the path) in which importing the package fails, loads the tokenizer and the model without asking
whether to run the code and without Transformers' "model of type" warning, and generates what the
package's own classes generate. The interpreter checks at the end that no module of the package (or
of the tests) was loaded from anywhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from subquadratic.conversion import convert
from tests.conftest import make_dense, word_tokenizer

ROOT = Path(__file__).resolve().parents[1]

#: run first: any import of the package or of the tests fails, and is recorded
PRELUDE = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = ("subquadratic", "tests")
    tried = []

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                tried.append(name)
                raise ImportError(f"{name} is not installed here")
            return None

    sys.meta_path.insert(0, Block())
""")
#: run last: nothing of the package was imported, and the model is the folder's own code
EPILOGUE = textwrap.dedent("""
    import os
    ours = tuple(os.path.join(sys.argv[1], d) + os.sep for d in BLOCKED)  # the package's and the tests' files
    loaded = [n for n, m in sys.modules.items() if n.split(".")[0] in BLOCKED
              or os.path.realpath(getattr(m, "__file__", None) or "/").startswith(ours)]
    assert not loaded, loaded
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    print("GENERATED", out[0].tolist())
""")


def card_snippet(folder: Path) -> str:
    """The first Python block of the card's "How to load" section, for this folder."""
    card = (folder / "README.md").read_text()
    section = card[card.index("## How to load"):]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1).replace("<this folder or repo>",
                                                                                   str(folder))


@pytest.mark.parametrize("to", ["spla", "sse", "sse-h", "hla", "hla-h"])
def test_the_cards_snippet_loads_the_folder_with_only_torch_and_transformers(tmp_path, to):
    tok = word_tokenizer()
    dense = make_dense("llama", vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    dense.save_pretrained(tmp_path / "dense")
    tok.save_pretrained(tmp_path / "dense")
    folder = convert(str(tmp_path / "dense"), str(tmp_path / to), to, progress=False)
    snippet = card_snippet(folder)
    assert "trust_remote_code=True" in snippet and "import subquadratic" not in snippet
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-I", "-c", PRELUDE + snippet + EPILOGUE, str(ROOT)], cwd=tmp_path,
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert "Do you wish to run the custom code" not in said and "to instantiate a model of type" not in said, said
    ours_tok = AutoTokenizer.from_pretrained(folder)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = ours.generate(**ours_tok("Once upon a time", return_tensors="pt"), max_new_tokens=32)
    assert said.split("GENERATED ")[1].splitlines()[0] == str(want[0].tolist())
