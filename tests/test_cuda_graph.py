"""The static cache on CUDA: a one-token step runs without host synchronisation, the captured step
(one CUDA graph of the whole model, with and without its elementwise chains compiled) gives the
eager step's logits, and generate() with
cache_implementation="static" gives the tokens of the default generate(). GPU only (marker `gpu`)."""

from __future__ import annotations

import pytest
import torch

from subquadratic import HLAForCausalLM
from subquadratic.families.hla.configuration import tiny_hla_config
from subquadratic.modeling import fused
from subquadratic.modeling.base import CACHE_FIELD

from .models.common import GEN, left_pad
from .models.hla.test_modeling_hla import hla_window
from .models.spla.tiny import tiny_spla
from .models.sse.test_modeling_sse import lively

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: Budget 3 blocks x 16 = 48 tokens under ~130-token contexts: the sparse decode kernels at work.
SPARSE = dict(block_size=16, top_k_blocks=3, num_sink_blocks=1, num_local_blocks=1)
FAMILIES = {
    "spla+softmax": lambda: tiny_spla(mixer_types=["spla", "full_attention"], **SPARSE),
    "spla-no-rla": lambda: tiny_spla(use_rla=False, **SPARSE),
    "hla": lambda: HLAForCausalLM(tiny_hla_config(hla_chunk_size=8)).eval(),
    "sse-h": lambda: lively("tiny-h", 0),
    "sse-swa": lambda: lively("tiny-swa", 0),
    "sse-swa-sum": lambda: lively("tiny-swa", 0, sse_window_merge="sum"),
    "hla-swa": lambda: hla_window(0),
}


def inputs(T: int = 96):
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (T, T - 17)]
    ids, mask = left_pad(rows)
    return ids.cuda(), mask.cuda()


def decode(model, cache, ids, mask, steps: int, attention_mask: bool = True) -> torch.Tensor:
    """Prefill ids, then `steps` greedy one-token steps; returns the logits of the steps [B, steps, V]."""
    out = []
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, **{CACHE_FIELD: cache}).logits[:, -1:]
        for _ in range(steps):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            logits = model(tok, attention_mask=mask if attention_mask else None, **{CACHE_FIELD: cache}).logits
            out.append(logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_captured_step_equals_eager_step(family):
    model = FAMILIES[family]().cuda()
    ids, mask = inputs()
    steps = 40
    growing = decode(model, model.new_cache(), ids, mask, steps)
    eager = decode(model, model.new_cache(max_length=ids.shape[1] + steps, cuda_graph=False), ids, mask, steps)
    cache = model.new_cache(max_length=ids.shape[1] + steps)
    captured = decode(model, cache, ids, mask, steps)
    assert cache.decode_graph is not None and cache.decode_graph.graph is not None
    assert cache.get_seq_length() == ids.shape[1] + steps
    torch.testing.assert_close(captured, eager, rtol=0, atol=1e-5)
    torch.testing.assert_close(eager, growing, rtol=0, atol=1e-4)
    assert fused.add_rms_norm.compiled not in (None, False)  # the captured step ran the compiled chains
    if family == "spla+softmax":
        assert fused.add_head_norm.compiled not in (None, False) and fused.rope.compiled not in (None, False)
    unfused = decode(model, model.new_cache(max_length=ids.shape[1] + steps, fuse=False), ids, mask, steps)
    torch.testing.assert_close(unfused, eager, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_static_one_token_step_has_no_host_sync(family):
    model = FAMILIES[family]().cuda()
    ids, mask = inputs()
    cache = model.new_cache(max_length=ids.shape[1] + 8, cuda_graph=False)
    decode(model, cache, ids, mask, 2)  # compiles the kernels
    tok = torch.full((2, 1), 5, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            for _ in range(3):
                model(tok, **{CACHE_FIELD: cache})
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("family", ["spla+softmax", "hla", "sse-h"])
def test_generate_static_captured_equals_default_generate(family):
    model = FAMILIES[family]().cuda()
    ids, mask = inputs()
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, **GEN)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kw), model.generate(ids, **kw))
    kw.update(num_beams=3, max_new_tokens=8)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kw), model.generate(ids, **kw))


@pytest.mark.parametrize("family", ["hla", "sse-h"])
def test_a_step_that_fills_the_static_cache_is_not_recorded(family):
    """A static cache with room for one step: that step runs (eagerly) with the eager cache's logits and
    nothing is recorded; a step past it raises the cache's error; generate() for one new token after
    the prompt's (a cache of prompt + 1) gives the default generate()'s tokens."""
    model = FAMILIES[family]().cuda()
    ids, mask = inputs()
    eager = decode(model, model.new_cache(max_length=ids.shape[1] + 1, cuda_graph=False), ids, mask, 1)
    cache = model.new_cache(max_length=ids.shape[1] + 1)
    torch.testing.assert_close(decode(model, cache, ids, mask, 1), eager, rtol=0, atol=1e-5)
    assert cache.decode_graph is not None and cache.decode_graph.graph is None
    with pytest.raises(ValueError, match="static cache holds"), torch.no_grad():
        model(torch.full((2, 1), 5, device="cuda"), **{CACHE_FIELD: cache})
    kw = dict(attention_mask=mask, max_new_tokens=2, do_sample=False, **GEN)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kw), model.generate(ids, **kw))


