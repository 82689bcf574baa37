"""Perplexity and KL on held-out text: the numbers equal independent computations."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from subquadratic.data import load_stream, load_texts, token_stream, windows
from subquadratic.evaluation import next_token_kl, perplexity


@pytest.fixture(scope="module")
def models(checkpoints):
    return {k: AutoModelForCausalLM.from_pretrained(v).eval() for k, v in checkpoints.items()}


@pytest.fixture(scope="module")
def stream(corpus, tokenizer):
    return load_stream(corpus, tokenizer)


def test_stream_is_the_documents_tokens_each_followed_by_eos(corpus, tokenizer, stream):
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    assert list(load_texts(corpus)["text"]) == texts
    expect = [i for t in texts for i in tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    assert stream.tolist() == expect
    w = windows(stream, 50, max_windows=3)
    assert w.shape == (3, 50) and w.flatten().tolist() == expect[:150]
    assert windows(stream, 50).shape[0] == len(expect) // 50


def test_text_and_parquet_files_read_like_jsonl(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("one document\nover two lines")
    assert list(load_texts(tmp_path / "a.txt")["text"]) == ["one document\nover two lines"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["first", "second"]}), tmp_path / "b.parquet")
    assert list(load_texts(tmp_path / "b.parquet", text_field="body")["text"]) == ["first", "second"]
    assert token_stream(["ab", "c"], tokenizer).numel() == len(tokenizer("ab")["input_ids"]) + 1 + 2


@pytest.mark.parametrize("kind", ["dense", "spla"])
def test_perplexity_is_exp_of_the_models_own_loss(models, stream, kind, one_thread):
    model = models[kind]
    res = perplexity(model, stream, [32, 64], max_windows=3, batch_size=2)
    for L in (32, 64):
        rows = windows(stream, L, 3)
        with torch.no_grad():  # Transformers' shifted cross-entropy, mean over all predicted tokens
            loss = model(input_ids=rows, labels=rows).loss.item()
        assert res[L]["windows"] == 3 and res[L]["tokens"] == 3 * (L - 1)
        assert res[L]["nll"] == pytest.approx(loss, rel=1e-5)
        assert res[L]["ppl"] == pytest.approx(math.exp(loss), rel=1e-5)
        # by position: the same loss over the columns [0, L/4), [L/4, L/2), [L/2, L) (column t scores token t + 1)
        with torch.no_grad():
            logits = model(input_ids=rows).logits[:, :-1].float()
        per = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="none")
        per = per.view(3, L - 1)
        got = res[L]["by_position"]
        assert [(p["start"], p["end"]) for p in got] == [(0, L // 4), (L // 4, L // 2), (L // 2, L)]
        for p in got:
            want = per[:, p["start"]:p["end"]]
            assert p["tokens"] == want.numel()
            assert p["nll"] == pytest.approx(want.mean().item(), rel=1e-5)
            assert p["ppl"] == pytest.approx(math.exp(p["nll"]), rel=1e-9)
        assert sum(p["nll"] * p["tokens"] for p in got) / res[L]["tokens"] == pytest.approx(res[L]["nll"], rel=1e-9)


def test_kl_is_zero_to_itself_and_positive_to_another_model(models, stream, one_thread):
    dense, other, spla = models["dense"], models["dense2"], models["spla"]
    assert next_token_kl(dense, dense, stream, [32], max_windows=2)[32]["kl"] == pytest.approx(0.0, abs=1e-7)
    res = next_token_kl(other, dense, stream, [32], max_windows=2)[32]
    assert res["kl"] > 1e-3 and res["tokens"] == 64
    # independent: KL(p || q) = sum p (log p - log q) from the models' logits
    rows = windows(stream, 32, 2)
    with torch.no_grad():
        lp, lq = dense(rows).logits.log_softmax(-1), other(rows).logits.log_softmax(-1)
    per = (lp.exp() * (lp - lq)).sum(-1)  # [2, 32]
    assert res["kl"] == pytest.approx(per.mean().item(), rel=1e-4)
    assert [(p["start"], p["end"], p["tokens"]) for p in res["by_position"]] == [(0, 8, 16), (8, 16, 16), (16, 32, 32)]
    for p in res["by_position"]:
        assert p["kl"] == pytest.approx(per[:, p["start"]:p["end"]].mean().item(), rel=1e-4)
    # a fresh SPLA conversion is the dense model inside its budget (32 tokens) and sparse beyond it
    within = next_token_kl(spla, dense, stream, [32, 96], max_windows=2)
    assert within[32]["kl"] < 1e-6 < within[96]["kl"]
