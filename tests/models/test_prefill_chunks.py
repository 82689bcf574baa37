"""A long cached call without gradients runs in chunks over its cache (`SubquadraticForCausalLM.prefill_chunk_tokens`):
the same logits and the same cache (the greedy steps after it) as one call, for every family, through a plain
forward and through generate() with its default and static caches, with left padding; calls that need every
activation (gradients, hidden states) or keep no cache run whole."""

from __future__ import annotations

import pytest
import torch

from subquadratic import HLAForCausalLM
from subquadratic.families.hla.configuration import tiny_hla_config
from subquadratic.modeling.base import CACHE_FIELD, SubquadraticForCausalLM

from .common import GEN, left_pad
from .spla.tiny import tiny_spla
from .sse.test_modeling_sse import lively

pytestmark = pytest.mark.usefixtures("one_thread")

# tiny_spla's gamma is random and non-zero (as after adaptation): the chunks carry SPLA's residual term too
FAMILIES = {
    "spla+softmax": lambda: tiny_spla(mixer_types=["spla", "full_attention"], block_size=8, top_k_blocks=3,
                                      num_sink_blocks=1, num_local_blocks=1),
    "hla": lambda: HLAForCausalLM(tiny_hla_config(hla_chunk_size=8)).eval(),
    "sse-h": lambda: lively("tiny-h", 0),
}


def calls(model, monkeypatch) -> list[int]:
    """Records the new tokens of each decoder call."""
    seen = []
    inner = model.model.forward

    def forward(*a, **kw):
        x = kw.get("input_ids") if kw.get("input_ids") is not None else kw.get("inputs_embeds")
        seen.append(x.shape[1])
        return inner(*a, **kw)

    monkeypatch.setattr(model.model, "forward", forward)
    return seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_long_cached_call_runs_in_chunks_with_the_logits_and_cache_of_one(family, monkeypatch):
    model = FAMILIES[family]()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 45), generator=g)
    nxt = torch.randint(3, 128, (2, 1), generator=g)
    with torch.no_grad():
        whole = model(ids, use_cache=True, logits_to_keep=0)
        after_whole = model(nxt, **{CACHE_FIELD: getattr(whole, CACHE_FIELD)}).logits
        model.prefill_chunk_tokens = 32  # 2 rows: chunks of 16 new tokens
        seen = calls(model, monkeypatch)
        for keep in (0, 1, 20):  # all logits, the last, and a tail longer than the last chunk (13 tokens)
            seen.clear()
            part = model(ids, use_cache=True, logits_to_keep=keep)
            assert seen == [16, 16, 13]
            want = whole.logits[:, -keep:] if keep else whole.logits
            torch.testing.assert_close(part.logits, want, atol=1e-5, rtol=1e-5)
        after_part = model(nxt, **{CACHE_FIELD: getattr(part, CACHE_FIELD)}).logits
    torch.testing.assert_close(after_part, after_whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "real"])
def test_generate_with_chunked_prefill_gives_the_tokens_of_one_call(family, cache, padded, monkeypatch):
    """Left-padded rows of unequal lengths (the padding sits in the first chunk, the real tokens after it), or
    rows of real tokens only (the later chunks take the mixers' causal forms over the cache)."""
    model = FAMILIES[family]()
    g = torch.Generator().manual_seed(4)
    ids, mask = left_pad([torch.randint(3, 128, (n,), generator=g) for n in ((40, 23) if padded else (40, 40))])

    def run():
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, output_scores=True,
                              return_dict_in_generate=True, cache_implementation=cache, **GEN)

    want = run()
    model.prefill_chunk_tokens = 24  # 2 rows: chunks of 12
    seen = calls(model, monkeypatch)
    got = run()
    assert seen[:4] == [12, 12, 12, 4] and set(seen[4:]) <= {1}  # the prompt in chunks, then one-token steps
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_calls_that_need_every_activation_or_keep_no_cache_run_whole(monkeypatch):
    model = FAMILIES["hla"]()
    model.prefill_chunk_tokens = 8
    seen = calls(model, monkeypatch)
    ids = torch.randint(3, 128, (1, 20))
    model(ids, labels=ids)  # gradients (and labels)
    with torch.no_grad():
        model(ids, use_cache=False)
        model(ids, use_cache=True, output_hidden_states=True)
        model.prefill_chunk_tokens = None
        model(ids, use_cache=True)
    assert seen == [20, 20, 20, 20]
    assert SubquadraticForCausalLM.prefill_chunk_tokens == 131072  # one row of 128k tokens runs in one call


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_later_chunks_of_real_tokens_take_the_causal_forms(cache, monkeypatch):
    """Rows of real tokens only: every chunk after the first, in a growing or a static cache, runs its softmax
    layers on the lower-right causal bias and its window branches on the banded form (no [B, T, S] mask: at 4
    rows of 128k tokens that mask took 24-32 GiB), with the tokens of one call."""
    from subquadratic.modeling import base

    model = lively("tiny-h", 0, sse_sliding_window=8, sse_window_sinks=2)
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(6))

    def run():
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4,
                              output_scores=True, return_dict_in_generate=True, cache_implementation=cache, **GEN)

    want = run()
    model.prefill_chunk_tokens = 32  # 2 rows: chunks of 16
    made, real = [], base.plan_softmax
    monkeypatch.setattr(base, "plan_softmax", lambda *a, **kw: made.append((a[0][2], a[1][2], real(*a, **kw)))
                        or made[-1][2])
    got = run()
    chunks = {path for T, S, path in made if 1 < T < S}
    assert chunks == {"causal_lower_right", "banded"}, made
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
