"""The cache's growing buffers: decode steps write into preallocated room, growth past it gives the
same cache as concatenation, beam reordering and batch selection work on buffers with stale spare
entries, SPLA block statistics are kept in place equal to `BlockStats.add`, gradients flow through a
chunked forward with a cache, and `nbytes` reports the state in use."""

from __future__ import annotations

import pytest
import torch

from subquadratic.families.spla.modeling import SPLALayer
from subquadratic.kernels.spla import BlockStats
from subquadratic.modeling import cache as cache_module
from subquadratic.modeling.base import CACHE_FIELD
from subquadratic.modeling.cache import GrowingBuffer
from tests.conftest import count_calls

from .models.spla.tiny import tiny_spla

pytestmark = pytest.mark.usefixtures("one_thread")
MIXED = ["full_attention", "spla"]  # one plain KV layer and one SPLA layer


def all_buffers(cache) -> dict[str, GrowingBuffer]:
    bufs = {"key_positions": cache._key_positions}
    for i, layer in enumerate(cache.layers):
        bufs.update({f"{i}.{n}": b for n, b in layer.buffers.items()})
    return bufs


def run(model, ids, mask=None, prefill=20, cache=None, start=None):
    """Prefill `prefill` tokens (unless a cache is given), then decode the rest one token at a time;
    returns (logits of every step [B, T, V], cache)."""
    steps = []
    with torch.no_grad():
        if cache is None:
            cache = model.new_cache()
            start = prefill
            out = model(ids[:, :prefill], attention_mask=None if mask is None else mask[:, :prefill], cache=cache)
            steps.append(out.logits)
        for t in range(start, ids.shape[1]):
            m = None if mask is None else mask[:, : t + 1]
            steps.append(model(ids[:, t : t + 1], attention_mask=m, **{CACHE_FIELD: cache}).logits)
    return torch.cat(steps, 1), cache


def test_buffer_appends_in_place_and_grows_like_cat(monkeypatch):
    monkeypatch.setattr(cache_module, "CHUNK", 8)
    buf = GrowingBuffer(dim=2)
    assert buf.capacity_for(100) == 128  # 100 + 25, rounded up to whole chunks
    assert buf.capacity_for(7) == 16 and buf.capacity_for(8) == 16  # always some spare room
    g = torch.Generator().manual_seed(0)
    ref, moves = None, 0
    for n in (5, 1, 1, 1, 3, 1, 9, 1, 1, 20, 1, 1):
        x = torch.randn(2, 3, n, 4, generator=g)
        ptr, cap = (buf.data.data_ptr(), buf.capacity) if buf.data is not None else (None, 0)
        out = buf.append(x)
        ref = x if ref is None else torch.cat([ref, x], 2)
        assert torch.equal(out, ref)
        assert out.data_ptr() == buf.data.data_ptr()  # a view of the allocation, not a copy
        if ref.shape[2] <= cap:
            assert buf.data.data_ptr() == ptr and buf.capacity == cap  # written in place
        else:
            moves += 1
            assert buf.capacity == buf.capacity_for(ref.shape[2])
    assert moves == 4 and buf.length == 45 and buf.capacity == 56
    assert buf.nbytes() == 2 * 3 * 45 * 4 * 4 and buf.nbytes(allocated=True) == 2 * 3 * 56 * 4 * 4
    assert torch.equal(buf.data[:, :, 45:], torch.zeros(2, 3, 11, 4))  # spare room untouched
    # extend: new entries are zeros, whatever the allocation held
    sums = GrowingBuffer(dim=1)
    sums.extend(3, torch.zeros(2, 0)).add_(1.0)
    assert torch.equal(sums.extend(20, torch.zeros(2, 0)), torch.cat([torch.ones(2, 3), torch.zeros(2, 17)], 1))
    assert sums.extend(5, torch.zeros(2, 0)).shape == (2, 20)  # never shrinks


def test_decode_steps_write_into_preallocated_buffers():
    model = tiny_spla(mixer_types=MIXED)
    ids = torch.randint(1, 128, (2, 30))
    _, cache = run(model, ids[:, :20])
    bufs = all_buffers(cache)
    assert set(bufs) == {"key_positions", "0.k", "0.v", "1.k", "1.v", "1.sum_k", "1.sum_k2", "1.count"}
    assert bufs["1.sum_k"].data is None  # inside SPLA's budget the block sums wait for the first call past it
    used = cache.nbytes()  # reading the cache folds them in
    before = {n: (b.data.data_ptr(), b.capacity) for n, b in bufs.items()}
    run(model, ids, cache=cache, start=20)
    assert {n: (b.data.data_ptr(), b.capacity) for n, b in all_buffers(cache).items()} == before
    assert cache.layers[0].state["k"].shape == (2, 2, 30, 16) and cache.key_positions.shape == (2, 30)
    assert cache.layers[1].state["count"].shape == (2, 4)  # ceil(30 slots / 8)
    assert cache.nbytes() > used and cache.nbytes(allocated=True) > cache.nbytes()


