"""Under autocast the mixers hand their kernels operands in the autocast dtype (bf16, fp32
accumulation inside), not the fp32 that the qk-norm's weights and RoPE's cos / sin promote q and k to,
and the logits and gradients stay within bf16 rounding of the fp32 model. Every family, with qk-norm
and RoPE where the family has them, on CPU autocast (CUDA autocast runs the same code)."""

from __future__ import annotations

import pytest
import torch

from subquadratic import HLAForCausalLM
from subquadratic.families.hla import modeling as hla_modeling
from subquadratic.families.hla.configuration import tiny_hla_config
from subquadratic.families.spla import modeling as spla_modeling
from subquadratic.families.sse import modeling as sse_modeling
from subquadratic.modeling.base import autocast_operands

from .spla.tiny import tiny_spla
from .sse.test_modeling_sse import model as sse_model

#: (module whose dispatch is spied on, dispatch name, number of leading tensor operands, model)
FAMILIES = {
    # budget 2 x 8 = 16 slots under 40 tokens: the sparse path, not the dense one
    "spla": (spla_modeling, "spla_attention", 3,
             lambda: tiny_spla(qk_norm=True, top_k_blocks=3, num_local_blocks=1, num_sink_blocks=1)),
    "hla": (hla_modeling, "hla_attention", 3, lambda: HLAForCausalLM(tiny_hla_config(qk_norm=True, hla_rope=True))),
    "sse": (sse_modeling, "sse_attention", 5, lambda: sse_model("tiny", 0, qk_norm=True)),
}


def spy_dtypes(monkeypatch, module, name: str, n: int) -> list[tuple[torch.dtype, ...]]:
    """Record the dtypes of the first n operands of every call of module.name."""
    seen = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(tuple(a.dtype for a in args[:n]))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_autocast_hands_the_kernels_bf16_operands_and_stays_close_to_fp32(family, monkeypatch, one_thread):
    module, name, n, build = FAMILIES[family]
    model = build().train()
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    seen = spy_dtypes(monkeypatch, module, name, n)

    def run(autocast: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return out.logits.float(), grads

    want, want_grads = run(False)
    assert seen and all(d == (torch.float32,) * n for d in seen)
    seen.clear()
    got, got_grads = run(True)
    assert seen and all(d == (torch.bfloat16,) * n for d in seen), seen
    rel = (got - want).norm() / want.norm()
    assert rel < 2e-2, rel
    assert got_grads.keys() == want_grads.keys()
    total = torch.cat([g.flatten() for g in want_grads.values()]).norm()
    err = torch.cat([(got_grads[k] - g).flatten() for k, g in want_grads.items()]).norm()
    assert err / total < 5e-2, err / total


def test_autocast_operands_casts_only_under_autocast():
    x, d = torch.randn(3), torch.randn(3, dtype=torch.float64)
    assert autocast_operands(x, d) == (x, d)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b, i = autocast_operands(x, d, torch.arange(3))
    assert a.dtype == torch.bfloat16 and torch.equal(a, x.bfloat16())
    assert b.dtype == torch.float64 and i.dtype == torch.long  # autocast leaves fp64 and integers alone
