"""Packed batches in the configurations the real-model ablations convert to (SSE's gated-delta base, 8
partitions, the normalised window merge, window sinks; HLA's normalised form, RoPE, AHLA, the window
branch): a packed batch's logits are each document's own, and training on it reaches a finite loss.
The shared model checks run each family's default configuration; these run the variants."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from subquadratic.families.hla.modeling import HLAForCausalLM
from tests.models.hla.test_modeling_hla import tiny_hla_config
from tests.models.sse.test_modeling_sse import lively

pytestmark = pytest.mark.usefixtures("one_thread")

SSE_VARIANTS = [dict(sse_base="gdn"), dict(sse_num_partitions=8), dict(sse_window_merge="norm"),
                dict(sse_sliding_window=4, sse_window_sinks=2),
                dict(sse_window_sinks=2, sse_kv_heads="source", sse_window_qkv="shared")]
HLA_VARIANTS = [dict(hla_normalize=True), dict(hla_rope=True), dict(hla_variant="ahla", hla_normalize=True),
                dict(hla_sliding_window=8, hla_window_sinks=2, hla_normalize=True)]


def build(family: str, options: dict):
    if family == "sse":
        return lively("tiny-swa", 0, **options)
    return HLAForCausalLM(tiny_hla_config(hla_chunk_size=8, **options))


@pytest.mark.parametrize("family, options", [("sse", o) for o in SSE_VARIANTS] + [("hla", o) for o in HLA_VARIANTS],
                         ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
def test_packed_batch_of_each_variant_is_its_documents(family, options):
    m = build(family, options).eval()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, m.config.vocab_size, (n,), generator=g) for n in (12, 21, 5, 8, 7)]
    flat = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
    with torch.no_grad():
        alone = torch.cat([m(d[None], use_cache=False).logits[0] for d in docs])
        packed = m(flat["input_ids"], position_ids=flat["position_ids"]).logits[0]
    assert (packed - alone).abs().max().item() <= 1e-4 * alone.abs().max().item()
    m.train()
    loss = m(flat["input_ids"], position_ids=flat["position_ids"], labels=flat["labels"]).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in m.parameters() if p.requires_grad)
