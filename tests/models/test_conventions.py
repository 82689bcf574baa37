"""Standard Transformers behaviour for every family, checked the way Transformers' ModelTesterMixin
checks its own models (tests/test_modeling_common.py): tuple outputs, hidden states and attention
weights from the config, inputs_embeds, batching, gradients, save / load, resized embeddings, the
capability flags, fp16 and device_map="auto".

One tiny configuration per case: SPLA with a budget covering the context and a sparse SPLA whose
budget (3 blocks of 4) is smaller than the 24-token inputs, SSE, SSE-H, HLA and HLA with a softmax
layer.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationMixin

from subquadratic import (
    HLAConfig,
    HLAForCausalLM,
    SPLAConfig,
    SPLAForCausalLM,
    SSEConfig,
    SSEForCausalLM,
)
from subquadratic.families.hla.configuration import TINY_PRESETS as HLA_PRESETS
from subquadratic.families.sse.configuration import PRESETS as SSE_PRESETS
from subquadratic.modeling.base import CACHE_FIELD
from subquadratic.registry import mixer

pytestmark = pytest.mark.usefixtures("one_thread")

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES = {
    "spla": (SPLAConfig, SPLAForCausalLM, dict(_SMALL, block_size=8, top_k_blocks=4)),
    "spla-sparse": (SPLAConfig, SPLAForCausalLM, dict(_SMALL, block_size=4, top_k_blocks=3, num_local_blocks=1)),
    "sse": (SSEConfig, SSEForCausalLM, SSE_PRESETS["tiny"]),
    "sse-h": (SSEConfig, SSEForCausalLM, dict(SSE_PRESETS["tiny"], num_hidden_layers=3,
                                              mixer_types=["sse", "full_attention", "sse"])),
    "hla": (HLAConfig, HLAForCausalLM, HLA_PRESETS["tiny"]),
    "hla-hybrid": (HLAConfig, HLAForCausalLM, HLA_PRESETS["tiny-hybrid"]),
}
T = 24  # beyond the sparse SPLA budget of 12 tokens, and more than one SSE / HLA chunk of 16


def make(case: str, seed: int = 0, **overrides):
    cfg_cls, model_cls, fields = CASES[case]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**fields, **overrides})).eval()
    with torch.no_grad():  # new parameters away from their neutral init, so every mixer term counts
        for name, p in model.named_parameters():
            if "rla_norm" in name or name.endswith("lora_b.weight"):
                p.copy_(0.5 * torch.randn_like(p))
    return model


def ids(B: int = 2, T: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=list(CASES))
def case(request) -> str:
    return request.param


def test_sparse_spla_case_is_sparse():
    cfg = make("spla-sparse").config
    assert cfg.budget_tokens < T


def test_return_dict_false_and_config_return_dict(case):
    model = make(case)
    x = ids()
    with torch.no_grad():
        ref = model(x, labels=x)
        tup = model(x, labels=x, return_dict=False)
        model.config.return_dict = False
        from_config = model(x, labels=x)
        base = model.model(x)
    assert isinstance(tup, tuple) and isinstance(from_config, tuple) and isinstance(base, tuple)
    assert torch.equal(tup[0], ref.loss) and torch.equal(tup[1], ref.logits)
    assert torch.equal(from_config[1], ref.logits)
    with torch.no_grad():
        assert not isinstance(model(x, return_dict=True), tuple)  # the keyword wins over the config
    # the tuple is the ModelOutput's non-None fields in order: (loss, logits, cache, ...)
    assert len(tup) == len(ref.to_tuple())


def test_hidden_states_from_keyword_and_config(case):
    model = make(case)
    x = ids()
    L = model.config.num_hidden_layers
    with torch.no_grad():
        assert model(x).hidden_states is None
        by_kw = model(x, output_hidden_states=True).hidden_states
        model.config.output_hidden_states = True
        by_cfg = model(x).hidden_states
        last = model.model(x, output_hidden_states=False).last_hidden_state
        off = model(x, output_hidden_states=False).hidden_states
    assert off is None
    assert len(by_kw) == len(by_cfg) == L + 1
    for a, b in zip(by_kw, by_cfg, strict=True):
        assert a.shape == (2, T, model.config.hidden_size) and torch.equal(a, b)
    assert torch.equal(by_kw[-1], last)  # the last entry is after the final norm, as in Llama
    assert torch.equal(by_kw[0], model.model.embed_tokens(x))


STATE_ONLY = ("sse", "hla")  # every layer keeps a state: no attention weights anywhere


@pytest.mark.parametrize("case", STATE_ONLY)
def test_output_attentions_is_a_clear_error_for_models_of_state_layers_only(case):
    model = make(case)
    with pytest.raises(ValueError, match=r"output_attentions is not available: every layer of this model is a state "
                                         r"layer \('(sse|hla)'\)"):
        model(ids(), output_attentions=True)
    model.set_attn_implementation("eager")  # Transformers allows the config switch with eager only
    model.config.output_attentions = True
    with pytest.raises(ValueError, match="output_attentions is not available"):
        model(ids())


@pytest.mark.parametrize("case", [c for c in CASES if c not in STATE_ONLY])
def test_output_attentions_gives_the_weights_of_each_layer_that_forms_them(case):
    """One entry per softmax or SPLA layer, in layer order, [B, HQ, T, T] (rows summing to one, causal,
    real queries never on padding); state layers (SSE, HLA) have none, as Transformers' in-tree
    hybrids (Qwen3-Next, Jamba, Falcon-H1) record only their attention layers; asking changes no logit."""
    model = make(case)
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    with torch.no_grad():
        out = model(x, attention_mask=mask, output_attentions=True)
        plain = model(x, attention_mask=mask)
    torch.testing.assert_close(out.logits, plain.logits, rtol=1e-5, atol=1e-5)
    kinds = [k for k in model.config.mixer_types if mixer(k).computes_attention_weights]
    assert kinds and len(out.attentions) == len(kinds) == len(model.weight_layers())
    for a in out.attentions:
        assert a.shape == (2, model.config.num_attention_heads, T, T)
        torch.testing.assert_close(a[0].sum(-1), torch.ones_like(a[0, :, :, 0]))
        torch.testing.assert_close(a[1, :, 5:].sum(-1), torch.ones_like(a[1, :, 5:, 0]))
        assert torch.all(a[0].triu(1) == 0) and torch.all(a[1, :, 5:].triu(6) == 0)  # causal (row 1 from 5 on)
        assert torch.all(a[1, :, 5:, :5] == 0)


@pytest.mark.parametrize("case", [c for c in CASES if c not in STATE_ONLY])
def test_outputs_with_attentions_agree_across_return_types_and_implementations(case, tmp_path):
    """As Transformers' test_model_outputs_equivalence and test_eager_matches_sdpa_inference (with
    output_attentions) check: the tuple holds the dict's fields, and an eager model asked for weights
    gives the logits of an SDPA model that is not."""
    model = make(case)
    x = ids()
    with torch.no_grad():
        d = model(x, output_attentions=True, output_hidden_states=True, use_cache=False)
        t = model(x, output_attentions=True, output_hidden_states=True, use_cache=False, return_dict=False)
    logits, hidden, attentions = t
    assert torch.equal(logits, d.logits) and len(hidden) == len(d.hidden_states)
    assert all(torch.equal(a, b) for a, b in zip(attentions, d.attentions, strict=True))
    model.save_pretrained(tmp_path)
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        with_weights = eager(x, output_attentions=True).logits
        sdpa = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()(x).logits
    torch.testing.assert_close(with_weights, sdpa, rtol=1e-4, atol=1e-5)


HYBRIDS = ("sse-h", "hla-hybrid")


@pytest.mark.parametrize("case", [*HYBRIDS, "spla"])
def test_attention_outputs_pass_transformers_generic_checks(case):
    """What Transformers' ModelTesterMixin / GenerationTesterMixin check of `attentions`
    (test_attention_outputs, test_retain_grad_hidden_states_attentions, the generate dict outputs'
    `_check_attentions_for_generate`), with the count of attention layers as Transformers' hybrid
    tests count it: a tuple of tensors, one per attention layer, that holds gradients, and in
    generate one such tuple per step, [B, HQ, prompt, prompt] at the first, [B, HQ, 1, prompt + i] after."""
    model = make(case)
    cfg = model.config
    n = sum(mixer(k).computes_attention_weights for k in cfg.mixer_types)
    if case in HYBRIDS:
        assert 0 < n < cfg.num_hidden_layers
    x, mask = ids(), torch.ones(2, T, dtype=torch.long)
    mask[1, :3] = 0
    model.set_attn_implementation("eager")
    model.config.output_attentions = model.config.output_hidden_states = True
    out = model(x, attention_mask=mask)  # from the config, as test_attention_outputs asks
    assert isinstance(out.attentions, tuple) and len(out.attentions) == n
    assert [a.shape for a in out.attentions] == [(2, cfg.num_attention_heads, T, T)] * n
    hidden, weights = out.hidden_states[0], out.attentions[0]  # test_retain_grad_hidden_states_attentions
    hidden.retain_grad()
    weights.retain_grad()
    out.logits.flatten()[0].backward(retain_graph=True)
    assert hidden.grad is not None and weights.grad is not None and weights.grad.abs().sum() > 0
    model.config.output_attentions = model.config.output_hidden_states = False
    P, new = 10, 4
    with torch.no_grad():
        gen = model.generate(x[:, :P], attention_mask=mask[:, :P], max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, output_attentions=True, return_dict_in_generate=True, pad_token_id=0)
    assert isinstance(gen.attentions, tuple) and len(gen.attentions) == new
    for i, step in enumerate(gen.attentions):
        assert isinstance(step, tuple) and len(step) == n
        expected = (2, cfg.num_attention_heads, P if i == 0 else 1, P + i)
        assert [a.shape for a in step] == [expected] * n, (i, [a.shape for a in step])


def test_spla_weights_inside_the_budget_are_the_dense_model_weights():
    """Inside its budget SPLA is softmax attention: its weights equal those of the same model with
    softmax layers (the same parameters)."""
    spla = make("spla")
    dense = make("spla", mixer_types=["full_attention"] * 2)
    dense.load_state_dict(spla.state_dict(), strict=False)
    x = ids()
    with torch.no_grad():
        a, b = spla(x, output_attentions=True), dense(x, output_attentions=True)
    for wa, wb in zip(a.attentions, b.attentions, strict=True):
        torch.testing.assert_close(wa, wb, rtol=1e-5, atol=1e-6)


def test_sparse_spla_weights_sit_on_the_selected_blocks():
    """Beyond the budget each query's weights cover exactly its selected blocks (the model's own
    selection, recomputed from the layer's keys) and at most top_k_blocks x block_size keys."""
    from subquadratic.kernels.spla import BlockStats, SPLAParams, select_blocks

    model = make("spla-sparse")
    cfg = model.config
    x = ids(B=1)
    keys = {}
    layer = model.model.layers[0].self_attn
    hook = layer.register_forward_hook(lambda m, args, out: keys.update(args=args))
    with torch.no_grad():
        out = model(x, output_attentions=True, use_cache=False)
    hook.remove()
    w = out.attentions[0]  # [1, HQ, T, T]
    hidden, pe, seq = keys["args"][:3]
    with torch.no_grad():
        q, k, _ = layer.project(hidden, pe, heads_first=False)
    params = SPLAParams.from_config(cfg)
    stats = BlockStats.empty(1, k.shape[2], k.shape[3], "cpu").add(k, seq.positions, cfg.block_size)
    sel = select_blocks(q, stats, seq.positions, params)  # [1, H, T, NB]
    blocks = torch.arange(T) // cfg.block_size
    chosen = sel[..., blocks] & (torch.arange(T)[None, :] <= torch.arange(T)[:, None])  # [1, H, T, T]
    chosen = chosen.repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, dim=1)
    assert torch.equal(w > 0, chosen)
    assert int((w[0] > 0).sum(-1).max()) <= cfg.budget_tokens < T


