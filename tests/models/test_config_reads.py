"""A config read (`SubquadraticConfig.__getattribute__`) returns what Transformers' own path returns: the
fields read from the instance, properties, aliases (`attribute_map`) and inherited attributes through the
class, values set at run time and copies alike; a field shadowed by a property or an alias takes the class's
path."""

from __future__ import annotations

import copy
import pickle

import pytest
from transformers import PreTrainedConfig

from subquadratic.families.hla.configuration import HLAConfig
from subquadratic.families.spla.configuration import SPLAConfig
from subquadratic.families.sse.configuration import SSEConfig


@pytest.mark.parametrize("cls", [SSEConfig, HLAConfig, SPLAConfig])
def test_every_read_equals_transformers_own(cls):
    c = cls(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    names = [n for n in dir(c) if not n.startswith("__")]
    assert "kernel_backend" in names and "num_key_value_groups" in names
    for name in names:
        try:
            want = PreTrainedConfig.__getattribute__(c, name)
        except Exception as e:  # noqa: BLE001 (a property that raises: the shortcut must raise the same)
            with pytest.raises(type(e)):
                getattr(c, name)
            continue
        got = getattr(c, name)
        again = PreTrainedConfig.__getattribute__(c, name)
        if again is not want and again != want:  # a fresh object at every read (a view): the same kind
            assert type(got) is type(want), name
        else:
            assert got is want or got == want, name


def test_run_time_changes_copies_and_shadowed_names(monkeypatch):
    c = SSEConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    c.kernel_backend = "torch"
    assert c.kernel_backend == "torch"
    assert copy.deepcopy(c).kernel_backend == "torch" and pickle.loads(pickle.dumps(c)).kernel_backend == "torch"
    assert c.lora_rank == c.head_dim  # a property reading two fields
    c.sse_lora_rank = 8
    assert c.lora_rank == 8

    class Shadowed(SSEConfig):
        attribute_map = {"width": "hidden_size"}

        @property
        def marker(self):  # a property over a name the instance dict also holds
            return "from the property"

    s = Shadowed(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    s.__dict__["marker"] = True
    s.__dict__["width"] = 1  # an alias: the read goes to hidden_size, as Transformers' does
    assert s.marker == "from the property"
    assert s.width == 64
