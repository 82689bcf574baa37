"""The window branch added to a state mixer's output (`modeling.window`): SSE's `--sse-window-merge sum`
and HLA's `--hla-sliding-window`. A fresh conversion is exactly the source's attention over each
query's last W tokens (the state branch's gate starts at 0); once the gate is trained both branches
count, and cached decoding equals the full forward; the cache stays a fixed size."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from subquadratic.cli import main as cli_main
from subquadratic.modeling.base import CACHE_FIELD, SequenceInfo

from .test_sse import cached_decode_gap

pytestmark = pytest.mark.usefixtures("one_thread")

W = 4
SINKS = 4  # what conversion gives a window when its options name no sinks
CASES = {
    "sse": ["--to", "sse", "--sse-sliding-window", str(W), "--sse-window-merge", "sum"],
    "hla": ["--to", "hla", "--hla-softmax-every", "2", "--hla-sliding-window", str(W)],
}


def gate_up(attn) -> torch.Tensor:
    """The weight whose zero makes the state branch's output 0: SSE's g_proj up projection, HLA's g_proj."""
    return attn.g_proj[1].weight if isinstance(attn.g_proj, torch.nn.Sequential) else attn.g_proj.weight


def window_reference(swa, x, pe, window: int, sinks: int) -> torch.Tensor:
    """The source attention over keys j <= t with t - window < j or j < sinks, by its definition."""
    B, T, _ = x.shape
    d, G = swa.head_dim, swa.num_key_value_groups
    q, k, v = (getattr(swa, f"{n}_proj")(x).view(B, T, -1, d).transpose(1, 2) for n in "qkv")
    q, k = apply_rotary_pos_emb(q, k, *pe)
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    mask = (j <= i) & ((j > i - window) | (j < sinks))
    w = (q @ k.transpose(-1, -2) / d**0.5).masked_fill(~mask, float("-inf")).softmax(-1)
    return swa.o_proj((w @ v).transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize("family", sorted(CASES))
def test_fresh_window_branch_is_the_sliding_window_softmax(family, dense_checkpoint, tmp_path):
    src_model, src = dense_checkpoint("llama", num_hidden_layers=4)
    assert cli_main(["convert", str(src), str(tmp_path / "out"), *CASES[family], "--no-progress"]) == 0
    m, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    m.eval()
    state_layers = [i for i, k in enumerate(m.config.mixer_types) if k == family]
    assert len(state_layers) == (2 if family == "hla" else 4)  # HLA: softmax layers 1 and 3, no window there
    assert not [n for n in m.state_dict() if ".swa." in n and int(n.split(".")[2]) not in state_layers]
    src_sd = src_model.state_dict()
    x = torch.randn(2, 12, m.config.hidden_size, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12).expand(2, 12)
    seq = SequenceInfo(positions=pos, valid=torch.ones(2, 12, dtype=torch.bool), key_positions=pos, causal=True)
    pe = m.model.rotary_emb(x, pos)
    for i in state_layers:
        attn = m.model.layers[i].self_attn
        assert attn.window == W and attn.swa.sinks == SINKS
        assert not any("merge_norm" in n for n, _ in attn.named_parameters())
        for n, t in attn.swa.state_dict().items():  # a byte-identical copy of the source attention
            assert torch.equal(t, src_sd[f"model.layers.{i}.self_attn.{n}"]), n
        assert not gate_up(attn).any()
        with torch.no_grad():
            got = attn(x, pe, seq)[0]
            want = window_reference(attn.swa, x, pe, W, SINKS)
        assert (got - want).abs().max().item() <= 1e-5, i
    with torch.no_grad():
        for i in state_layers:  # a trained gate: both branches count
            gate_up(m.model.layers[i].self_attn).normal_(std=0.2, generator=torch.Generator().manual_seed(2))
        moved = m.model.layers[state_layers[0]].self_attn(x, pe, seq)[0]
    assert (moved - window_reference(m.model.layers[state_layers[0]].self_attn.swa, x, pe, W, SINKS)).abs().max() > 1e-3
    ids = torch.randint(3, 128, (2, 14), generator=torch.Generator().manual_seed(0))
    assert cached_decode_gap(m, ids, 7)[1] <= 1e-4


def test_hla_window_cache_has_a_fixed_size(dense_checkpoint, tmp_path):
    _, src = dense_checkpoint("llama")
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--to", "hla", "--hla-sliding-window", str(W),
                     "--no-progress"]) == 0
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    sizes = []
    with torch.no_grad():
        for T in (8, 40):
            out = m(torch.randint(3, 128, (1, T)), use_cache=True)
            cache = getattr(out, CACHE_FIELD)
            sizes.append(cache.nbytes())
            m(torch.randint(3, 128, (1, 1)), **{CACHE_FIELD: cache}, use_cache=True)
            sizes.append(cache.nbytes())
    assert len(set(sizes)) == 1
    assert {"S", "F", "swa_k", "swa_v", "swa_pos"} <= set(cache.layers[0].tensors)


def test_hla_window_needs_the_gate():
    from subquadratic.families.hla.configuration import HLAConfig

    with pytest.raises(ValueError, match="needs output_gate"):
        HLAConfig(hla_sliding_window=8, output_gate=False)


def test_decode_writes_the_ring_and_the_sinks_in_place(dense_checkpoint, tmp_path):
    """A prompt shorter than the sinks, then one-token steps: the sink tokens are written during decode,
    into the tensors the cache already holds (what a captured decode step replays), and the logits
    equal the full forward's."""
    _, src = dense_checkpoint("llama")
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--to", "hla", "--hla-sliding-window", str(W),
                     "--no-progress"]) == 0
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.g_proj.weight.normal_(std=0.2, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    assert cached_decode_gap(m, ids, 2)[1] <= 1e-4
    with torch.no_grad():
        out = m(ids[:, :2], use_cache=True)
        cache = getattr(out, CACHE_FIELD)
        m(ids[:, 2:3], **{CACHE_FIELD: cache}, use_cache=True)
        held = {n: t.data_ptr() for n, t in cache.layers[0].tensors.items() if n.startswith("swa_")}
        assert set(held) == {"swa_k", "swa_v", "swa_pos", "swa_sink_k", "swa_sink_v", "swa_sink_pos"}
        m(ids[:, 3:4], **{CACHE_FIELD: cache}, use_cache=True)  # position 3: still a sink token
    assert {n: cache.layers[0].tensors[n].data_ptr() for n in held} == held
    assert cache.layers[0].tensors["swa_sink_pos"].tolist() == [[0, 1, 2, 3]] * 2