def test_growth_past_capacity_gives_the_same_cache(monkeypatch):
    """Many reallocations (4-slot chunks) vs none (the default room): same logits, same states,
    left padding included."""
    ids = torch.randint(1, 128, (2, 70))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    want, ref = run(tiny_spla(mixer_types=MIXED), ids, mask)
    assert all(b.capacity == 256 for n, b in all_buffers(ref).items() if not n.endswith(("sum_k", "sum_k2", "count")))
    monkeypatch.setattr(cache_module, "CHUNK", 4)
    got, cache = run(tiny_spla(mixer_types=MIXED), ids, mask)
    assert all_buffers(cache)["1.k"].capacity < 100  # it did grow step by step
    assert torch.equal(got, want)
    assert torch.equal(cache.key_positions, ref.key_positions)
    for a, b in zip(cache.layers, ref.layers, strict=True):
        assert a.state.keys() == b.state.keys()
        for name in a.state:
            assert torch.equal(a.state[name], b.state[name]), name


def test_beam_reorder_and_batch_selection_on_buffers_with_spare_room():
    model = tiny_spla(mixer_types=MIXED)
    ids = torch.randint(1, 128, (3, 50))
    _, cache = run(model, ids[:, :36], prefill=30)
    caps = {n: b.capacity for n, b in all_buffers(cache).items()}
    idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(idx)
    assert {n: b.capacity for n, b in all_buffers(cache).items()} == caps  # spare room kept
    got, _ = run(model, ids[idx], cache=cache, start=36)
    want, _ = run(model, ids[idx], prefill=30)
    torch.testing.assert_close(got, want[:, -14:], rtol=0, atol=1e-5)

    _, cache = run(model, ids[:, :36], prefill=30)
    cache.batch_repeat_interleave(2)  # rows 0 0 1 1 2 2
    cache.batch_select_indices(torch.tensor([1, 4, 5]))  # rows 0 2 2
    got, _ = run(model, ids[[0, 2, 2]], cache=cache, start=36)
    want, _ = run(model, ids[[0, 2, 2]], prefill=30)
    torch.testing.assert_close(got, want[:, -14:], rtol=0, atol=1e-5)

    cache.reset()
    assert not any(layer.is_initialized for layer in cache.layers) and cache.key_positions is None
    again, _ = run(model, ids[[0, 2, 2]], cache=cache, start=0)
    torch.testing.assert_close(again, want, rtol=0, atol=1e-5)


def test_spla_block_stats_kept_in_place_equal_functional_add(monkeypatch):
    monkeypatch.setattr(cache_module, "CHUNK", 16)  # the stats grow by 2-block chunks
    B, H, D, bs = 2, 3, 8, 8
    g = torch.Generator().manual_seed(3)
    layer, functional = SPLALayer(), BlockStats.empty(B, H, D, "cpu")
    valid = torch.ones(B, 0, dtype=torch.bool)
    for n in (13, 1, 1, 2, 1, 30, 1, 1, 1, 1):
        k = torch.randn(B, H, n, D, generator=g).requires_grad_()  # keys of a training step
        new_valid = torch.ones(B, n, dtype=torch.bool)
        if valid.shape[1] == 0:
            new_valid[1, :5] = False  # left padding of row 1
        pos = cache_module.positions_from_mask(new_valid, valid.sum(-1))
        valid = torch.cat([valid, new_valid], 1)
        K, _, stats, _ = layer.update(k, k.detach(), pos, bs)
        functional = functional.add(k.transpose(1, 2), pos, bs)  # the op's [B, T, H, D] layout
        S = valid.shape[1]
        assert K.shape[2] == S and stats.num_blocks == -(-S // bs)  # sized from the slots, no host sync
        nb = functional.num_blocks
        for a, b in zip((stats.sum_k, stats.sum_k2, stats.count), (functional.sum_k, functional.sum_k2,
                                                                   functional.count), strict=True):
            assert not a.requires_grad and not b.requires_grad  # never part of the autograd graph
            assert torch.equal(a[:, :, :nb] if a.dim() == 4 else a[:, :nb], b)
            assert not (a[:, :, nb:] if a.dim() == 4 else a[:, nb:]).any()  # blocks no row has reached
    assert layer.buffers["count"].capacity > stats.num_blocks
    # num_blocks= sizes the functional result without reading pos; add never changes its input
    before = functional.sum_k.clone()
    wider = functional.add(k.transpose(1, 2), pos, bs, num_blocks=functional.num_blocks + 3)
    assert wider.num_blocks == functional.num_blocks + 3 and torch.equal(functional.sum_k, before)


def test_chunked_forward_with_cache_backpropagates_like_one_forward():
    """A training forward that keeps a cache must not overwrite tensors saved for backward."""
    model = tiny_spla(mixer_types=MIXED).train()
    ids = torch.randint(1, 128, (2, 40))
    model(ids, use_cache=False).logits.square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    cache = model.new_cache()
    parts = [model(ids[:, :25], cache=cache).logits, model(ids[:, 25:], cache=cache).logits]
    torch.cat(parts, 1).square().mean().backward()
    for n, g in want.items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, rtol=1e-4, atol=1e-6, msg=n)


