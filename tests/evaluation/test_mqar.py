"""MQAR: generator invariants, the accuracy evaluator, and the from-scratch comparison at equal state."""

from __future__ import annotations

import pytest
import torch

from scripts.studies.mqar_contenders import MQARSettings, mqar_compare, mqar_config
from subquadratic.evaluation import mqar_accuracy, mqar_batch
from subquadratic.evaluation.mqar import IGNORE


def test_generator_invariants():
    g = torch.Generator().manual_seed(0)
    ids, labels = mqar_batch(16, 40, 6, 50, num_queries=4, generator=g)
    assert ids.shape == labels.shape == (16, 40)
    for row, lab in zip(ids.tolist(), labels.tolist(), strict=True):
        keys, values = row[0:12:2], row[1:12:2]
        assert len(set(keys)) == 6 and all(1 <= k < 25 for k in keys) and all(25 <= v < 50 for v in values)
        table = dict(zip(keys, values, strict=True))
        scored = [t for t, y in enumerate(lab) if y != IGNORE]
        assert len(scored) == 4 and all(t >= 13 for t in scored)
        for t in scored:  # the value after a query key is that key's value, and is the label
            assert row[t - 1] in table and row[t] == lab[t] == table[row[t - 1]]
        assert sum(x != 0 for x in row[12:]) == 8  # the rest is filler
    again = mqar_batch(16, 40, 6, 50, num_queries=4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again[0], ids)
    with pytest.raises(ValueError, match="need seq_len >= 24"):
        mqar_batch(1, 20, 6, 50)


class _Lookup(torch.nn.Module):
    """An oracle: predicts, after each key seen earlier in the row, that key's value."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **kw):
        B, T = input_ids.shape
        logits = torch.zeros(B, T, self.vocab)
        for b in range(B):
            table = {}
            row = input_ids[b].tolist()
            for t in range(T):
                if t % 2 == 1 and row[t - 1] not in table and row[t - 1] != 0:
                    table[row[t - 1]] = row[t]
                if row[t] in table:
                    logits[b, t, table[row[t]]] = 1.0
        return type("Out", (), {"logits": logits})()


def test_accuracy_is_one_for_an_oracle_and_chance_like_for_a_constant():
    ids, labels = mqar_batch(8, 32, 4, 32, generator=torch.Generator().manual_seed(1))
    assert mqar_accuracy(_Lookup(32), ids, labels, batch_size=3) == 1.0

    class Constant(_Lookup):
        def forward(self, input_ids, **kw):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, self.vocab)})()

    assert mqar_accuracy(Constant(32), ids, labels) == pytest.approx((labels == 0).sum().item() / 32)


def test_contenders_hold_equal_state_and_training_lowers_the_loss(one_thread):
    s = MQARSettings.tiny(steps=30)
    res = mqar_compare(s)
    assert res["settings"]["steps"] == 30 and 0 < res["chance"] < 1
    # per layer: SSE 2 heads x (4 + 1) states x 8^2, the baselines 5 heads x 2 states x 8^2; fp32
    assert {res[m]["state_bytes"] for m in ("sse", "gla", "hla")} == {2 * 5 * 64 * 4}
    assert (res["sse"]["num_heads"], res["gla"]["num_heads"], res["hla"]["num_heads"]) == (2, 5, 5)
    assert (res["sse"]["num_partitions"], res["gla"]["num_partitions"]) == (4, 1)
    for m in ("sse", "gla", "hla"):
        assert 0.0 <= res[m]["accuracy"] <= 1.0
        assert res[m]["final_loss"] < res[m]["initial_loss"]
    with pytest.raises(ValueError, match="must be even"):
        mqar_config("gla", MQARSettings(num_heads=1, sse_partitions=2))
