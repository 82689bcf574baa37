"""The static cache generate() keeps for its next call (`SubquadraticPreTrainedModel._generation_static_cache`)
and `SubquadraticCache.rewind`: a later call that fits runs on the same allocations (same addresses,
so a captured decode step replays without a new capture: GPU test in tests/test_cuda_graph.py) and
gives the tokens of a fresh growing cache; a call that does not fit gets a new cache; copies of the
model do not carry it. CPU, with cache_implementation="static" (the default on CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch

from subquadratic import HLAForCausalLM
from subquadratic.families.hla.configuration import tiny_hla_config
from subquadratic.modeling.base import CACHE_FIELD

from .common import GEN, left_pad
from .hla.test_modeling_hla import hla_window
from .spla.tiny import tiny_spla
from .sse.test_modeling_sse import lively

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = {
    "spla+softmax": lambda: tiny_spla(mixer_types=["spla", "full_attention"], block_size=8, top_k_blocks=3,
                                      num_sink_blocks=1, num_local_blocks=1),
    "hla": lambda: HLAForCausalLM(tiny_hla_config(hla_chunk_size=8)).eval(),
    "hla-swa": lambda: hla_window(0),
    "sse-h": lambda: lively("tiny-h", 0),
    "sse-swa": lambda: lively("tiny-swa", 0),
}


def prompts(seed: int, lengths=(40, 29)):
    g = torch.Generator().manual_seed(seed)
    return left_pad([torch.randint(3, 128, (n,), generator=g) for n in lengths])


def generate(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, return_dict_in_generate=True,
                          **GEN, **kw)


def addresses(cache) -> list[int]:
    return [-1 if t is None else t.data_ptr() for t in cache.allocations()]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_later_generate_reuses_the_static_cache(family):
    model = FAMILIES[family]()
    first = generate(model, *prompts(0), cache_implementation="static")
    cache = first[CACHE_FIELD] if CACHE_FIELD in first else first.past_key_values
    assert cache.static is not None
    kept = addresses(cache)
    ids, mask = prompts(1)
    second = generate(model, ids, mask, cache_implementation="static")
    again = second[CACHE_FIELD] if CACHE_FIELD in second else second.past_key_values
    assert again is cache and addresses(again) == kept  # the same tensors, refilled
    fresh = generate(model, ids, mask, cache_implementation="dynamic").sequences
    assert torch.equal(second.sequences, fresh)
    # a shorter call within the slack (same room) and a longer one (a new cache), both right
    ids, mask = prompts(2, (36, 30))
    third = generate(model, ids, mask, cache_implementation="static")
    assert (third[CACHE_FIELD] if CACHE_FIELD in third else third.past_key_values) is cache
    assert torch.equal(third.sequences, generate(model, ids, mask, cache_implementation="dynamic").sequences)
    ids, mask = prompts(3, (60, 41))
    fourth = generate(model, ids, mask, cache_implementation="static")
    assert (fourth[CACHE_FIELD] if CACHE_FIELD in fourth else fourth.past_key_values) is not cache
    assert torch.equal(fourth.sequences, generate(model, ids, mask, cache_implementation="dynamic").sequences)


def test_rewound_static_cache_gives_the_fresh_caches_logits():
    """Prefill and steps on a rewound cache give a fresh static cache's logits exactly; the spare
    allocations come back refilled (a stale SPLA block sum or state would change the logits)."""
    model = FAMILIES["spla+softmax"]()
    ids, mask = prompts(4)

    def steps(cache, ids, mask):
        out = []
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, **{CACHE_FIELD: cache}).logits[:, -1:]
            for _ in range(6):
                tok = logits[:, -1].argmax(-1, keepdim=True)
                mask = torch.cat([mask, torch.ones_like(tok)], 1)
                logits = model(tok, attention_mask=mask, **{CACHE_FIELD: cache}).logits
                out.append(logits)
        return torch.cat(out, 1)

    cache = model.new_cache(max_length=64)
    steps(cache, *prompts(5, (50, 33)))  # other tokens, longer: every buffer holds stale entries after it
    kept = addresses(cache)
    cache.rewind()
    assert cache.get_seq_length() == 0 and cache.seen is None
    rewound = steps(cache, ids, mask)
    assert addresses(cache) == kept
    torch.testing.assert_close(rewound, steps(model.new_cache(max_length=64), ids, mask), rtol=0, atol=0)


def test_kept_cache_follows_batch_size_and_is_not_copied():
    model = FAMILIES["hla-swa"]()
    out = generate(model, *prompts(0), cache_implementation="static")
    cache = out[CACHE_FIELD] if CACHE_FIELD in out else out.past_key_values
    g = torch.Generator().manual_seed(6)
    ids, mask = left_pad([torch.randint(3, 128, (n,), generator=g) for n in (40, 35, 29)])
    three = generate(model, ids, mask, cache_implementation="static")
    assert (three[CACHE_FIELD] if CACHE_FIELD in three else three.past_key_values) is not cache  # batch 3
    assert torch.equal(three.sequences, generate(model, ids, mask, cache_implementation="dynamic").sequences)
    clone = copy.deepcopy(model)
    assert clone._generation_cache.cache is None and model._generation_cache.cache is not None
    model.drop_generation_cache()
    assert model._generation_cache.cache is None


def test_a_cache_that_fell_back_to_eager_steps_is_not_reused_by_a_call_that_asks_for_the_graph():
    """A default call whose capture failed leaves its cache with eager steps (cuda_graph False): a later
    call asking for the captured step gets a new cache (and captures, or raises where static was
    asked); one that asks for eager steps reuses it."""
    model = FAMILIES["hla"]()
    first = model._generation_static_cache(64, 2, True)
    first.cuda_graph = False  # what a failed capture leaves (`cuda_graph.DecodeGraph`)
    assert model._generation_static_cache(64, 2, True) is not first
    eager = model._generation_static_cache(64, 2, False)
    assert model._generation_static_cache(60, 2, False) is eager