@pytest.mark.parametrize("case", [c for c in CASES if c not in STATE_ONLY])
def test_attentions_of_generate_and_their_gradients(case):
    """generate(output_attentions=True, return_dict_in_generate=True) returns every step's weights
    per softmax or SPLA layer (prefill [B, HQ, T, T], then [B, HQ, 1, T + i]; state layers have
    none), as Transformers' *_generate_dict_output* tests check; the weights join the graph
    (test_retain_grad_hidden_states_attentions)."""
    model = make(case)
    n, HQ = len(model.weight_layers()), model.config.num_attention_heads
    x = ids(B=2)
    out = model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None,
                         output_attentions=True, return_dict_in_generate=True)
    assert len(out.attentions) == 3 and all(len(step) == n for step in out.attentions)
    for i, step in enumerate(out.attentions):
        for a in step:
            assert a.shape == ((2, HQ, T, T) if i == 0 else (2, HQ, 1, T + i))
            torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]))
    model.train()
    res = model(x, output_attentions=True, output_hidden_states=True, use_cache=False)
    first = res.attentions[0]
    first.retain_grad()
    res.hidden_states[0].retain_grad()
    res.logits.sum().backward()
    assert first.grad is not None and first.grad.abs().sum() > 0
    assert res.hidden_states[0].grad is not None


