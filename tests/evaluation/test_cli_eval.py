"""`subquadratic eval` end to end (table, JSON with each prompt's generation, one PNG per metric,
card section), what it leaves out and says so, one progress bar over the whole run, the JSON kept by
a run that fails part way, its one-line errors, and `convert --eval-data`, which writes the
evaluation into the converted model's card."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from transformers import AutoModelForCausalLM

from subquadratic.cli import main
from subquadratic.data import load_stream
from subquadratic.evaluation import perplexity
from subquadratic.evaluation.retrieval import min_length

from ..test_cli import one_error_line, run_cli


def test_eval_help_is_fast_and_imports_no_torch():
    t0 = time.perf_counter()
    r = run_cli("-X", "importtime", "-m", "subquadratic.cli", "eval", "--help")
    assert r.returncode == 0, r.stderr
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert not {"torch", "transformers", "datasets", "matplotlib"} & imported
    for flag in ("--data", "--seq-len", "--tasks", "--reference", "--json", "--plot-dir", "--card", "--device"):
        assert flag in r.stdout
    assert time.perf_counter() - t0 < 2.0
    text = " ".join(r.stdout.split())
    from subquadratic.cli import EVAL_MEASURED

    assert f"forwards 86k tokens: {EVAL_MEASURED}." in text and "(default 1024 2048)" in text
    assert "(default 4; 0: every window)" in text and "3 depths; default 1)" in text and "(default 4)" in text


def test_the_defaults_forward_what_was_timed(tokenizer):
    """`eval`'s defaults, one model against a reference with --data, plan the tokens of the run timed for
    the help's figure (docs/benchmarks.md): 86,016 forwarded, the reference's KL windows included."""
    from subquadratic.cli import EVAL_LENGTHS, EVAL_MAX_WINDOWS, EVAL_MQAR_EXAMPLES, EVAL_TRIALS, build_parser
    from subquadratic.evaluation.suite import plan

    args = build_parser().parse_args(["eval", "MODEL", "--data", "held.txt", "--reference", "DENSE"])
    assert (args.seq_len, args.max_windows, args.trials, args.mqar_examples) == (
        list(EVAL_LENGTHS), EVAL_MAX_WINDOWS, EVAL_TRIALS, EVAL_MQAR_EXAMPLES)
    jobs, skipped = plan(tokenizer, ["ppl", "passkey", "niah", "mqar", "kl"], args.seq_len, stream_tokens=10 ** 6,
                         max_windows=args.max_windows, trials=args.trials, mqar_examples=args.mqar_examples)
    assert not skipped and sum(j.tokens for j in jobs) == 86_016


def test_eval_writes_table_json_plots_and_cards(checkpoints, corpus, tokenizer, tmp_path, capsys, one_thread):
    spla = shutil.copytree(checkpoints["spla"], tmp_path / "spla")
    card_before = (spla / "README.md").read_text()
    L = min_length(tokenizer, "passkey", "code")
    argv = ["eval", str(spla), str(checkpoints["dense"]), "--data", str(corpus), "--seq-len", "32", str(L),
            "--tasks", "ppl,kl,passkey,mqar", "--reference", str(checkpoints["dense"]), "--template", "code",
            "--trials", "1", "--max-windows", "2", "--json", str(tmp_path / "r.json"),
            "--plot-dir", str(tmp_path / "plots"), "--device", "cpu", "--no-progress"]
    assert main([*argv, "--card"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "| model | length | perplexity | KL to reference | passkey acc | passkey log p | MQAR acc | measured on |" \
        in out
    assert f"| {L} |" in out and "| 2 windows, 3 passkey prompts, 4 MQAR sequences |" in out
    assert "| 2 windows, 4 MQAR sequences |" in out  # at 32 tokens: no passkey prompt fits
    skipped = [line for line in captured.err.splitlines() if line.startswith("skipped:")]
    assert skipped == [f"skipped: passkey at 32 (a prompt needs {L} tokens)"]
    results = json.loads((tmp_path / "r.json").read_text())
    assert [r["model"] for r in results] == [str(spla), str(checkpoints["dense"])]
    ids = load_stream(corpus, tokenizer)
    want = perplexity(AutoModelForCausalLM.from_pretrained(spla), ids, [32, L], max_windows=2)
    for r, kl_zero in zip(results, (False, True), strict=True):
        t = r["tasks"]
        assert set(t) == {"ppl", "kl", "passkey", "mqar"}
        assert list(t["passkey"]) == [str(L)]  # 32 tokens cannot hold a passkey prompt
        assert 0.0 <= t["passkey"][str(L)]["accuracy"] <= 1.0 and 0.0 <= t["mqar"]["32"]["accuracy"] <= 1.0
        # SPLA is sparse beyond its 32-token budget (6e-4 here); the dense model against itself is zero up to
        # fp32 rounding of the two heads' chunked log-softmaxes (3e-8 on an AMD EPYC, below 1e-9 elsewhere)
        assert (t["kl"][str(L)]["kl"] < 1e-6) == kl_zero
    assert results[0]["tasks"]["ppl"][str(L)]["ppl"] == pytest.approx(want[L]["ppl"], rel=1e-6)
    samples = results[0]["tasks"]["passkey"][str(L)]["samples"]  # each prompt's generated text is kept
    assert len(samples) == 3 and all(isinstance(x["generated"], str) and x["value"].isdigit() for x in samples)
    assert results[0]["skipped"] == {"passkey": f"at 32 (a prompt needs {L} tokens)"}
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())  # one per metric, both models in each
    assert plots == ["kl.png", "mqar_accuracy.png", "passkey_accuracy.png", "passkey_logprob.png", "ppl.png"]
    for name in plots:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = (spla / "README.md").read_text()
    assert card.startswith(card_before.rstrip("\n")) and card.count("## Evaluation") == 1
    assert f"| spla | {L} |" in card and f"{want[L]['ppl']:.3f}" in card
    assert main([*argv, "--card"]) == 0  # again: the section is replaced, not added
    assert (spla / "README.md").read_text() == card


@pytest.mark.parametrize(("extra", "expect"), [
    (["--tasks", "ppl"], "tasks ppl, kl and copy need held-out text: pass --data FILE"),
    (["--tasks", "kl", "--data", "CORPUS"], "task kl needs a reference model: pass --reference DIR"),
    (["--tasks", "ppl,bleu"], "unknown task(s) bleu; choose from ppl,passkey,niah,mv-niah,vt,copy,mqar,kl"),
    (["--tasks", "mqar", "--reference", "DENSE"], "--reference is used by task kl only"),
    (["--data", "nowhere.jsonl"], "--data nowhere.jsonl does not exist"),
    (["--tasks", "passkey", "--seq-len", "16"], "every length is too short for passkey: skipped: passkey at 16 "
                                                "(a prompt needs"),
    (["--device", "gpu0"], "unknown device 'gpu0'"),
])
def test_eval_errors_are_one_line(checkpoints, corpus, capsys, extra, expect):
    extra = [str(corpus) if a == "CORPUS" else str(checkpoints["dense"]) if a == "DENSE" else a for a in extra]
    assert main(["eval", str(checkpoints["dense"]), "--no-progress", *extra]) == 2
    captured = capsys.readouterr()
    assert expect in one_error_line(captured.err) and captured.out == ""


def test_eval_of_a_folder_without_config_is_one_line(tmp_path, capsys):
    assert main(["eval", str(tmp_path), "--tasks", "mqar"]) == 2
    assert "is not a checkpoint folder (no config.json)" in one_error_line(capsys.readouterr().err)


def test_the_defaults_run_what_fits_and_one_line_says_what_was_left_out(checkpoints, tokenizer, capsys, one_thread):
    """No --tasks, no --data, lengths too short for a retrieval prompt: MQAR runs, and one line names
    the rest and why (the run does not fail)."""
    need = min_length(tokenizer, "passkey", "prose")
    assert main(["eval", str(checkpoints["dense"]), "--seq-len", "32", "64", "--device", "cpu", "--no-progress"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    niah = min_length(tokenizer, "niah", "prose", 4)
    assert lines == [f"skipped: ppl (needs --data); passkey at 32, 64 (a prompt needs {need} tokens); "
                     f"niah at 32, 64 (a prompt needs {niah} tokens)"]
    dense = checkpoints["dense"]
    assert f"| {dense} | 32 | 0." in captured.out and f"| {dense} | 64 | 0." in captured.out


class Bar:
    """A stand-in for tqdm that records what the run does with it."""

    made: list[Bar] = []

    def __init__(self, total=None, desc=None, **kw):
        self.total, self.n, self.descriptions = total, 0, [desc]
        Bar.made.append(self)

    def update(self, n=1):
        self.n += n

    def set_description(self, desc):
        self.descriptions.append(desc)

    def close(self):
        pass


def test_one_progress_bar_covers_every_task_of_every_model(checkpoints, corpus, monkeypatch, capsys, one_thread):
    import tqdm.auto

    Bar.made = []
    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    argv = ["eval", str(checkpoints["spla"]), str(checkpoints["dense"]), "--data", str(corpus), "--seq-len", "32",
            "64", "--tasks", "ppl,mqar,kl", "--reference", str(checkpoints["dense"]), "--max-windows", "2",
            "--device", "cpu"]
    assert main(argv) == 0
    (bar,) = Bar.made  # one bar, made before the first task, for the whole run
    windows = 2 * (32 + 64)
    assert bar.total == bar.n == 2 * (windows + 4 * (32 + 64) + 2 * windows)  # ppl + mqar + kl (two models each)
    assert bar.descriptions[0] == "eval"
    assert bar.descriptions[1:] == [f"{m}: {t} @ {L}" for m in ("spla", "dense") for t in ("ppl", "mqar", "kl")
                                    for L in (32, 64)]


def test_a_run_that_fails_part_way_keeps_what_it_measured(checkpoints, corpus, tmp_path, monkeypatch, capsys,
                                                          one_thread):
    from subquadratic.evaluation import suite

    def broken(*a, **kw):
        raise RuntimeError("mqar broke")

    monkeypatch.setattr(suite, "mqar_eval", broken)
    out = tmp_path / "r.json"
    argv = ["eval", str(checkpoints["dense"]), "--data", str(corpus), "--seq-len", "32", "64", "--tasks",
            "ppl,mqar", "--max-windows", "2", "--json", str(out), "--device", "cpu", "--no-progress"]
    with pytest.raises(RuntimeError, match="mqar broke"):
        main(argv)
    (result,) = json.loads(out.read_text())  # written after each task at each length
    assert list(result["tasks"]) == ["ppl"] and list(result["tasks"]["ppl"]) == ["32", "64"]
    assert result["settings"]["data"] == str(corpus)
    printed = capsys.readouterr().out
    assert f"| {checkpoints['dense']} | 64 |" in printed and f"kept in {out}" in printed  # what was measured


def test_convert_eval_data_writes_the_table_into_the_card(checkpoints, corpus, tmp_path, capsys, one_thread):
    out = tmp_path / "spla"
    argv = ["convert", str(checkpoints["dense"]), str(out), "--to", "spla", "--spla-block-size", "8",
            "--spla-top-k-blocks", "4", "--no-progress", "--eval-data", str(corpus), "--eval-seq-len", "32", "64",
            "--eval-max-windows", "2"]
    assert main(argv) == 0
    card = (out / "README.md").read_text()
    assert card.index("## What was verified") < card.index("## Evaluation")
    table, positions = card.split("By position in the window")
    rows = [line for line in table.splitlines() if line.startswith("| this model") or line.startswith("| dense")]
    assert len(rows) == 4, card
    # by position at 64 tokens: the first 32 positions are inside the 32-token budget, as the dense model
    at = [line.split("|") for line in positions.splitlines() if line.startswith(("| this model | 64", "| dense"))]
    assert len(at) == 2 and at[0][3:5] == at[1][3:5] and at[0][5] != at[1][5]
    kl32 = rows[0].split("|")[4].strip()
    assert rows[0].startswith("| this model | 32 |") and kl32 == "0.0000"  # inside the budget: the dense model
    assert rows[0].split("|")[3] == rows[2].split("|")[3]  # same perplexity as the source at 32 tokens
    assert rows[1].split("|")[4].strip() != "0.0000"
    capsys.readouterr()
    bad = tmp_path / "bad"
    assert main(["convert", str(checkpoints["dense"]), str(bad), "--to", "spla", "--no-progress",
                 "--eval-data", str(tmp_path / "none.jsonl")]) == 2
    assert "--eval-data" in one_error_line(capsys.readouterr().err) and not bad.exists()
