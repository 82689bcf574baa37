"""The recall measures beside passkey and NIAH: the copy measure (against hand-computed values of an
induction oracle, which copies from any distance, and the same oracle limited to a window, which
cannot copy from beyond it), multi-value needles and variable tracking (prompts, and scoring against
an oracle generate())."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from subquadratic.evaluation import EvaluationError, copying, evaluate, mv_niah, plan, variable_tracking
from subquadratic.evaluation.copying import copy_distances, copy_sequences
from subquadratic.evaluation.report import markdown_table, plot_results
from subquadratic.evaluation.retrieval import TEMPLATES, VT_LINKS, draw_prompt, items_named, min_length

V = 4096  # the oracle's vocabulary
HIT = 10.0  # the oracle's logit for the token it copies


class _Decoder(torch.nn.Module):
    def __init__(self, window: int | None):
        super().__init__()
        self.window = window

    def forward(self, input_ids, **_):
        """hidden [B, T, V]: HIT at the token that followed the most recent earlier occurrence of the
        last three tokens (within `window` positions back), zeros where there is none."""
        B, T = input_ids.shape
        hidden = torch.zeros(B, T, V)
        for b in range(B):
            ids = input_ids[b].tolist()
            for t in range(2, T):
                lo = 2 if self.window is None else max(2, t - self.window)
                for j in range(t - 1, lo - 1, -1):
                    if ids[j - 2:j + 1] == ids[t - 2:t + 1]:
                        hidden[b, t, ids[j + 1]] = HIT
                        break
        return SimpleNamespace(last_hidden_state=hidden)


class InductionOracle(torch.nn.Module):
    """A causal LM that copies exactly: logits = identity(hidden) of `_Decoder`."""

    def __init__(self, window: int | None = None):
        super().__init__()
        self.config = SimpleNamespace()
        self.decoder = _Decoder(window)
        self.head = torch.nn.Linear(V, V, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(V))

    def get_decoder(self):
        return self.decoder

    def get_output_embeddings(self):
        return self.head


def distinct_stream(n: int, seed: int = 0) -> torch.Tensor:
    """n distinct token ids: no three tokens recur, so the only copy is the one the measure writes."""
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:n]


def test_copy_sequences_write_the_passage_d_tokens_later():
    window = torch.arange(100)
    rows = copy_sequences(window, [10, 30], passage=8)
    assert rows.shape == (2, 100)
    assert rows[0, 92:].tolist() == list(range(82, 90)) and rows[0, :92].tolist() == list(range(92))
    assert rows[1, 92:].tolist() == list(range(62, 70))
    assert copy_distances(200, passage=16, min_distance=16) == [16, 32, 64, 128, 183]
    assert copy_distances(32, passage=16) == []


def test_copy_measure_matches_hand_computed_values_and_tells_a_window_apart():
    P, L, W = 16, 160, 40
    ids = distinct_stream(2 * L)
    full = copying(InductionOracle(), ids, [L], passage=P, min_distance=16, max_windows=2)[L]
    window = copying(InductionOracle(window=W), ids, [L], passage=P, min_distance=16, max_windows=2)[L]
    assert sorted(full["by_distance"]) == [16, 32, 64, 128, 143] and full["windows"] == 2
    # the first occurrence has no earlier copy: every token uniform, ppl = V
    hit = math.log(1 + (V - 1) * math.exp(-HIT))  # NLL of a copied token
    second = math.exp((2 * math.log(V) + (P - 3) * hit) / (P - 1))  # the copy's first two lack a 3-gram
    for d, row in full["by_distance"].items():
        assert row["ppl_first"] == pytest.approx(V, rel=1e-5)
        assert row["ppl_second"] == pytest.approx(second, rel=1e-4), d
    assert full["ratio"] == pytest.approx(second / V, rel=1e-4)
    for d, row in window["by_distance"].items():
        # within the window the limited oracle copies as the full one; beyond it, not at all
        assert row["ppl_second"] == pytest.approx(second if d <= W else V, rel=1e-4), d
    assert window["by_distance"][143]["ratio"] == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(EvaluationError, match="too short for the copy measure"):
        copying(InductionOracle(), ids, [20], passage=P)


def test_copy_runs_in_evaluate_with_a_table_and_a_plot(tmp_path):
    ids = distinct_stream(400, seed=1)
    model = InductionOracle()
    jobs, skipped = plan(None, ["copy"], [40, 200], stream_tokens=ids.numel(), max_windows=1)
    assert [(j.length, j.units) for j in jobs] == [(200, 1)]
    assert skipped["copy"] == "at 40 (a passage and its copy need 129 tokens)"
    res = evaluate(model, None, name="oracle", tasks=["copy"], seq_lens=[40, 200], data=ids, max_windows=1)
    assert set(res["tasks"]["copy"]) == {200}
    table = markdown_table([res])
    assert "copy ppl (2nd)" in table and "1 copy window only x 3 distances" in table
    pytest.importorskip("matplotlib")
    paths = plot_results([res], tmp_path)
    assert {p.name for p in paths} >= {"copy_ppl_second.png", "copy_ratio.png", "copy_by_distance.png"}


@pytest.mark.parametrize("template", ["prose", "code"])
def test_multi_value_and_variable_tracking_prompts(tokenizer, template):
    for task, n in (("mv-niah", 4), ("vt", 3)):
        L = min_length(tokenizer, task, template, n) + 60
        for depth in (0.0, 0.5, 1.0):
            prompt, answer, items = draw_prompt(tokenizer, task, template, L, n, depth, 5, random.Random(3))
            assert len(prompt) == L and len(items) == n and len(set(items)) == n
            text = tokenizer.decode(prompt)
            if task == "mv-niah":  # every value of the one key, in the needles' order
                at = [text.index(f"{v}") for v in items]
                assert all(f"{v}" in tokenizer.decode(answer) for v in items)
            else:  # the chain in order: the value, then each variable copying the one before
                first = TEMPLATES["vt", template].needle.split("{value}")[0].format(key=items[0])
                links = [VT_LINKS[template].format(key=k, prev=p) for p, k in zip(items, items[1:], strict=False)]
                at = [text.index(first)] + [text.index(x) for x in links]
                assert at == sorted(at)
                assert tokenizer.decode(answer).strip(" :]") == ", ".join(items)
            assert min(at) < len(text)


def test_items_named_scores_the_share_of_items():
    assert items_named(" 48213, 10577.", ["48213", "10577"]) == 1.0
    assert items_named(": 48213 and 999", ["48213", "10577"]) == 0.5
    assert items_named(" 482130, ABCDEF", ["48213", "ABCDE"]) == 0.0
    assert items_named(": ABCDE, QWERT", ["QWERT", "ABCDE", "ZZZZZ"]) == pytest.approx(2 / 3)


@pytest.fixture
def oracle_model(checkpoints, monkeypatch):
    """The tiny dense model with a generate() that answers with the first `keep` expected items."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoints["dense"]).eval()


