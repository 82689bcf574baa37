"""The plan of the decoder's fused elementwise ops (`fused.plan_fused`, `FusedPlan`): inputs -> fields,
fields a caller sets, the plan made once per forward and read by the modules, `set_plan("fused", ...)`."""

from __future__ import annotations

import pytest
import torch

from subquadratic.kernels.utils import triton_available
from subquadratic.modeling import fused
from subquadratic.modeling.fused import FusedPlan, plan_fused

KERNELS = dict(rms_norm="kernel", silu_mul="kernel", rope="kernel", add_norm="kernel")
TORCH = dict(rms_norm="torch", silu_mul="torch", rope="torch", add_norm="torch")
BASE = dict(dtype=torch.bfloat16, device="cuda", backend="auto", hidden_size=64, head_dim=16)

#: (plan_fused's keywords over BASE, the fields planned): on CUDA with a kernel backend every op takes its
#: kernel; "torch", the CPU, fp64 operands or weights take none; sizes the kernels refuse leave their op out.
CASES = [
    ({}, KERNELS),
    ({"backend": "triton"}, KERNELS),
    ({"dtype": torch.float32}, KERNELS),
    ({"backend": "torch"}, TORCH),
    ({"device": "cpu"}, TORCH),
    ({"dtype": torch.float64}, TORCH),
    ({"weight_dtype": torch.float64}, TORCH),
    ({"head_dim": 15}, {**KERNELS, "rope": "torch"}),
    ({"head_dim": 1 << 20}, {**KERNELS, "add_norm": "torch"}),
    ({"hidden_size": 1 << 20}, {**KERNELS, "rms_norm": "torch"}),
    ({"silu": False}, {**KERNELS, "silu_mul": "torch"}),
    ({"backend": "torch", "rope": "kernel"}, {**TORCH, "rope": "kernel"}),  # a field the caller sets
    ({"rms_norm": "torch"}, {**KERNELS, "rms_norm": "torch"}),
]


@pytest.mark.skipif(not triton_available(), reason="the CUDA plans need Triton installed")
@pytest.mark.parametrize("kw,want", CASES)
def test_the_plan_of_each_input(kw, want):
    kw = {**BASE, **kw}
    plan = plan_fused(kw.pop("dtype"), kw.pop("device"), grad=True, **kw)
    assert plan == FusedPlan(**want, grad=True)


def test_a_plan_refuses_what_is_not_a_field_or_a_path():
    with pytest.raises(TypeError, match="not fields of FusedPlan"):
        plan_fused(torch.float32, "cpu", norm="kernel")
    with pytest.raises(ValueError, match="FusedPlan.rope must be one of"):
        plan_fused(torch.float32, "cpu", rope="fast")


def test_without_triton_or_cuda_every_op_takes_the_pytorch_form():
    assert plan_fused(torch.float32, "cpu", backend="auto", hidden_size=64, head_dim=16) == FusedPlan()
    if not triton_available():
        assert plan_fused(torch.float32, "cuda", backend="auto", hidden_size=64, head_dim=16) == FusedPlan()


def test_the_plan_is_made_once_per_forward_and_read_by_the_modules(monkeypatch):
    """One plan per forward, shared by every decoder layer, mixer and the final norm; the modules take the
    path it gives (rms_norm="kernel": the norm kernel in every norm) and `set_plan("fused")` without fields
    plans from the inputs again."""
    from subquadratic.kernels import rms_norm as rms_module

    from .sse.test_modeling_sse import model as sse_model

    model = sse_model("tiny-h", 0)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    made, real = [], fused.plan_fused
    monkeypatch.setattr(fused, "plan_fused", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    norms = []
    monkeypatch.setattr(fused, "rms_norm_kernel", lambda *a, **kw: norms.append(1) or rms_module.rms_norm(*a, **kw))
    monkeypatch.setattr(fused, "add_rms_norm_kernel",
                        lambda *a, **kw: norms.append(1) or rms_module.add_rms_norm(*a, **kw))
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        assert len(made) == 1 and made[0].rms_norm == "torch" and not norms
        if triton_available():
            model.set_plan("fused", rms_norm="kernel")
            forced = model(ids, use_cache=False).logits
            assert len(made) == 2 and made[1].rms_norm == "kernel"
            assert len(norms) == 2 * model.config.num_hidden_layers + 1  # two per layer and the final norm
            torch.testing.assert_close(forced, plain, rtol=1e-5, atol=1e-5)
        model.set_plan("fused")
        model(ids, use_cache=False)
    assert made[-1].rms_norm == "torch" and len(norms) in (0, 2 * model.config.num_hidden_layers + 1)


@pytest.mark.skipif(not triton_available(), reason="the kernels run under Triton's interpreter")
def test_a_model_planned_as_on_cuda_takes_every_kernel_with_the_same_logits(monkeypatch):
    """`set_plan("fused", device="cuda")`: every fused op on its kernel (under the interpreter), the logits
    of the PyTorch forms."""
    from subquadratic.kernels import triton_rms_norm, triton_rope

    from .sse.test_modeling_sse import model as sse_model

    model = sse_model("tiny-h", 0)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    plain = model(ids, use_cache=False).logits  # with gradients: the kernels' autograd functions run
    calls = []
    for owner in (triton_rms_norm.RMSNormFn, triton_rope.Rope):
        monkeypatch.setattr(owner, "apply", lambda *a, _real=owner.apply: calls.append(1) or _real(*a))
    model.set_plan("fused", device="cuda")
    forced = model(ids, use_cache=False).logits
    assert len(calls) > 2 * model.config.num_hidden_layers
    torch.testing.assert_close(forced, plain, rtol=1e-5, atol=1e-5)


def test_set_plan_names_the_fused_op():
    from .sse.test_modeling_sse import model as sse_model

    model = sse_model("tiny-h", 0)
    model.set_plan("fused", rope="kernel")
    assert model.model.plan_settings["fused"] == {"rope": "kernel"}
    model.set_plan("fused")
    assert "fused" not in model.model.plan_settings


def test_a_call_sets_fields_over_the_models_settings(monkeypatch):
    """A forward's `plan_settings` (what a captured step's capture passes, `fused.captured_step`) set fields
    over the model's (`set_plan`), op by op, for that call only; the model's settings stay as they were."""
    from .sse.test_modeling_sse import model as sse_model

    model = sse_model("tiny-h", 0)
    model.set_plan("fused", rope="torch")
    model.set_plan("softmax", path="eager")
    made, real = [], fused.plan_fused
    monkeypatch.setattr(fused, "plan_fused", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    settings = fused.captured_step(True)
    assert settings == {"fused": {"compiled": True, "recorded": True}}
    merged = model.model.call_plan_settings(settings)
    assert merged == {"fused": {"rope": "torch", "compiled": True, "recorded": True}, "softmax": {"path": "eager"}}
    with torch.no_grad():
        model.model(ids, use_cache=False, plan_settings=fused.captured_step(False))
        assert made[-1] == FusedPlan(recorded=True)  # the model's rope="torch", the call's two fields
        model.model(ids, use_cache=False)
    assert made[-1] == FusedPlan() and model.model.plan_settings["fused"] == {"rope": "torch"}
