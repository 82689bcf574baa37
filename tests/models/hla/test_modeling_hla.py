"""HLA models: the shared model checks (HLA and an HLA / softmax hybrid), dispatch, the three forms
(chunked, recurrent, O(T^3)) in the mixer and the model, the other variants' cache and padding, cache
bytes, training on associative recall, long-sequence stability.

Tiny presets only (hidden 64, vocab 128); CPU; the whole file runs in well under a minute and a half.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import subquadratic  # noqa: F401  (registers the Auto classes)
from subquadratic import HLAConfig, HLAForCausalLM
from subquadratic.families.hla.configuration import tiny_hla_config
from subquadratic.families.hla.modeling import HLAAttention
from subquadratic.kernels.hla import hla_attention, hla_chunked, hla_recurrent
from subquadratic.modeling.base import SequenceInfo
from subquadratic.modeling.cache import RecurrentLayer, positions_from_mask

from ..common import ModelTester, ModelTesterMixin

#: configurations exercising every option: default hla2; normalised hla2 with a constant decay;
#: ahla with RoPE, Qwen3-style qk-norm, Qwen2-style qkv bias and no gate. (The hybrid: TestHLAHybrid.)
CONFIGS = {
    "hla2": dict(),
    "hla2-normalized-constant": dict(hla_normalize=True, decay_mode="constant"),
    "ahla-rope-qknorm": dict(
        hla_variant="ahla", hla_rope=True, qk_norm=True, qkv_bias=True, output_gate=False, qk_scale=2.0
    ),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(name="hla2", dtype=torch.float32, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = tiny_hla_config(**{**CONFIGS[name], **overrides})
    return HLAForCausalLM(cfg).to(dtype).eval()


def rand_ids(B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (B, T), generator=g)


# --- config and dispatch -------------------------------------------------------------------------


def test_config_fields_and_checks():
    cfg = tiny_hla_config("tiny-hybrid", hla_variant="ahla")
    assert cfg.model_type == "hla" and cfg.mixer_types == ["hla", "full_attention", "hla"]
    again = HLAConfig.from_dict(cfg.to_dict())
    assert again.hla_variant == "ahla" and again.mixer_types == cfg.mixer_types
    assert HLAConfig(num_hidden_layers=2).mixer_types == ["hla", "hla"]
    bad = {
        "hla_variant": dict(hla_variant="hla3"),
        "decay_mode": dict(decay_mode="learned"),
        "decay_init_min": dict(decay_init_min=0.999, decay_init_max=0.9),
        "hla_chunk_size": dict(hla_chunk_size=0),
        "kernel_backend": dict(kernel_backend="cuda"),
        "mixer_types": dict(mixer_types=["hla"]),
    }
    for match, kw in bad.items():
        with pytest.raises(ValueError, match=match):
            tiny_hla_config(**kw)
    with pytest.raises(ValueError, match="unknown preset"):
        tiny_hla_config("huge")


def test_dispatch_paths():
    g = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(2, 9, 3, 8, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(2, 9, 3, 8, generator=g)
    la = F.logsigmoid(torch.randn(2, 9, 3, generator=g) + 2)
    kw = dict(chunk_size=4, normalize=False, eps=1e-6, variant="hla2")
    o, st = hla_attention(q, k, v, la, **kw)
    o_ref, st_ref = hla_chunked(q, k, v, la, chunk_size=4)
    assert torch.equal(o, o_ref) and torch.equal(st.F, st_ref.F)
    o1, _ = hla_attention(q[:, :1], k[:, :1], v[:, :1], la[:, :1], st, **kw)  # decode: the recurrence
    assert torch.equal(o1, hla_recurrent(q[:, :1], k[:, :1], v[:, :1], la[:, :1], st)[0])
    o_rec, _ = hla_attention(q, k, v, la, backend="naive", **kw)
    assert torch.equal(o_rec, hla_recurrent(q, k, v, la)[0])
    assert (o_rec - o).abs().max() <= 1e-5
    assert torch.equal(hla_attention(q, k, v, la, backend="torch", **kw)[0], o)
    with pytest.raises(ValueError, match="CUDA|chunk_size"):  # off CUDA; on CUDA chunks of 4 are not taken
        hla_attention(q, k, v, la, backend="triton", **kw)
    with pytest.raises(ValueError, match="backend"):
        hla_attention(q, k, v, la, backend="fast", **kw)


def test_fresh_init_decays_and_names():
    m = make_model()
    attn = m.model.layers[0].self_attn
    assert isinstance(attn, HLAAttention)
    alpha = torch.sigmoid(attn.decay_bias.detach())
    assert torch.allclose(alpha, torch.tensor([0.9, 0.9536, 0.9785, 0.99]), atol=1e-3)
    names = {n.split("self_attn.")[1] for n, _ in m.named_parameters() if "layers.0.self_attn." in n}
    assert names == {
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
        "decay_bias", "decay_proj.weight", "g_proj.weight", "o_norm.weight",
    }


# --- the three forms agree ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["hla2", "ahla"])
@pytest.mark.parametrize("normalize", [False, True])
def test_mixer_three_forms_agree_fp64(variant, normalize):
    """The mixer through the chunked form, the recurrence and the O(T^3) definition (fp64)."""
    cfg = tiny_hla_config(hla_variant=variant, hla_normalize=normalize, hla_chunk_size=4, hla_rope=True)
    torch.manual_seed(0)
    attn = HLAAttention(cfg, 0).double()
    x = torch.randn(2, 23, cfg.hidden_size, dtype=torch.float64)
    valid = torch.ones(2, 23, dtype=torch.bool)
    valid[1, :5] = False  # left padding in row 1
    pos = positions_from_mask(valid)
    seq = SequenceInfo(positions=pos, valid=valid, key_positions=pos)
    cos_sin = LlamaRotaryEmbedding(config=cfg)(x, pos.clamp(min=0))
    outs = {}
    for backend in ("torch", "naive"):
        cfg.kernel_backend = backend
        outs[backend] = attn(x, cos_sin, seq)[0]
    definition = SequenceInfo(positions=pos, valid=valid, key_positions=pos,
                              plan_settings={"hla": {"path": "definition"}})  # the O(T^3) definition
    ref = attn(x, cos_sin, definition)[0]
    for backend, o in outs.items():
        err = ((o - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-10, (backend, err)
    assert torch.equal(ref[1, :5], torch.zeros_like(ref[1, :5]))  # padding outputs nothing


# --- model level -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hla2", "ahla-rope-qknorm", "hla2-normalized-constant"])
def test_chunked_equals_recurrent_model_level(name):
    ids = rand_ids(2, 37)
    chunked = make_model(name, hla_chunk_size=4)
    serial = make_model(name, kernel_backend="naive")
    with torch.no_grad():
        diff = (chunked(ids).logits - serial(ids).logits).abs().max().item()
    # measured 2.7e-7 / 5.8e-7 / 3.9e-7. The normalised form divides by q^T eta, which can pass near 0
    # at random init, amplifying fp32 rounding up to 1/eps = 1e3 (another init measured 7e-5, both fp32
    # paths equally far from fp64), hence its looser bound.
    assert diff <= (5e-4 if "normalized" in name else 1e-4), diff
    # fp64: values to 1e-10 and gradients of the chunked path match the recurrence
    grads = []
    for m in (chunked.double(), serial.double()):
        out = m(ids, labels=ids, use_cache=False)
        out.loss.backward()
        grads.append((out.logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (l_c, g_c), (l_s, g_s) = grads
    assert (l_c - l_s).abs().max().item() <= 1e-10
    for n, gc in g_c.items():
        assert (gc - g_s[n]).abs().max().item() <= 1e-10 * max(1.0, g_s[n].abs().max().item()), n


@pytest.mark.parametrize("name", ["ahla-rope-qknorm", "hla2-normalized-constant"])  # the others: shared checks
def test_prefill_then_decode_equals_full_forward(name):
    m = make_model(name, hla_chunk_size=4)
    ids = rand_ids(2, 30, seed=2)
    with torch.no_grad():
        full = m(ids, use_cache=False).logits
        cache = m.new_cache()
        parts = [m(ids[:, :11], cache=cache).logits, m(ids[:, 11:18], cache=cache).logits]  # two prefills
        parts += [m(ids[:, t : t + 1], cache=cache).logits for t in range(18, 30)]  # decode
    diff = (torch.cat(parts, 1) - full).abs().max().item()
    assert diff <= 1e-4, diff
    assert cache.get_seq_length() == 30
    for layer, kind in zip(cache.layers, m.config.mixer_types, strict=True):
        if kind == "hla":
            assert isinstance(layer, RecurrentLayer)
            assert all(t.dtype == torch.float32 and t.shape[0] == 2 for t in layer.state.values())


# --- cache and generation --------------------------------------------------------------------------


def test_cache_bytes_do_not_grow_with_context():
    m = make_model()
    sizes = []
    for T in (64, 512):
        cache = m.new_cache()
        with torch.no_grad():
            m(rand_ids(1, T), cache=cache)
            m(rand_ids(1, 1), cache=cache)
        sizes.append(cache.nbytes())
    cfg = m.config
    hq, d = cfg.num_attention_heads, cfg.head_dim
    assert sizes[0] == sizes[1] == cfg.num_hidden_layers * hq * (d * d + d * d) * 4  # S and F, fp32


@pytest.mark.parametrize("name", ["hla2-normalized-constant"])  # hla2 and the hybrid: shared checks
def test_left_padded_batch_equals_per_sequence(name):
    m = make_model(name)
    prompts = [rand_ids(1, n, seed=n)[0] for n in (5, 13, 9)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    batched = m.generate(ids, attention_mask=mask, **gen)[:, width:]
    with torch.no_grad():
        logits_b = m(ids, attention_mask=mask, use_cache=False).logits
    for i, p in enumerate(prompts):
        single = m.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **gen)[:, len(p) :]
        assert torch.equal(batched[i], single[0]), (i, batched[i], single[0])
        with torch.no_grad():
            logits_s = m(p[None], use_cache=False).logits[0]
        assert (logits_b[i, width - len(p) :] - logits_s).abs().max().item() <= 1e-4


# --- training -----------------------------------------------------------------------------------------


def recall_batch(g, B=32, n_pairs=4, n_keys=16, n_values=16):
    """Associative recall: k1 v1 ... k4 v4, then the keys again in random order, each followed by its
    value. Loss on the recalled values only (keys: tokens 3.., values: 67..)."""
    keys = torch.stack([torch.randperm(n_keys, generator=g)[:n_pairs] for _ in range(B)]) + 3
    vals = torch.randint(67, 67 + n_values, (B, n_pairs), generator=g)
    order = torch.stack([torch.randperm(n_pairs, generator=g) for _ in range(B)])
    qk, qv = keys.gather(1, order), vals.gather(1, order)
    ids = torch.cat([torch.stack([keys, vals], -1), torch.stack([qk, qv], -1)], 1).reshape(B, -1)
    labels = torch.full_like(ids, -100)
    labels[:, 2 * n_pairs + 1 :: 2] = qv
    return ids, labels


def test_training_learns_associative_recall():
    initial, final = _train_recall(steps=1000)
    # Guessing among the 16 values gives ln 16 = 2.77, so a final loss well below it means the model
    # recalls values from context. Final loss (mean of the last 20 steps) over init / data seeds
    # (0,1) (1,2) (2,3) (3,4) (4,5) (5,6), Intel Xeon: after 600 steps 2.03 1.87 2.31 2.33 2.33 2.39
    # (an AMD EPYC gave 2.41 for (0,1): 600 steps sit at the bound below); after 1000 steps, seeds
    # (0,1) (2,3) (4,5) (5,6): 1.63 2.05 1.96 2.10, 0.26 under the bound of 2.36 at worst. Initial
    # loss 4.86-4.90 (~ln 128) for all.
    assert final < 0.5 * initial, (initial, final)
    assert final < 0.85 * torch.log(torch.tensor(16.0)).item(), final


def _train_recall(steps: int, init_seed: int = 0, data_seed: int = 1) -> tuple[float, float]:
    torch.manual_seed(init_seed)
    m = HLAForCausalLM(tiny_hla_config()).train()
    opt = torch.optim.AdamW(m.parameters(), lr=5e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(data_seed)
    losses = []
    for _ in range(steps):
        ids, labels = recall_batch(g)
        loss = m(ids, labels=labels, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses[0], sum(losses[-20:]) / 20


# --- stability ---------------------------------------------------------------------------------------


def test_long_sequence_bf16_is_finite_and_bounded():
    m = make_model(dtype=torch.bfloat16, hla_chunk_size=64)
    rms = []

    def hook(_module, _inputs, output):
        o = output[0].float()
        rms.append((o[:, :512].pow(2).mean().sqrt().item(), o[:, -512:].pow(2).mean().sqrt().item()))
        assert torch.isfinite(o).all()

    handles = [layer.self_attn.register_forward_hook(hook) for layer in m.model.layers]
    with torch.no_grad():
        out = m(rand_ids(1, 4096), use_cache=False, output_hidden_states=True)
    for h in handles:
        h.remove()
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()
    assert all(torch.isfinite(h.float()).all() for h in out.hidden_states)
    for head, tail in rms:  # the end of a long sequence behaves like the beginning
        assert 0.5 < tail / head < 2.0, rms


class TestHLA(ModelTesterMixin):
    tester = ModelTester("hla", lambda seed: HLAForCausalLM(tiny_hla_config(hla_chunk_size=8)))


def hla_window(seed: int = 0) -> HLAForCausalLM:
    """HLA with the window branch (window 8 under 24-token inputs), its gate made non-zero so that both
    branches carry signal."""
    torch.manual_seed(seed)
    m = HLAForCausalLM(tiny_hla_config(hla_chunk_size=8, hla_sliding_window=8))
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.g_proj.weight.normal_(std=0.1)
    return m.eval()


class TestHLAWindow(ModelTesterMixin):
    tester = ModelTester("hla-swa", hla_window, fast_path_slack=20)


class TestHLAHybrid(ModelTesterMixin):
    """HLA, softmax, HLA."""

    tester = ModelTester("hla-hybrid", lambda seed: HLAForCausalLM(tiny_hla_config("tiny-hybrid", hla_chunk_size=8)))