def _answering(model, tokenizer, monkeypatch, task, template, keep):
    """generate() reads the expected items back from the prompt (as `draw_prompt` drew them, same seed)
    and writes the first `keep` of them."""
    def generate(input_ids, **kw):
        text = tokenizer.decode(input_ids[0])
        if task == "mv-niah":
            items = [w.strip(".") for w in text.split("is: ")[1:]]
            items = [i.split(".")[0] for i in items]
        else:
            names = [text.split("VAR ")[1].split(" =")[0]]
            while (nxt := f"= VAR {names[-1]}.") in text:
                names.append(text.split(nxt)[0].rsplit("VAR ", 1)[1].strip())
            items = names
        out = tokenizer(": " + ", ".join(items[:keep]), add_special_tokens=False)["input_ids"]
        return torch.cat([input_ids, torch.tensor([out])], dim=1)

    monkeypatch.setattr(model, "generate", generate)


@pytest.mark.parametrize(("task", "fn", "n"), [("mv-niah", mv_niah, 3), ("vt", variable_tracking, 3)])
def test_multi_item_tasks_score_the_share_named(oracle_model, tokenizer, monkeypatch, task, fn, n):
    L = min_length(tokenizer, task, "prose", n) + 40
    _answering(oracle_model, tokenizer, monkeypatch, task, "prose", keep=n)
    res = fn(oracle_model, tokenizer, [L], num_needles=n, trials=2)[L]
    assert res["accuracy"] == 1.0 and res["prompts"] == 6 and res["stderr"] == 0.0
    _answering(oracle_model, tokenizer, monkeypatch, task, "prose", keep=1)
    part = fn(oracle_model, tokenizer, [L], num_needles=n, trials=2)[L]
    assert part["accuracy"] == pytest.approx(1 / n) and part["logprob"] == res["logprob"]
    assert all(s["correct"] == pytest.approx(1 / n) for s in part["samples"])


