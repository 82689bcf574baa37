"""Folders saved before the families moved into `subquadratic/families/<family>/` still load from the
package: their config.json names the same model types (and an older remote-code entry module,
`family_<model_type>.py`), and with the package installed Transformers builds the package's classes
without running the folder's bundled code, whatever its old flat file names."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from subquadratic.registry import get_family

from .spla.tiny import tiny_spla

#: Files a folder of the earlier layout carried: flat modules named after the old paths
#: (subquadratic/modeling/spla.py -> modeling_spla.py, ...) and the entry module.
OLD_FILES = ("family_{t}.py", "modeling_{t}.py", "configuration_{t}.py", "modeling_base.py", "modeling_cache.py",
             "registry.py")


def tiny(model_type: str):
    if model_type == "spla":
        return tiny_spla()
    torch.manual_seed(0)
    fam = get_family(model_type)
    return fam.causal_lm_class(fam.preset("tiny")).eval()


@pytest.mark.parametrize("model_type", ["spla", "sse", "hla"])
def test_folder_of_the_earlier_layout_loads_from_the_package(model_type, tmp_path):
    model = tiny(model_type)
    model.save_pretrained(tmp_path)
    names = {"AutoConfig": type(model.config).__name__, "AutoModel": type(model.model).__name__,
             "AutoModelForCausalLM": type(model).__name__}
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["auto_map"] == {k: f"{'configuration' if k == 'AutoConfig' else 'modeling'}_{model_type}.{v}"
                               for k, v in names.items()}
    cfg["auto_map"] = {k: f"family_{model_type}.{v}" for k, v in names.items()}  # the names old folders hold
    for f in tmp_path.glob("*.py"):
        f.unlink()
    for name in OLD_FILES:  # stale code that must not run
        (tmp_path / name.format(t=model_type)).write_text("raise ImportError('the bundled code ran')\n")
    cfg[f"{model_type}_backend"] = "reference"  # an older config's per-family backend field
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model) and loaded.config.kernel_backend == "torch"
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