@pytest.mark.parametrize("family", ["spla", "sse", "hla"])
def test_output_attentions_returns_softmax_weights(family):
    """Layers of softmax attention (here every layer) return their weights: [B, HQ, T, S], rows
    summing to one, zero on future keys and padding, through the eager path whatever the attention
    implementation; the outputs equal those without weights."""
    model = make(family, mixer_types=["full_attention"] * 2)
    assert model.config._attn_implementation == "sdpa"
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :5] = 0  # left padding in row 1
    with torch.no_grad():
        out = model(x, attention_mask=mask, output_attentions=True)
        plain = model(x, attention_mask=mask)
        as_tuple = model(x, attention_mask=mask, output_attentions=True, return_dict=False, use_cache=False)
    att = out.attentions
    assert len(att) == 2 and all(a.shape == (2, 4, T, T) for a in att)
    torch.testing.assert_close(out.logits, plain.logits, rtol=1e-5, atol=1e-5)
    for a in att:
        torch.testing.assert_close(a[0].sum(-1), torch.ones(4, T))
        assert torch.all(a[0].triu(1) == 0)
        assert torch.all(a[1, :, 5:, :5] == 0)  # real queries never see padding
    assert len(as_tuple) == 2 and len(as_tuple[1]) == 2  # (logits, attentions)


