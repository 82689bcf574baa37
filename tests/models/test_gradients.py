"""Every trainable parameter receives a gradient on every path of every family, so plain
DistributedDataParallel (no unused-parameter search, as Transformers' Trainer runs it under
gradient checkpointing) can train any configuration: SPLA inside and beyond its budget, with and
without its residual term, in a hybrid with sliding-window layers; SSE with the GLA and GDN bases,
the window branch, row-sparse keys, no q2/k2 offsets, every partition selected, the SSE-H layout;
HLA with both decay modes, both variants, the normalised form with RoPE, no gate or norm, a hybrid.
Each in training and in evaluation mode (SSE's router loss exists in training only), on plain,
left-padded and packed batches, and with gradient checkpointing. Where a parameter joins the graph
only through an exact zero (SPLA's gain inside the budget), the logits are those of the path without
it."""

from __future__ import annotations

import pytest
import torch

from subquadratic import HLAConfig, HLAForCausalLM, SPLAConfig, SPLAForCausalLM, SSEConfig, SSEForCausalLM
from subquadratic.families.hla.configuration import TINY_PRESETS as HLA_PRESETS
from subquadratic.families.sse.configuration import PRESETS as SSE_PRESETS

pytestmark = pytest.mark.usefixtures("one_thread")

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_SPARSE = dict(block_size=4, top_k_blocks=3, num_local_blocks=1)  # a budget of 12 tokens, inputs of 24
CASES = {
    "spla-dense": (SPLAConfig, SPLAForCausalLM, dict(_SMALL, block_size=8, top_k_blocks=4)),
    "spla-sparse": (SPLAConfig, SPLAForCausalLM, dict(_SMALL, **_SPARSE)),
    "spla-no-rla-dense": (SPLAConfig, SPLAForCausalLM, dict(_SMALL, block_size=8, top_k_blocks=4, use_rla=False)),
    "spla-no-rla-sparse": (SPLAConfig, SPLAForCausalLM, dict(_SMALL, **_SPARSE, use_rla=False)),
    "spla-hybrid-window": (SPLAConfig, SPLAForCausalLM, dict(
        _SMALL, **_SPARSE, num_hidden_layers=3, sliding_window=8,
        mixer_types=["spla", "sliding_attention", "full_attention"])),
    "sse": (SSEConfig, SSEForCausalLM, SSE_PRESETS["tiny"]),
    "sse-h": (SSEConfig, SSEForCausalLM, SSE_PRESETS["tiny-h"]),
    "sse-window": (SSEConfig, SSEForCausalLM, SSE_PRESETS["tiny-swa"]),
    "sse-window-sum": (SSEConfig, SSEForCausalLM, dict(SSE_PRESETS["tiny-swa"], sse_window_merge="sum")),
    "sse-gdn": (SSEConfig, SSEForCausalLM, SSE_PRESETS["tiny-gdn"]),
    "sse-key-topk": (SSEConfig, SSEForCausalLM, dict(SSE_PRESETS["tiny"], sse_key_topk=4)),
    "sse-no-offsets": (SSEConfig, SSEForCausalLM, dict(SSE_PRESETS["tiny"], sse_lora_rank=0)),
    "sse-every-partition": (SSEConfig, SSEForCausalLM, dict(SSE_PRESETS["tiny"], sse_num_partitions=2, sse_top_k=2)),
    "hla": (HLAConfig, HLAForCausalLM, HLA_PRESETS["tiny"]),
    "hla-window": (HLAConfig, HLAForCausalLM, dict(HLA_PRESETS["tiny"], hla_sliding_window=8)),
    "hla-constant-decay": (HLAConfig, HLAForCausalLM, dict(HLA_PRESETS["tiny"], decay_mode="constant")),
    "hla-ahla": (HLAConfig, HLAForCausalLM, dict(HLA_PRESETS["tiny"], hla_variant="ahla")),
    "hla-normalized-rope": (HLAConfig, HLAForCausalLM, dict(HLA_PRESETS["tiny"], hla_normalize=True, hla_rope=True)),
    "hla-no-gate-no-norm": (HLAConfig, HLAForCausalLM, dict(HLA_PRESETS["tiny"], output_gate=False,
                                                            output_norm=False)),
    "hla-hybrid": (HLAConfig, HLAForCausalLM, HLA_PRESETS["tiny-hybrid"]),
}
T = 24
BATCHES = ("plain", "left-padded", "packed")


