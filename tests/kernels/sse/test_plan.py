"""SSE's plan (`kernels/sse/plan.py`): the paths chosen from shapes, dtype, device, gradients, the layer's
settings and the backend (a table of inputs and the fields they give), the fields a caller sets and what
follows from them, and the mixer planning once per forward."""

from __future__ import annotations

import pytest
import torch

from subquadratic.kernels.sse import SSEPlan, plan_sse
from subquadratic.kernels.utils import triton_available

#: (plan_sse's keywords over BASE, the fields of the plan made)
BASE = dict(shape=(2, 17, 4, 16), dtype=torch.bfloat16, device="cuda", num_partitions=4, lora=True)
TABLE = [
    # the CPU: the PyTorch forms everywhere
    (dict(device="cpu", dtype=torch.float32), dict(path="torch", features="torch", q2_mode="full", fused=False,
                                                  router="torch", norm_gate="torch", precision="ieee")),
    # CUDA, a chunk without gradients: the features inside the SSE kernels, the norm and gate in their combining one
    ({}, dict(path="triton", features="kernel", q2_mode="offset", fused=True, router="kernel", norm_gate="combine",
              precision="tf32", inplace=False, packed=False)),
    (dict(lora=False), dict(q2_mode="same", fused=True)),
    (dict(qk_norm=True), dict(q2_mode="full", features="kernel", fused=True)),  # the features after the qk-norm
    (dict(grad=True), dict(fused=True, norm_gate="kernel")),
    (dict(packed=True), dict(fused=True, norm_gate="kernel", packed=True)),
    # one token: the feature kernel, then the decode kernel; in place on a cache without gradients
    (dict(shape=(2, 1, 4, 16), cached=True), dict(path="triton", features="kernel", fused=False, norm_gate="kernel",
                                                   inplace=True)),
    (dict(shape=(2, 1, 4, 16), cached=True, grad=True), dict(inplace=False)),
    (dict(key_topk=4), dict(features="torch", q2_mode="full", fused=False, norm_gate="kernel")),
    (dict(key_topk=16), dict(features="kernel", fused=True)),  # the top 16 of 16 entries: no truncation
    (dict(dtype=torch.float64), dict(path="torch", features="torch", router="torch", norm_gate="torch",
                                     precision="ieee")),
    (dict(dtype=torch.float32, precision="ieee"), dict(path="triton", precision="ieee")),
    (dict(base="gdn"), dict(path="torch", features="torch", fused=False, router="kernel", norm_gate="kernel")),
    (dict(chunk_size=48), dict(path="torch", features="kernel", fused=False, norm_gate="kernel")),
    (dict(shape=(2, 17, 4, 192)), dict(path="torch", features="kernel", fused=False)),  # keys past 128
    (dict(shape=(2, 17, 4, 512)), dict(path="torch", features="torch", norm_gate="torch")),
    (dict(num_partitions=300), dict(router="torch", fused=True)),
    (dict(backend="torch"), dict(path="torch", features="torch", router="torch", norm_gate="torch")),
    (dict(backend="naive"), dict(path="naive", features="torch", router="torch", norm_gate="torch")),
    (dict(backend="triton"), dict(path="triton", features="kernel", fused=True)),
    # fields a caller sets, and the fields that follow from them
    (dict(path="masked"), dict(path="masked", features="kernel", fused=False, norm_gate="kernel")),
    (dict(fused=False), dict(path="triton", fused=False, norm_gate="kernel")),
    (dict(device="cpu", dtype=torch.float32, features="kernel"), dict(path="torch", features="kernel", q2_mode="offset",
                                                                       fused=False, norm_gate="torch")),
]


@pytest.mark.skipif(not triton_available(), reason="the CUDA plans need Triton installed")
@pytest.mark.parametrize("given,want", TABLE)
def test_the_plan_of_each_input(given, want):
    kw = {**BASE, **given}
    plan = plan_sse(kw.pop("shape"), kw.pop("dtype"), kw.pop("device"), **kw)
    assert {name: getattr(plan, name) for name in want} == want


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="CUDA"):
        plan_sse((1, 4, 2, 16), torch.float32, "cpu", num_partitions=4, backend="triton")
    if triton_available():  # (without Triton "triton" asks for it first)
        with pytest.raises(ValueError, match="chunk_size"):
            plan_sse((1, 4, 2, 16), torch.float32, "cuda", num_partitions=4, backend="triton", chunk_size=48)
    with pytest.raises(TypeError, match="not fields of SSEPlan"):
        plan_sse((1, 4, 2, 16), torch.float32, "cpu", num_partitions=4, form="tile")
    with pytest.raises(ValueError, match="fused needs"):
        SSEPlan("torch", features="kernel", fused=True)
    with pytest.raises(ValueError, match="combine"):
        SSEPlan("triton", features="kernel", norm_gate="combine")
    with pytest.raises(ValueError, match="path"):
        SSEPlan("fast")


def test_the_model_plans_once_per_forward(monkeypatch):
    """Every SSE layer of a forward runs on one plan, made once (the model's settings over it); a forward
    with other inputs (gradients, one token) plans again."""
    from subquadratic.families.sse import modeling as sse_modeling

    from ...models.sse.test_modeling_sse import model as sse_model

    made, used = [], []
    real_plan, real_attention = sse_modeling.plan_sse, sse_modeling.sse_attention
    # spies: the path is the plan's
    monkeypatch.setattr(sse_modeling, "plan_sse", lambda *a, **kw: made.append(real_plan(*a, **kw)) or made[-1])
    monkeypatch.setattr(sse_modeling, "sse_attention",
                        lambda *a, **kw: used.append(kw["plan"]) or real_attention(*a, **kw))
    m = sse_model("tiny-h", 0)
    layers = m.config.mixer_types.count("sse")
    assert layers >= 2
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = m(ids, use_cache=True)
        m(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
    assert len(made) == 2 and len(used) == 2 * layers
    assert all(p is made[0] for p in used[:layers]) and all(p is made[1] for p in used[layers:])
    assert made[0].inplace and made[1].inplace  # a cache without gradients: the one-token forms write in place
    m.set_plan("sse", path="masked")
    m(ids, use_cache=False).logits.sum().backward()
    assert len(made) == 3 and made[2].path == "masked" and all(p is made[2] for p in used[2 * layers:])
    m.set_plan("sse")  # no fields: planned from the inputs again
    assert m.model.plan_settings == {}
    with pytest.raises(ValueError, match="op must be one of"):
        m.set_plan("sse2", path="masked")
