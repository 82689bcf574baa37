"""Conversion keeps the sources' sliding windows in the softmax layers that stay: Mistral's
`sliding_window`, Qwen2's `use_sliding_window` from `max_window_layers` on, and an explicit per-layer
`layer_types` (Gemma-style alternation, on Qwen3). Compared with the source at a length beyond the
window, where a window and full attention differ."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from subquadratic.conversion import convert
from subquadratic.conversion.core import source_layer_types

from ..conftest import make_dense

WINDOW = 6
T = 20  # beyond the window
SOURCES = {
    "mistral": ("mistral", dict(sliding_window=WINDOW, num_hidden_layers=4), ["sliding_attention"] * 4),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, num_hidden_layers=4),
              ["full_attention"] * 2 + ["sliding_attention"] * 2),
    "qwen3-layer-types": (
        "qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, num_hidden_layers=4,
                      layer_types=["sliding_attention", "full_attention"] * 2),
        ["sliding_attention", "full_attention"] * 2,
    ),
}
#: Every layer kept as softmax (the whole model is the source's attention), for each family that keeps some.
ALL_SOFTMAX = {"sse-h": {"softmax_every": 1}, "hla": {"softmax_every": 1}}


def _source(kind, tmp_path):
    base, overrides, expect = SOURCES[kind]
    dense = make_dense(base, **overrides)
    folder = tmp_path / f"dense-{kind}"
    dense.save_pretrained(folder)
    return dense, folder, expect


def _ids():
    return torch.randint(3, 128, (2, T), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", list(SOURCES))
def test_source_windows_are_read_per_layer(kind, tmp_path):
    dense, folder, expect = _source(kind, tmp_path)
    assert source_layer_types(dense.config.to_dict()) == expect
    # the window matters at this length: without it the source computes something else
    overrides = {k: v for k, v in SOURCES[kind][1].items() if k not in ("layer_types", "use_sliding_window")}
    full = make_dense(SOURCES[kind][0], **{**overrides, "sliding_window": None})
    assert source_layer_types(full.config.to_dict()) == ["full_attention"] * 4
    with torch.no_grad():
        assert not torch.allclose(dense(_ids()).logits, full(_ids()).logits, atol=1e-3)


@pytest.mark.parametrize("target", list(ALL_SOFTMAX))
@pytest.mark.parametrize("kind", list(SOURCES))
def test_kept_softmax_layers_compute_the_source_beyond_the_window(kind, target, tmp_path):
    dense, folder, expect = _source(kind, tmp_path)
    out = convert(str(folder), str(tmp_path / "out"), target, options=ALL_SOFTMAX[target], progress=False)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.mixer_types == expect and model.config.sliding_window == WINDOW
    x = _ids()
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding too
    with torch.no_grad():
        torch.testing.assert_close(model(x, attention_mask=mask).logits, dense(x, attention_mask=mask).logits,
                                   rtol=1e-4, atol=1e-4)
        # and generation continues with the window (prefill + decode through the cache)
        got = model.generate(x[:1], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        want = dense.generate(x[:1], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("target", "options"), [("sse-h", {"softmax_every": 2}), ("hla", {"softmax_layers": "1,3"})])
@pytest.mark.parametrize("kind", list(SOURCES))
def test_hybrid_keeps_each_kept_layers_window(kind, target, options, tmp_path):
    """In a hybrid only the kept layers are softmax; each keeps its source layer's kind, and its
    output equals the source layer's on the same input (hidden states captured before it)."""
    dense, folder, expect = _source(kind, tmp_path)
    out = convert(str(folder), str(tmp_path / "out"), target, options=options, progress=False)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    kept = [1, 3]
    mixer = target.split("-")[0]
    assert model.config.mixer_types == [expect[i] if i in kept else mixer for i in range(4)]
    x = _ids()
    seen = {}
    hooks = [dense.model.layers[i].register_forward_hook(
        lambda mod, args, kwargs, out, i=i: seen.__setitem__(i, (args[0] if args else kwargs["hidden_states"],
                                                                 out[0] if isinstance(out, tuple) else out)),
        with_kwargs=True) for i in kept]
    with torch.no_grad():
        dense(x)
        for h in hooks:
            h.remove()
        for i in kept:
            h_in, want = seen[i]
            torch.testing.assert_close(_layer_output(model, i, h_in), want, rtol=1e-4, atol=1e-4)


def _layer_output(model, i, h):
    """Our layer i on the input h [B, T, hidden] of a full (unpadded) batch."""
    from subquadratic.modeling.base import SequenceInfo
    from subquadratic.modeling.cache import positions_from_mask

    valid = torch.ones(h.shape[:2], dtype=torch.bool)
    pos = positions_from_mask(valid)
    seq = SequenceInfo(positions=pos, valid=valid, key_positions=pos)
    out, mlp, _ = model.model.layers[i](h, position_embeddings=model.model.rotary_emb(h, pos), seq=seq)
    return out + mlp  # the layer leaves its MLP output for the next norm to add