def test_unpadded_steps_skip_the_mask_and_equal_the_masked_path(monkeypatch):
    """A growing cache whose tokens are all real says so (`all_real`): the softmax and SPLA layers then
    run SDPA without a mask (causal at prefill, every key at one-token steps). A padded prefill, a
    static cache and an unknown mask say False. The logits equal those of the masked path, which the
    same steps take when the flag is forced off."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    masks = []

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attn_mask") is None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = tiny_spla(mixer_types=MIXED).eval()  # budget 4 x 8 = 32 slots: the SPLA layer stays dense
    ids = torch.randint(1, 128, (2, 28))
    got, cache = run(model, ids, mask=torch.ones_like(ids))
    assert cache.all_real and masks and all(masks)
    masks.clear()
    with monkeypatch.context() as m:
        m.setattr(cache_module, "all_real", lambda valid, sync=False: False)
        want, cache = run(model, ids, mask=torch.ones_like(ids))
    assert not cache.all_real and masks and not any(masks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    padded = torch.ones_like(ids)
    padded[1, :3] = 0
    assert not run(model, ids, mask=padded)[1].all_real
    assert not model.new_cache(max_length=40).all_real
    assert cache_module.all_real(None) and not cache_module.all_real(padded.bool())


# ---------------------------------------------------------------------- static caches


def test_static_cache_allocates_once_and_gives_one_token_steps_fixed_shapes(monkeypatch):
    """Every buffer is allocated for max_length at the first tokens; one-token steps see the whole
    buffers (the same shapes at every step, unused slots at position -1) and write in place."""
    from subquadratic.families.spla import modeling as spla_module

    seen_shapes = []
    real = spla_module.spla_attention

    def spy(q, k, v, q_pos, k_pos, stats, sbar, params, **kw):
        seen_shapes.append((q.shape[1], k.shape, k_pos.shape, stats.sum_k.shape, kw["new_kv"] is not None))
        return real(q, k, v, q_pos, k_pos, stats, sbar, params, **kw)

    monkeypatch.setattr(spla_module, "spla_attention", spy)
    model = tiny_spla(mixer_types=MIXED)
    ids = torch.randint(1, 128, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    cache = model.new_cache(max_length=40)
    _, cache = run(model, ids, mask, cache=cache, start=0)
    bufs = all_buffers(cache)
    assert {n: b.capacity for n, b in bufs.items()} == {
        "key_positions": 40, "0.k": 40, "0.v": 40, "1.k": 40, "1.v": 40, "1.sum_k": 5, "1.sum_k2": 5, "1.count": 5}
    steps = seen_shapes[1:]  # after the 1-token first call: all one-token steps
    assert len(steps) == 29 and all(s == steps[0] for s in steps)
    assert steps[0][1] == (2, 40, 2, 16) and steps[0][3] == (2, 2, 5, 16) and steps[0][4]
    assert torch.equal(cache.key_positions[1], torch.cat([torch.full((6,), -1), torch.arange(24)]))
    assert (cache._key_positions.data[:, 30:] == -1).all()  # never written
    assert cache.seen.tolist() == [30, 24] and int(cache.slot) == 30 and cache.get_seq_length() == 30


def test_static_cache_refuses_overflow_and_padding_after_the_first_token():
    model = tiny_spla(mixer_types=MIXED)
    ids = torch.randint(1, 128, (2, 12))
    with torch.no_grad():
        cache = model.new_cache(max_length=12)
        model(ids, cache=cache)
        with pytest.raises(ValueError, match="holds 12 tokens"):
            model(ids[:, :1], cache=cache)
        mask = torch.ones_like(ids)
        mask[0, 5] = 0
        with pytest.raises(ValueError, match="left padding only"):
            model(ids, attention_mask=mask, cache=model.new_cache(max_length=20))


def test_static_cache_beam_reorder_in_place_equals_growing_cache():
    model = tiny_spla(mixer_types=MIXED)
    ids = torch.randint(1, 128, (3, 44))
    idx = torch.tensor([2, 0, 0])
    got = {}
    for name, cache in (("growing", model.new_cache()), ("static", model.new_cache(max_length=50))):
        _, cache = run(model, ids[:, :36], prefill=30, cache=cache, start=0)
        before = {n: b.data.data_ptr() for n, b in all_buffers(cache).items()}
        cache.reorder_cache(idx)
        if name == "static":
            assert {n: b.data.data_ptr() for n, b in all_buffers(cache).items()} == before
        got[name], _ = run(model, ids[idx], cache=cache, start=36)
    torch.testing.assert_close(got["static"], got["growing"], rtol=0, atol=1e-5)


def test_generate_with_cache_implementation_static_builds_the_static_cache(monkeypatch):
    model = tiny_spla(mixer_types=MIXED)
    made = []
    real = type(model.model).new_cache

    def spy(self, max_length=None, cuda_graph=True, fuse=True):
        made.append((max_length, cuda_graph))
        return real(self, max_length, cuda_graph, fuse)

    monkeypatch.setattr(type(model.model), "new_cache", spy)
    ids = torch.randint(1, 128, (2, 10))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = model.generate(ids, cache_implementation="static", **kw)
    model.generate(ids, cache_implementation="static", disable_compile=True, **kw)
    assert made == [(14, True), (14, False)]  # prompt + new tokens - 1: the last token is never fed
    made.clear()
    assert torch.equal(model.generate(ids, **kw), out) and made == [(None, True)]


def test_fused_chains_equal_the_modules_they_stand_for(monkeypatch):
    """Under a captured step's plan settings (`fused.captured_step`, which the capture passes: the fused plan's
    `compiled`) every elementwise chain of the step runs its fused form (here eagerly: compiling needs the GPU
    path) and gives the plain modules' logits; without `fuse` none runs; a chain whose compile fails warns
    and runs eagerly."""
    from subquadratic.modeling import fused

    chains = ("rms_norm", "add_rms_norm", "rope", "add_head_norm", "silu_mul")
    calls = count_calls(monkeypatch, {name: (getattr(fused, name), "fn") for name in chains})
    for name in chains:
        monkeypatch.setattr(getattr(fused, name), "compiled", False)
    model = tiny_spla(mixer_types=MIXED, block_size=4, top_k_blocks=3)  # budget 12 tokens: the residual term runs
    ids = torch.randint(1, 128, (2, 30))
    got = {}
    for fuse_step in (False, True):
        cache = model.new_cache(max_length=30)
        _, cache = run(model, ids[:, :20], cache=cache, start=0)
        calls.update(dict.fromkeys(chains, 0))
        model.set_plan("fused", **fused.captured_step(fuse_step)["fused"])  # what the capture sets on its steps
        got[fuse_step], _ = run(model, ids, cache=cache, start=20)
        model.set_plan("fused")
        steps, layers = 10, len(MIXED)
        # per step and layer: the residual add + norm before the mixer (the first layer's a plain norm: the
        # previous layer's MLP output added there) and after it, RoPE, the MLP gate; the SPLA layer's head
        # norm; the final norm with the last MLP output's add
        want = dict(rms_norm=steps, add_rms_norm=2 * layers * steps, rope=layers * steps,
                    add_head_norm=steps, silu_mul=layers * steps)
        assert calls == (want if fuse_step else dict.fromkeys(chains, 0))
    torch.testing.assert_close(got[True], got[False], rtol=0, atol=1e-5)

    def broken(fn, **kw):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    chain = fused.Compiled(fused._rms_norm)
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    with pytest.warns(UserWarning, match="runs it eagerly"):
        out = chain(x, w, 1e-6)
    assert chain.compiled is False and torch.equal(out, fused._rms_norm(x, w, 1e-6))
