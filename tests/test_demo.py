"""The demo's printed settings line: one short line per family, naming what was chosen."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from subquadratic.conversion import convert
from subquadratic.demo import settings_line
from subquadratic.registry import convert_target


@pytest.mark.parametrize(("to", "said"), [
    ("spla", "budget 16 blocks x 64 tokens = 1024 tokens"),
    ("sse-h", "softmax layers:"),
    ("hla", "softmax layers: none"),
])
def test_the_settings_line_is_short_and_says_the_settings(dense_checkpoint, tmp_path, to, said):
    _, src = dense_checkpoint("llama", num_hidden_layers=6)
    out = convert(str(src), str(tmp_path / to), to, progress=False)
    family, _ = convert_target(to)
    line = settings_line(family, AutoConfig.from_pretrained(out))
    assert said in line and "\n" not in line and len(line) <= 100, line


def test_the_case_notes_say_why_the_columns_agree_or_differ_and_what_to_run_next(dense_checkpoint, tmp_path):
    from subquadratic.demo import case_note, exact_window

    _, src = dense_checkpoint("llama", num_hidden_layers=6)
    spla = AutoConfig.from_pretrained(convert(str(src), str(tmp_path / "spla"), "spla", progress=False))
    budget = spla.budget_tokens
    inside = case_note("SPLA", spla, budget, tmp_path / "spla", src)
    assert f"the {budget} tokens are inside SPLA's budget of {budget}" in inside and "must agree" in inside
    beyond = case_note("SPLA", spla, budget + 1, tmp_path / "spla", src)
    assert f"beyond SPLA's budget of {budget}" in beyond and "selects" in beyond
    hybrid = AutoConfig.from_pretrained(convert(str(src), str(tmp_path / "h"), "sse-h", progress=False))
    window = hybrid.sse_sliding_window
    assert exact_window(hybrid) == window == 64  # SSE-H's default window branch
    said = case_note("SSE-H", hybrid, window + 1, tmp_path / "h", src)
    assert "converted, not trained" in said and f"beyond their {window}-token window" in said
    assert f"Next: subquadratic adapt {tmp_path / 'h'} --teacher {src} --data YOUR_TEXT_FILES -o " in said
    fits = case_note("SSE-H", hybrid, 40, tmp_path / "h", src)
    assert f"the 40 tokens fit the {window}-token window branch" in fits and "Next: subquadratic adapt" in fits
    bare = AutoConfig.from_pretrained(convert(str(src), str(tmp_path / "b"), "hla", progress=False,
                                              options={"hla_sliding_window": 0}))
    assert exact_window(bare) is None
    plain = case_note("HLA", bare, 40, tmp_path / "b", src)
    assert "HLA is converted, not trained: its state layers compute a different function" in plain
    assert "window" not in plain
    for line in (inside, beyond, said, fits, plain):
        assert "\n" not in line


@pytest.mark.parametrize("to", ["spla", "hla-h"])
def test_the_decode_race_measures_both_caches_and_rates(dense_checkpoint, tmp_path, to):
    """The cache figures are the caches' own sizes (the dense model's: 2 x layers x KV heads x head dim
    x tokens x 4 bytes), both models step the same number of times, and the line says both."""
    from transformers import AutoModelForCausalLM

    from subquadratic.demo import RACE_STEPS, decode_race, savings_line
    from subquadratic.modeling.base import CACHE_FIELD

    dense, src = dense_checkpoint("llama", num_hidden_layers=6)
    ours = AutoModelForCausalLM.from_pretrained(convert(str(src), str(tmp_path / to), to, progress=False)).eval()
    T = 40
    ids = torch.randint(3, 100, (1, T), generator=torch.Generator().manual_seed(0))
    calls = {"dense": 0, "ours": 0}
    for name, m in (("dense", dense), ("ours", ours)):
        m.register_forward_pre_hook(lambda mod, args, name=name: calls.__setitem__(name, calls[name] + 1))
    race = decode_race({"dense": dense.eval(), "OURS": ours}, ids, steps=3)
    assert calls == {"dense": 4, "ours": 4}  # one prefill and three steps each
    c = dense.config
    assert race["dense"]["cache_bytes"] == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * T * 4
    with torch.no_grad():
        cache = getattr(ours(ids, use_cache=True), CACHE_FIELD)
    assert race["OURS"]["cache_bytes"] == cache.nbytes() > 0
    assert race["dense"]["tokens_per_s"] > 0 and race["OURS"]["tokens_per_s"] > 0
    line = savings_line(race, "OURS", T, "cpu")
    assert line.startswith(f"saved at {T} tokens: cache dense ") and "tokens/s, OURS " in line and "on cpu" in line
    ratio = race["OURS"]["cache_bytes"] / race["dense"]["cache_bytes"]
    assert f"MiB ({ratio:.2f}x the dense model's); decode" in line
    assert RACE_STEPS >= 8


def test_generate_gives_the_continuation_and_the_last_prompt_logits():
    from subquadratic.demo import _generate
    from tests.conftest import make_dense, word_tokenizer

    tok = word_tokenizer()
    model = make_dense("llama", vocab_size=len(tok), pad_token_id=tok.pad_token_id).eval()
    text, last, seconds = _generate(model, tok, "the value of the list", 5)
    ids = tok.apply_chat_template([{"role": "user", "content": "the value of the list"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        torch.testing.assert_close(last, model(**ids).logits[0, -1])
        want = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert text == tok.decode(want[0, ids["input_ids"].shape[1]:], skip_special_tokens=True) and seconds > 0