def make(case: str):
    cfg_cls, model_cls, fields = CASES[case]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**fields))


def batch(kind: str) -> dict:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, 128, (2, T), generator=g)
    if kind == "left-padded":
        mask = torch.ones_like(x)
        mask[1, :5] = 0
        return dict(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100))
    if kind == "packed":  # two documents in one row, position_ids restarting (DataCollatorWithFlattening)
        row = x.reshape(1, 2 * T)
        return dict(input_ids=row, position_ids=torch.cat([torch.arange(20), torch.arange(2 * T - 20)])[None],
                    labels=row)
    return dict(input_ids=x, labels=x)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_trainable_parameter_gets_a_gradient(case, training):
    model = make(case).train(training)
    for kind in BATCHES:
        model.zero_grad(set_to_none=True)
        out = model(**batch(kind), use_cache=False)
        out.loss.backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, f"{kind} batch: no gradient for {missing}"
        assert torch.isfinite(out.loss)


def plain_then_checkpointed(model, b: dict) -> tuple:
    """(loss, gradients) of a plain training step of `model` on batch b, then of the same step after
    `enable_checkpointing` (adapt's and bench_model's): ((ref, want), (loss, got)), gradients by name."""
    from subquadratic.adaptation.train import enable_checkpointing

    steps = []
    for checkpointed in (False, True):
        model.zero_grad(set_to_none=True)
        if checkpointed:
            enable_checkpointing(model)
        loss = model(**b).loss
        loss.backward()
        steps.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    return steps


@pytest.mark.parametrize("case", ["spla-dense", "sse-h", "hla-hybrid"])
def test_every_parameter_gets_a_gradient_under_gradient_checkpointing(case, monkeypatch):
    """`enable_checkpointing` checkpoints every decoder layer, and the recomputed forward gives the loss and
    gradients of the plain step (fp64)."""
    from transformers import modeling_utils

    model = make(case).double().train()
    calls = []
    real = modeling_utils.checkpoint
    monkeypatch.setattr(modeling_utils, "checkpoint", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    (ref, want), (loss, got) = plain_then_checkpointed(model, batch("plain"))
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    missing = [n for n, g in got.items() if g is None]
    assert not missing, f"no gradient for {missing}"
    for n, g in got.items():
        torch.testing.assert_close(g, want[n], rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["spla-sparse", "sse-h", "sse-window", "hla-window", "hla-hybrid"])
def test_checkpointed_steps_on_the_kernels_on_gpu(case):
    """On CUDA (the Triton kernels' Functions, recomputed under non-reentrant checkpointing, where a backward
    that unpacks its saved tensors twice fails): the plain step's loss and gradients, within the rounding of
    a recomputation."""
    model = make(case).cuda().train()
    model.config.kernel_precision = "ieee"
    (ref, want), (loss, got) = plain_then_checkpointed(model, {k: v.cuda() for k, v in batch("plain").items()})
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for n, g in got.items():
        assert g is not None, n
        err = ((g - want[n]).norm() / want[n].norm().clamp_min(1e-12)).item()
        assert err < 1e-3, (n, err)


@pytest.mark.parametrize("case", ["spla-dense", "spla-no-rla-sparse"])
def test_the_exact_zero_changes_nothing(case):
    """SPLA's gain joins the graph through an exact zero where the residual term is zero: logits with
    gradients enabled equal those without, bit for bit, and the gain's gradient is zero."""
    model = make(case).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "rla_norm" in name:
                p.copy_(torch.randn_like(p))  # a gain that would matter if the residual term were not zero
    b = batch("plain")
    with torch.no_grad():
        ref = model(**b).logits
    out = model(**b)
    assert torch.equal(out.logits, ref)
    out.loss.backward()
    gains = [p.grad for n, p in model.named_parameters() if "rla_norm" in n]
    assert gains and all(torch.equal(g, torch.zeros_like(g)) for g in gains)