def _generate_caches(monkeypatch, model) -> list:
    """The caches generate() builds for `model` (`_prepare_cache_for_generation`), in order."""
    built = []
    real = type(model)._prepare_cache_for_generation

    def spy(self, generation_config, model_kwargs, *a, **kw):
        out = real(self, generation_config, model_kwargs, *a, **kw)
        built.append(model_kwargs.get(CACHE_FIELD))
        return out

    monkeypatch.setattr(type(model), "_prepare_cache_for_generation", spy)
    return built


@pytest.mark.parametrize("family", ["spla+softmax", "spla-no-rla", "hla"])
def test_default_generate_replays_the_captured_step(family, monkeypatch):
    """Without cache_implementation, greedy search and sampling on CUDA decode through the static cache
    and its captured step (greedy: the tokens of the growing eager path); beam search keeps the growing
    cache."""
    model = FAMILIES[family]().cuda()
    ids, mask = inputs()
    built = _generate_caches(monkeypatch, model)
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, **GEN)
    fast = model.generate(ids, **kw)
    cache = built[-1]
    assert cache is not None and cache.static is not None and cache.eager_fallback
    assert cache.decode_graph is not None and cache.decode_graph.graph is not None  # replayed
    assert torch.equal(fast, model.generate(ids, cache_implementation="dynamic", **kw))
    assert built[-1] is None  # "dynamic": the model's own growing cache
    sampled = model.generate(ids, **dict(kw, do_sample=True, top_k=5))
    assert built[-1].static is not None and built[-1].decode_graph.graph is not None
    assert sampled.shape == fast.shape and torch.equal(sampled[:, :ids.shape[1]], ids)
    beams = model.generate(ids, **dict(kw, num_beams=3, max_new_tokens=8))
    assert built[-1] is None
    assert torch.equal(beams, model.generate(ids, cache_implementation="dynamic", **dict(kw, num_beams=3,
                                                                                          max_new_tokens=8)))


def test_default_generate_falls_back_to_eager_steps_where_capture_fails(monkeypatch):
    """A capture that fails: the default generate() warns and continues eagerly with the same tokens;
    a static cache asked for raises."""
    model = FAMILIES["spla+softmax"]().cuda()
    ids, mask = inputs()
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, **GEN)
    want = model.generate(ids, cache_implementation="dynamic", **kw)

    class Refused:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            raise RuntimeError("capture refused for the test")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "graph", Refused)
    built = _generate_caches(monkeypatch, model)
    with pytest.warns(UserWarning, match="could not be captured"):
        got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    assert built[-1].static is not None and not built[-1].cuda_graph and built[-1].decode_graph is None
    with pytest.raises(RuntimeError, match="could not be captured"):
        model.generate(ids, cache_implementation="static", **kw)


def test_default_generate_captures_a_converted_model_on_its_first_call(monkeypatch):
    """A converted SPLA model (gamma = 0: its eager steps skip the residual term) captures its step in
    its first generate() call, with chains never compiled before: the warm-up runs what the recording
    runs, so nothing compiles inside the capture; the tokens are those of the growing eager path."""
    import warnings

    for name in ("rms_norm", "silu_mul", "add_rms_norm", "rope", "add_head_norm"):
        monkeypatch.setattr(fused, name, fused.Compiled(getattr(fused, "_" + name)))
    model = tiny_spla(gamma=None, **SPARSE).cuda()
    ids, mask = inputs()
    built = _generate_caches(monkeypatch, model)
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, **GEN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no failed compile, no failed capture
        fast = model.generate(ids, **kw)
    assert built[-1].decode_graph is not None and built[-1].decode_graph.graph is not None
    assert torch.equal(fast, model.generate(ids, cache_implementation="dynamic", **kw))


@pytest.mark.parametrize("family", ["spla+softmax", "hla", "sse-h"])
def test_later_default_generate_replays_the_kept_graph(family, monkeypatch):
    """A second default generate() of the same shapes rewinds the kept static cache and replays its
    captured step without a new capture, with the tokens of the growing eager path; a weight moved to
    a new address (a re-assigned parameter) makes the next call capture again."""
    from subquadratic.modeling.cuda_graph import DecodeGraph

    model = FAMILIES[family]().cuda()
    ids, mask = inputs()
    built = _generate_caches(monkeypatch, model)
    captures = []
    real = DecodeGraph._warm_up_and_capture
    monkeypatch.setattr(DecodeGraph, "_warm_up_and_capture", lambda self: captures.append(1) or real(self))
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, **GEN)
    model.generate(ids, **kw)
    graph = built[-1].decode_graph
    assert len(captures) == 1 and graph is not None and graph.graph is not None
    other = torch.where(mask.bool(), torch.roll(ids, 1, 0), ids)
    second = model.generate(other, **kw)
    assert built[-1] is built[0] and built[-1].decode_graph is graph and len(captures) == 1  # replayed, not recaptured
    assert torch.equal(second, model.generate(other, cache_implementation="dynamic", **kw))
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
    third = model.generate(other, **kw)
    assert len(captures) == 2 and built[-1] is built[0] and built[-1].decode_graph is not graph
    assert torch.equal(third, model.generate(other, cache_implementation="dynamic", **kw))
