"""HLA's plan (`kernels/hla/plan.py`): the paths chosen from shapes, dtype, device, gradients, the layer's
settings and the backend (a table of inputs and the fields they give), the fields a caller sets, and the
mixer planning once per forward."""

from __future__ import annotations

import pytest
import torch

from subquadratic.kernels.hla import HLAPlan, plan_hla
from subquadratic.kernels.utils import triton_available

#: (plan_hla's keywords over BASE, the fields of the plan made)
BASE = dict(shape=(2, 17, 4, 16), dtype=torch.bfloat16, device="cuda", qk_norm_l2=True, output_norm_gate=True)
TABLE = [
    (dict(device="cpu", dtype=torch.float32), dict(path="torch", features="torch", norm_gate="torch",
                                                  precision="ieee")),
    ({}, dict(path="triton", features="kernel", norm_gate="kernel", precision="tf32", packed=False)),
    (dict(qk_norm_l2=False, output_norm_gate=False), dict(path="triton", features="torch", norm_gate="torch")),
    (dict(packed=True, grad=True), dict(path="triton", packed=True)),
    # a chunk size the chunked kernels refuse: the PyTorch forms, but one token without gradients takes
    # the fused recurrent kernel (no chunks)
    (dict(chunk_size=24), dict(path="torch", features="kernel")),
    (dict(chunk_size=24, shape=(2, 1, 4, 16)), dict(path="triton")),
    (dict(chunk_size=24, shape=(2, 1, 4, 16), grad=True), dict(path="torch")),
    (dict(dtype=torch.float64), dict(path="torch", features="torch", norm_gate="torch", precision="ieee")),
    (dict(dtype=torch.float32, precision="ieee"), dict(path="triton", precision="ieee")),
    (dict(shape=(2, 17, 4, 512)), dict(features="kernel", norm_gate="torch")),  # past the norm-gate kernel's dims
    (dict(backend="torch"), dict(path="torch", features="torch", norm_gate="torch")),
    (dict(backend="naive"), dict(path="naive", features="torch", norm_gate="torch")),
    (dict(path="definition", features="torch"), dict(path="definition", features="torch", norm_gate="kernel")),
]


@pytest.mark.skipif(not triton_available(), reason="the CUDA plans need Triton installed")
@pytest.mark.parametrize("given,want", TABLE)
def test_the_plan_of_each_input(given, want):
    kw = {**BASE, **given}
    plan = plan_hla(kw.pop("shape"), kw.pop("dtype"), kw.pop("device"), **kw)
    assert {name: getattr(plan, name) for name in want} == want


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="CUDA"):
        plan_hla((1, 4, 2, 16), torch.float32, "cpu", backend="triton")
    if triton_available():  # (without Triton "triton" asks for it first)
        with pytest.raises(ValueError, match="chunk_size"):
            plan_hla((1, 4, 2, 16), torch.float32, "cuda", backend="triton", chunk_size=24)
    with pytest.raises(TypeError, match="not fields of HLAPlan"):
        plan_hla((1, 4, 2, 16), torch.float32, "cpu", fused=True)
    with pytest.raises(ValueError, match="path"):
        HLAPlan("fast")


def test_the_model_plans_once_per_forward(monkeypatch):
    """Every HLA layer of a forward runs on one plan, made once; a caller's field reaches every layer."""
    from subquadratic import HLAForCausalLM
    from subquadratic.families.hla import modeling as hla_modeling
    from subquadratic.families.hla.configuration import tiny_hla_config

    made, used = [], []
    real_plan, real_attention = hla_modeling.plan_hla, hla_modeling.hla_attention
    # spies: the path is the plan's
    monkeypatch.setattr(hla_modeling, "plan_hla", lambda *a, **kw: made.append(real_plan(*a, **kw)) or made[-1])
    monkeypatch.setattr(hla_modeling, "hla_attention",
                        lambda *a, **kw: used.append(kw["plan"]) or real_attention(*a, **kw))
    m = HLAForCausalLM(tiny_hla_config()).eval()
    layers = m.config.mixer_types.count("hla")
    assert layers >= 2
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m(ids, use_cache=False).logits
        assert len(made) == 1 and len(used) == layers and all(p is made[0] for p in used)
        m.set_plan("hla", path="naive")
        got = m(ids, use_cache=False).logits
    assert len(made) == 2 and made[1].path == "naive" and all(p is made[1] for p in used[layers:])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # the recurrence: the chunked form's values
