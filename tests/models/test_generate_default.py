"""The cache a generate() call builds when the caller names none (`base.generation_cache`): the
static one with the captured step on CUDA for greedy search and sampling, the growing one on the CPU,
under beam search, with disable_compile or cache_implementation="dynamic"; on the CPU the default
generate() gives the tokens of the eager growing-cache path and of the static cache. The captured
default on CUDA and its eager fallback are in tests/test_cuda_graph.py (GPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from subquadratic.modeling import base
from subquadratic.modeling.base import CACHE_FIELD, generation_cache

from .common import GEN, left_pad
from .spla.tiny import tiny_spla


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_default_cache_choice(device):
    """The device is data: the choice on CUDA is checked on any machine."""
    cfg = GenerationConfig()
    fast = "static" if device == "cuda" else None
    assert generation_cache(cfg, "greedy_search", device) == fast
    assert generation_cache(cfg, "sample", device) == fast
    for mode in ("beam_search", "beam_sample", "assisted_generation", "group_beam_search"):
        assert generation_cache(cfg, mode, device) is None, mode
    assert generation_cache(GenerationConfig(disable_compile=True), "greedy_search", device) is None
    assert generation_cache(GenerationConfig(cache_implementation="dynamic"), "greedy_search", device) is None
    assert generation_cache(GenerationConfig(cache_implementation="static"), "beam_search", device) == "static"


def caches_built(monkeypatch) -> list:
    """The caches generate() passes to the model's forward calls (one entry per call)."""
    seen = []
    real = base.SubquadraticForCausalLM.forward

    def spy(self, *a, **kw):
        seen.append(kw.get(CACHE_FIELD, kw.get("past_key_values", kw.get("cache"))))
        out = real(self, *a, **kw)
        seen[-1] = seen[-1] if seen[-1] is not None else getattr(out, CACHE_FIELD, None)
        return out

    monkeypatch.setattr(base.SubquadraticForCausalLM, "forward", spy)
    return seen


def test_cpu_default_generate_is_the_eager_growing_path(monkeypatch):
    # budget 3 x 8 = 24 tokens under ~50-token contexts: the sparse decode path
    model = tiny_spla(top_k_blocks=3, num_local_blocks=1, num_sink_blocks=1)
    g = torch.Generator().manual_seed(0)
    ids, mask = left_pad([torch.randint(3, 128, (n,), generator=g) for n in (30, 21)])
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, **GEN)
    seen = caches_built(monkeypatch)
    default = model.generate(ids, **kw)
    assert seen and all(c is not None and c.static is None for c in seen)  # growing
    seen.clear()
    static = model.generate(ids, cache_implementation="static", **kw)
    assert seen and all(c.static is not None and not c.eager_fallback for c in seen)
    seen.clear()
    dynamic = model.generate(ids, cache_implementation="dynamic", **kw)
    assert seen and all(c.static is None for c in seen)
    # the eager loop, one token at a time on a growing cache
    cache, out, m = model.new_cache(), ids, mask
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, **{CACHE_FIELD: cache}).logits
        for _ in range(20):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out, m = torch.cat([out, tok], 1), torch.cat([m, torch.ones_like(tok)], 1)
            logits = model(tok, attention_mask=m, **{CACHE_FIELD: cache}).logits
    assert torch.equal(default, out) and torch.equal(static, out) and torch.equal(dynamic, out)
    assert out.shape == (2, ids.shape[1] + 20)