def test_retrieval_probe_weights_equal_eager_attention(checkpoints, tokenizer):
    """The probe's mass on a span equals the eager attention weights' sum there, at the probed rows,
    and the model's output is unchanged while it probes."""
    from transformers import AutoModelForCausalLM

    from subquadratic.evaluation import retrieval_heads as rh

    model = AutoModelForCausalLM.from_pretrained(checkpoints["dense"], attn_implementation="eager").eval()
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        eager = model(input_ids=ids, output_attentions=True)
    from transformers import AttentionInterface

    probe = rh.Probe(rows=slice(80, 90), span=slice(20, 31))
    AttentionInterface.register(rh.PROBE, probe.attention)
    model.set_attn_implementation(rh.PROBE)
    with torch.no_grad():
        probed = model(input_ids=ids)
    torch.testing.assert_close(probed.logits, eager.logits, atol=1e-5, rtol=1e-5)
    for layer, weights in enumerate(eager.attentions):  # [1, HQ, T, T]
        want = weights[0, :, 80:90, 20:31].sum((-1, -2))
        torch.testing.assert_close(probe.mass[layer], want, atol=1e-5, rtol=1e-5)


def test_retrieval_head_scores_and_the_layers_they_choose(checkpoints, tokenizer):
    from transformers import AutoModelForCausalLM

    from subquadratic.evaluation.retrieval_heads import choose_retrieval_layers, layer_scores, retrieval_head_scores

    model = AutoModelForCausalLM.from_pretrained(checkpoints["dense"]).eval()
    L = min_length(tokenizer, "niah", "prose", 4) + 20
    scores = retrieval_head_scores(model, tokenizer, length=L, prompts=2)
    cfg = model.config
    assert scores.shape == (cfg.num_hidden_layers, cfg.num_attention_heads)
    assert ((scores > 0) & (scores < 1)).all()  # a mass on the needle: above zero, below all of it
    assert model.config._attn_implementation != "subquadratic_retrieval_probe"  # restored
    assert layer_scores(torch.tensor([[0.1, 0.5], [0.3, 0.2], [0.05, 0.6]])) == pytest.approx([0.5, 0.3, 0.6])
    assert choose_retrieval_layers([0.5, 0.3, 0.6, 0.3], 2) == [0, 2]
    assert choose_retrieval_layers([0.5, 0.3, 0.6, 0.3], 3) == [0, 1, 2]  # ties: the earlier layer
    with pytest.raises(ValueError, match="retrieval:4 asks for 4 softmax layers of 4"):
        choose_retrieval_layers([0.5, 0.3, 0.6, 0.3], 4)
    with pytest.raises(EvaluationError, match="a prompt needs"):
        retrieval_head_scores(model, tokenizer, length=64)


def test_convert_keeps_the_retrieval_layers(checkpoints, tmp_path):
    """`--sse-softmax-layers retrieval:1`: the layer holding the source's strongest retrieval head keeps
    softmax attention; the scores are written beside the model and the card says how it was chosen."""
    import json

    from transformers import AutoConfig

    from subquadratic.conversion import ConversionError
    from subquadratic.evaluation.retrieval_heads import choose_retrieval_layers
    from subquadratic.layer_choice import convert

    out = convert(str(checkpoints["dense"]), str(tmp_path / "sse"), "sse-h", options={"softmax_layers": "retrieval:1"},
                  progress=False)
    record = json.loads((out / "retrieval_heads.json").read_text())
    assert record["chosen"] == choose_retrieval_layers(record["layers"], 1) and record["length"] == 1024
    config = AutoConfig.from_pretrained(out)
    assert config.softmax_layers == record["chosen"]
    assert "retrieval:1: the 1 layers whose strongest head" in (out / "README.md").read_text()
    with pytest.raises(ConversionError, match="asks for 2 softmax layers of 2; choose K in 1..1"):
        convert(str(checkpoints["dense"]), str(tmp_path / "bad"), "sse-h", options={"softmax_layers": "retrieval:2"},
                progress=False)
    assert not (tmp_path / "bad").exists()


