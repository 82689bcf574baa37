"""`adapt --stage1-seq-len`: attention transfer on rows of another length, with the same tokens per
step, while distillation reads exactly the batches it reads without the option."""

from __future__ import annotations

import json

import pytest

from subquadratic.adaptation import AdaptConfig, AdaptError, adapt
from subquadratic.adaptation.train import Trainee

pytestmark = pytest.mark.usefixtures("one_thread")


def run(student, out, files, teacher, **kw):
    settings = dict(max_steps=4, stage1_steps=2, seq_len=32, batch_size=4, save_every=100, progress=False,
                    loss="kl", teacher=str(teacher))
    return adapt(AdaptConfig(student=str(student), output_dir=str(out), data=[str(f) for f in files],
                             **{**settings, **kw}))


def test_stage1_rows_of_their_own_length_then_the_same_stage2_batches(tmp_path, corpus, converted, dense_folder,
                                                                      monkeypatch):
    seen: list[tuple[int, object]] = []
    forward = Trainee.forward

    def record(self, batch, stage):
        seen.append((stage, batch["input_ids"].clone()))
        return forward(self, batch, stage)

    monkeypatch.setattr(Trainee, "forward", record)
    student = converted("hla")
    run(student, tmp_path / "plain", corpus[0], dense_folder)
    plain, seen[:] = list(seen), []
    out = run(student, tmp_path / "long", corpus[0], dense_folder, stage1_seq_len=64)
    long = list(seen)

    assert [s for s, _ in long] == [1, 1, 2, 2]
    assert all(ids.shape == (2, 64) for s, ids in long if s == 1)  # 4 x 32 tokens as 2 rows of 64
    assert all(ids.shape == (4, 32) for s, ids in long if s == 2)
    assert all(ids.shape == (4, 32) for _, ids in plain)
    for (_, a), (_, b) in zip(plain[2:], long[2:], strict=True):  # distillation reads the same batches
        assert a.equal(b)
    rows = [json.loads(line) for line in (out / "adapt_log.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [128, 256, 384, 512]
    assert "| sequence length | 32 (64 in attention transfer) |" in (out / "README.md").read_text()


def test_stage1_length_beyond_one_batch_is_refused(tmp_path, corpus, converted, dense_folder):
    with pytest.raises(AdaptError, match="--stage1-seq-len must lie in 2..--batch-size x --seq-len"):
        run(converted("hla"), tmp_path / "out", corpus[0], dense_folder, stage1_seq_len=256)


def test_cli_passes_the_stage1_length(tmp_path, corpus, converted, dense_folder):
    from subquadratic.cli import main

    out = tmp_path / "cli"
    rc = main(["adapt", str(converted("hla")), "-o", str(out), "--data", *map(str, corpus[0]), "--teacher",
               str(dense_folder), "--max-steps", "2", "--stage1-steps", "1", "--seq-len", "32", "--batch-size", "2",
               "--stage1-seq-len", "64", "--no-progress"])
    assert rc == 0
    assert "| sequence length | 32 (64 in attention transfer) |" in (out / "README.md").read_text()
