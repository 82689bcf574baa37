"""Passkey and multi-key needle prompts: exact lengths, needles where asked, and a scorer that marks a
correct continuation correct and a wrong one wrong."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from subquadratic.evaluation import EvaluationError, niah, passkey
from subquadratic.evaluation.retrieval import TEMPLATES, answer_matches, build_prompt, min_length


@pytest.fixture(scope="module")
def model(checkpoints):
    return AutoModelForCausalLM.from_pretrained(checkpoints["dense"]).eval()


def test_answer_matcher():
    assert answer_matches(" 48213", "48213") and answer_matches("48213.", "48213")
    assert answer_matches("  48213\nassert", "48213")
    for wrong in (" 482130", " 4821", " x 48213", "", " 48 213"):
        assert not answer_matches(wrong, "48213")


#: what SmolLM2-135M-Instruct wrote (greedy, 400-token prose prompts) after each question, and the
#: value its needle held: the NIAH needle reads "... is: 22429." and the question ends "... is"
REAL_ANSWERS = [
    ("niah", ": 22429. The grass", "22429", True),
    ("niah", ": 83375. The grass", "83375", True),
    ("niah", ": 77013. The special", "73691", False),  # another needle's value
    ("passkey", " 82420. Remember it.", "82420", True),
    ("passkey", " 81919. The pass key", "81919", True),
]


@pytest.mark.parametrize(("task", "text", "value", "right"), REAL_ANSWERS)
def test_the_scorer_takes_answers_as_the_model_writes_them(task, text, value, right):
    assert answer_matches(text, value) == right
    near = (text.replace(value, value[:-1]), text.replace(value, value + "7"), " the number " + text.lstrip(" :"))
    for wrong in near:
        assert not answer_matches(wrong, value), wrong


def test_the_scored_answer_is_the_needle_s_own_continuation(tokenizer):
    """The log-probability is of what follows the question in the needle's own words: ": 22429" after
    "... magic number for apple is" (the prose needle's "is: 22429."), " 48213" after "pass key is"."""
    niah_prose = TEMPLATES["niah", "prose"]
    value = "22429"
    assert niah_prose.question.endswith(" is")
    needle = niah_prose.needle.format(key="apple", value=value)
    assert needle.endswith(" is" + niah_prose.answer.format(value=value) + ".")
    assert TEMPLATES["passkey", "prose"].answer.format(value=value) == " " + value
    _, answer = build_prompt(tokenizer, niah_prose, min_length(tokenizer, "niah", "prose", 1) + 50,
                             [("apple", value)], 0, 0.5, random.Random(0))
    assert tokenizer.decode(answer) == ": 22429"


@pytest.mark.parametrize("template", ["prose", "code"])
def test_prompt_has_the_length_and_the_needles_at_their_depth(tokenizer, template):
    tpl = TEMPLATES["niah", template]
    needles = [("apple", "11111"), ("river", "22222"), ("garden", "33333")]
    L = min_length(tokenizer, "niah", template, 3) + 400
    for depth in (0.0, 0.5, 1.0):
        prompt, answer = build_prompt(tokenizer, tpl, L, needles, 1, depth, random.Random(0))
        assert len(prompt) == L
        text = tokenizer.decode(prompt)
        for k, v in needles:
            assert tpl.needle.format(key=k, value=v) in text
        assert text.endswith(tpl.question.format(key="river", value=""))
        assert tokenizer.decode(answer).strip(" :") == "22222"
        where = text.index(tpl.needle.format(key="river", value="22222")) / len(text)
        assert abs(where - depth) < 0.25  # nearest filler boundary; the ends hold the intro and question
    with pytest.raises(EvaluationError, match="too short"):
        build_prompt(tokenizer, tpl, 40, needles, 0, 0.5, random.Random(0))


def test_scorer_marks_the_true_continuation_correct(model, tokenizer, monkeypatch):
    """An oracle generate() that appends the true answer scores 1; one that appends another number, 0."""
    real = TEMPLATES["passkey", "code"]
    seen = []

    def oracle(offset):
        def generate(input_ids, **kw):
            text = tokenizer.decode(input_ids[0])
            value = text.split("PASSKEY = ")[1].split("\n")[0]
            seen.append(value)
            answer = tokenizer(real.answer.format(value=str(int(value) + offset)), add_special_tokens=False)
            return torch.cat([input_ids, torch.tensor([answer["input_ids"]])], dim=1)
        return generate

    L = min_length(tokenizer, "passkey", "code")
    monkeypatch.setattr(model, "generate", oracle(0))
    right = passkey(model, tokenizer, [L], template="code", trials=2)[L]
    assert right["accuracy"] == 1.0 and right["prompts"] == 6 and len(set(seen)) == 6
    assert right["by_depth"] == {0.1: 1.0, 0.5: 1.0, 0.9: 1.0}
    samples = right["samples"]  # every prompt's generated text is kept, with its value and score
    assert [s["depth"] for s in samples] == [0.1, 0.1, 0.5, 0.5, 0.9, 0.9] and [s["value"] for s in samples] == seen
    assert all(s["generated"].strip() == s["value"] and s["correct"] for s in samples)
    monkeypatch.setattr(model, "generate", oracle(1))
    wrong = passkey(model, tokenizer, [L], template="code", trials=2)[L]
    assert wrong["accuracy"] == 0.0 and wrong["logprob"] == right["logprob"]  # same prompts, same scoring


def test_real_generation_gives_an_accuracy_and_a_log_probability(model, tokenizer, one_thread):
    L = min_length(tokenizer, "niah", "code", 2)
    res = niah(model, tokenizer, [L - 1, L], template="code", num_needles=2, trials=1, depths=(0.5,))
    assert list(res) == [L]  # too-short lengths are left out
    r = res[L]
    assert 0.0 <= r["accuracy"] <= 1.0 and r["prompts"] == 1
    assert -20.0 < r["logprob"] < 0.0  # a random 128-token model: near log(1/128) = -4.85 per token
    with pytest.raises(EvaluationError, match="too short for a passkey prompt"):
        passkey(model, tokenizer, [16], template="code")
    with pytest.raises(EvaluationError, match="no passkey template 'poem'"):
        passkey(model, tokenizer, [L], template="poem")