def test_the_hybrid_presets_keep_the_retrieval_layers(tmp_path, tokenizer):
    """`--to sse-h` / `--to hla-h` keep softmax attention in a sixth of the layers, chosen by retrieval
    (retrieval:1/6) where the source has a tokenizer; without one, or through `conversion.convert`
    (which does not measure), every 6th layer, with a warning; fewer than 6 layers: none."""
    import json

    from transformers import AutoConfig

    from subquadratic.checks import layer_choice_spec
    from subquadratic.conversion import convert as convert_unmeasured
    from subquadratic.conversion.core import evenly_spaced
    from subquadratic.layer_choice import convert

    from ..conftest import make_dense

    assert layer_choice_spec("retrieval:1/6", 30) == ("retrieval", 5) and layer_choice_spec("auto:3", 30) == ("auto", 3)
    assert layer_choice_spec("retrieval:1/6", 5) == ("retrieval", 0)
    with pytest.raises(ValueError, match="write retrieval:K"):
        layer_choice_spec("retrieval:1/6")  # a share needs the layer count
    assert evenly_spaced(30, 5) == [5, 11, 17, 23, 29] and evenly_spaced(13, 2) == [5, 11]
    src = tmp_path / "dense12"
    make_dense("llama", num_hidden_layers=12).save_pretrained(src)
    bare = tmp_path / "bare12"
    make_dense("llama", num_hidden_layers=12).save_pretrained(bare)  # no tokenizer files
    tokenizer.save_pretrained(src)
    for to in ("sse-h", "hla-h"):
        out = convert(str(src), str(tmp_path / to), to, progress=False)
        record = json.loads((out / "retrieval_heads.json").read_text())
        mixers = AutoConfig.from_pretrained(out).mixer_types
        kept = [i for i, m in enumerate(mixers) if m == "full_attention"]
        assert len(record["chosen"]) == 2 and kept == record["chosen"]
    with pytest.warns(UserWarning, match="has no tokenizer; softmax layers at 5,11"):
        out = convert(str(bare), str(tmp_path / "bare-sse-h"), "sse-h", progress=False)
    assert AutoConfig.from_pretrained(out).softmax_layers == [5, 11] and not (out / "retrieval_heads.json").exists()
    with pytest.warns(UserWarning, match="conversion.convert does not measure retrieval:1/6"):
        out = convert_unmeasured(str(src), str(tmp_path / "plain"), "sse-h", progress=False)
    assert AutoConfig.from_pretrained(out).softmax_layers == [5, 11]
    out = convert_unmeasured(str(src), str(tmp_path / "given"), "sse-h", options={"softmax_every": 4}, progress=False)
    assert AutoConfig.from_pretrained(out).softmax_layers == [3, 7, 11]  # a layout given replaces the preset's


@pytest.mark.parametrize("task", ["passkey", "niah"])
def test_the_queried_needle_s_span(tokenizer, task):
    """draw_prompt(with_span=True): the span holds exactly the queried needle's tokens (what the
    retrieval-head probe measures attention on)."""
    L = min_length(tokenizer, task, "prose", 4 if task == "niah" else 1) + 50
    for depth in (0.0, 0.5, 1.0):
        prompt, _, items, (a, b) = draw_prompt(tokenizer, task, "prose", L, 4 if task == "niah" else 1, depth, 5,
                                               random.Random(7), with_span=True)
        needle = tokenizer.decode(prompt[a:b])
        assert items[0] in needle and needle.strip().startswith(("One of the special", "The pass key"))
        assert needle.rstrip().endswith((".", "key."))