def test_causal_lm_classes_name_generation_mixin():
    for cls in (SPLAForCausalLM, SSEForCausalLM, HLAForCausalLM):
        assert GenerationMixin in cls.__bases__ and cls.can_generate()


def test_capability_flags_tell_the_truth(case, tmp_path):
    model = make(case)
    flags = type(model)
    assert flags._supports_sdpa and not flags._supports_flash_attn and not flags._supports_flex_attn
    assert flags._is_stateful and flags.supports_gradient_checkpointing
    assert not flags._supports_context_parallel and not flags._can_compile_fullgraph
    model.save_pretrained(tmp_path)
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
        for impl in ("eager", "sdpa"):  # both supported implementations load and agree
            m = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=impl).eval()
            assert m.config._attn_implementation == impl
            torch.testing.assert_close(m(x).logits, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises((ValueError, ImportError)):  # unsupported: refused at load, not silently ignored
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flex_attention")


def test_inputs_embeds_equal_input_ids(case):
    model = make(case)
    x = ids()
    with torch.no_grad():
        a = model(x).logits
        b = model(inputs_embeds=model.get_input_embeddings()(x)).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="exactly one"):
        model(x, inputs_embeds=model.get_input_embeddings()(x))


def test_batching_equivalence(case):
    """Each row of a batch gives what it gives alone (ModelTesterMixin.test_batching_equivalence)."""
    model = make(case)
    x = ids(B=3)
    with torch.no_grad():
        batched = model(x, output_hidden_states=True)
        for r in range(3):
            row = model(x[r:r + 1], output_hidden_states=True)
            torch.testing.assert_close(batched.logits[r:r + 1], row.logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(batched.hidden_states[-1][r:r + 1], row.hidden_states[-1], rtol=1e-4, atol=1e-4)


def test_training_gives_every_parameter_a_gradient(case):
    model = make(case).train()
    x = ids()
    out = model(x, labels=x)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    assert torch.isfinite(out.loss)


def test_gradient_checkpointing_gives_the_same_gradients(case):
    model = make(case).train()
    x = ids()
    model(x, labels=x).loss.backward()
    ref = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model(x, labels=x).loss.backward()
    for n, p in model.named_parameters():
        if ref[n] is None:
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-5, msg=n)


def test_save_load_and_config_round_trip(case, tmp_path):
    model = make(case)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    def fields(cfg) -> dict:
        return {k: v for k, v in cfg.to_dict().items() if k not in ("_name_or_path", "auto_map")}

    assert fields(loaded.config) == fields(type(model.config).from_dict(model.config.to_dict())) == fields(model.config)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


def test_resize_token_embeddings(case):
    model = make(case)
    model.resize_token_embeddings(model.config.vocab_size + 8)
    assert model.config.vocab_size == 136
    x = ids()
    x[0, 0] = 135
    with torch.no_grad():
        assert model(x).logits.shape == (2, T, 136)


def test_fp16_forward_and_generate(case, tmp_path):
    """Half precision end to end on CPU: the forward agrees with fp32 within fp16 rounding, and a
    checkpoint loads in fp16 (mixer states are accumulated in fp32) and generates."""
    model = make(case)
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
        half = make(case).half()
        got = half(x).logits
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), ref, rtol=0.05, atol=0.05)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16).eval()
    assert loaded.dtype == torch.float16
    out = loaded.generate(x[:1, :8], max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert out.shape == (1, 12)


def test_device_map_auto_loads_and_runs(case, tmp_path):
    model = make(case)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto").eval()
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert {p.device for p in loaded.parameters()} == {expected}
    x = ids().to(loaded.device)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits.cpu(), model(ids()).logits, rtol=1e-4, atol=1e-4)
    out = loaded.generate(x[:1, :8], max_new_tokens=3, do_sample=False, eos_token_id=None)
    assert out.shape == (1, 11)


def test_use_cache_false_returns_no_cache_and_cache_continues(case):
    model = make(case)
    x = ids()
    with torch.no_grad():
        assert getattr(model(x, use_cache=False), CACHE_FIELD) is None
        full = model(x).logits
        first = model(x[:, :T - 4])
        rest = model(x[:, T - 4:], **{CACHE_FIELD: getattr(first, CACHE_FIELD)})
    torch.testing.assert_close(rest.logits, full[:, T - 4:], rtol=1e-4, atol=1e-4)
