"""scripts/studies/real_quality.py --scale tiny: the real-model protocol's code path end to end on a CPU (a
tiny random Llama, numpy's sources): the held-out split, every row of the main table, an ablation
run merged into the same table, the adapted models' cards, the commands."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rq():
    spec = importlib.util.spec_from_file_location("real_quality", ROOT / "scripts" / "studies" / "real_quality.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_quality"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("real_quality", None)


def test_heldout_split_follows_from_the_file_list_alone(rq):
    files = rq.package_sources(("numpy",))
    assert files == sorted(files) and all(rel.startswith("numpy/") and rel.endswith(".py") for rel, _ in files)
    train, held = rq.split_sources(files, 50)
    shuffled = list(files)
    random.Random(1).shuffle(shuffled)
    assert rq.split_sources(shuffled, 50) == (train, held)
    assert {rel for rel, _ in held} == {rel for rel, _ in files if rq._hash(rel) % 50 == 0}
    assert not {rel for rel, _ in held} & {rel for rel, _ in train} and len(train) + len(held) == len(files)
    assert 0 < len(held) < len(files) / 25


def test_rows_and_groups(rq):
    table = rq.rows_of(rq.SCALES["h200"], 30)
    names = [r.name for r in rq.select_rows("main", table)]
    assert names == ["dense", "sse-h", "hla-hybrid", "spla-fresh", "spla", "spa"]
    every = [r.name for r in rq.select_rows("all", table)]
    assert every[:5] == ["dense", "sse-h", "hla-hybrid", "sse-h/no-window", "hla-hybrid/no-window"]
    assert sorted(every) == sorted(set(table) - {"sse-h-fresh"}) and len(every) == len(set(every))  # each once
    assert every.index("spa") > every.index("hla-hybrid/auto-layers")  # SPLA's 8192-token rows late
    ablation = rq.select_rows("ablation-hla", table)
    assert ablation[0].name == "hla-hybrid" and all(r.base == "hla-hybrid" for r in ablation[1:])
    auto = table["hla-hybrid/auto-layers"]
    assert auto.options == {"softmax_layers": "auto:5"}  # the layer list replaces softmax_every
    assert table["sse-h/decay-long"].options == {"sse_decay_init_min": 0.99, "sse_decay_init_max": 0.9999}
    assert table["spa"].options == {"use_rla": False}
    assert table["spla/budget-2x"].options == {"top_k_blocks": 32} and table["spla/budget-2x"].recipe == "spla"
    assert [r.name for r in rq.select_rows("ablation-spla", table)] == [
        "spla", "spla/budget-2x", "spla/budget-16th", "spla/budget-32nd", "spla/gamma-lr", "spa/budget-16th",
        "spa/budget-32nd"]
    # SPLA against SPA at 1/16 and 1/32 of an 8192-token context (blocks of 64), the gain free to move
    for name, blocks in (("spla/budget-16th", 8), ("spla/budget-32nd", 4)):
        assert table[name].options == {"top_k_blocks": blocks} and table[name].new_lr_scale == 100.0
        spa = table[name.replace("spla", "spa")]
        assert spa.options == {"use_rla": False, "top_k_blocks": blocks} and spa.new_lr_scale == 100.0
    recall = table["sse-h/recall"]  # retrieval layers, recall rows, rows of 4x
    assert recall.options == {"softmax_layers": "retrieval:5"} and recall.recall_share == 0.25
    assert table["hla-hybrid/recall-layers"].recall_share == 0.0
    rows_only = table["sse-h/recall-rows"]
    assert rows_only.options == {"softmax_every": 6} and rows_only.recall_share == 0.25
    gamma = table["spla/gamma-lr"]
    assert gamma.options == {} and gamma.new_lr_scale == 100.0 and table["spla"].new_lr_scale == 1.0
    args = SimpleNamespace(spla_seq_len=None, tokens=None, device_type="cuda")
    settings = rq.adapt_settings(gamma, rq.SCALES["h200"], args)
    assert settings["new_lr_scale"] == 100.0 and settings["lr"] == 1e-4
    cfg = SimpleNamespace(student="s", output_dir="o", data=["d"], teacher="t", seed=0, num_proc=None)
    assert "--new-lr-scale 100.0" in rq.adapt_command(cfg, settings)
    assert "--new-lr-scale" not in rq.adapt_command(cfg, rq.adapt_settings(table["spla"], rq.SCALES["h200"], args))
    recall_settings = rq.adapt_settings(recall, rq.SCALES["h200"], args)
    assert recall_settings["recall_share"] == 0.25 and recall_settings["seq_len"] == 8192
    assert "--recall-share 0.25" in rq.adapt_command(cfg, recall_settings)
    assert rq.SCALES["tiny"].spla_options["top_k_blocks"] == 4
    assert rq.rows_of(rq.SCALES["tiny"], 6)["spla/budget-2x"].options == {"block_size": 16, "top_k_blocks": 8}
    assert table["sse-h/no-window"].options == {"sse_sliding_window": 0}
    # what convert makes of a row: the preset's window and layout under the row's own options
    assert rq.conversion_options(table["sse-h"]) == {"family": "sse", "softmax_layers": "retrieval:1/6",
                                                     "sse_sliding_window": 64, "sse_window_merge": "sum",
                                                     "sse_kv_heads": "source", "sse_window_qkv": "shared"}
    assert rq.conversion_options(table["sse-h/own-qkv"])["sse_kv_heads"] == "query"
    assert rq.conversion_options(table["hla-hybrid/no-window"]) == {"family": "hla", "softmax_layers": "retrieval:1/6",
                                                                    "hla_sliding_window": 0}
    assert rq.conversion_options(table["sse-h/every-6th"])["softmax_every"] == 6  # the former layout, as a row
    assert "softmax_layers" not in rq.conversion_options(table["sse-h/recall-rows"])
    assert rq.conversion_options(auto) == {"family": "hla", "hla_sliding_window": 64, "softmax_layers": "auto:5"}
    assert rq.conversion_options(table["dense"]) is None
    with pytest.raises(SystemExit, match="unknown row"):
        rq.select_rows("sse-h/nothing", table)


def test_kept_rows_converted_under_other_defaults_are_dropped(rq):
    """A row of an earlier run whose conversion differs from what its row converts to now (a preset
    changed since, or a file from before the options were recorded) is not kept under the new name."""
    table = rq.rows_of(rq.SCALES["h200"], 30)
    now = rq.conversion_options(table["sse-h"])
    results = {"rows": {
        "dense": {"row": "dense", "metrics": {}},
        "sse-h": {"row": "sse-h", "metrics": {}, "convert_options": now},
        "hla-hybrid": {"row": "hla-hybrid", "metrics": {}, "convert_options": {"family": "hla", "softmax_every": 6}},
        "spla-fresh": {"row": "spla-fresh", "metrics": {}},  # recorded before the field existed
        "sse-h/rows-4x": {"row": "sse-h/rows-4x", "error": "cut"},  # not measured: nothing to keep
        "gone": {"row": "gone", "metrics": {}},  # a row the table no longer has: left as it was
    }}
    assert rq.drop_stale_rows(results, table) == ["hla-hybrid", "spla-fresh"]
    assert list(results["rows"]) == ["dense", "sse-h", "sse-h/rows-4x", "gone"]


def _finite_metrics(entry, scale, adapted: bool):
    m = entry["metrics"]
    for part in ("code", "english"):
        assert sorted(map(int, m[part]["ppl"])) == list(scale.lengths)
        assert all(math.isfinite(v["ppl"]) and v["ppl"] > 1 for v in m[part]["ppl"].values())
        windows = [m[part]["ppl"][L]["windows"] for L in scale.lengths]
        assert windows == [scale.span // L for L in scale.lengths]  # the same tokens at every length
        if entry["name"] != "dense":
            assert all(v["kl"] >= 0 and math.isfinite(v["kl"]) for v in m[part]["kl"].values())
    for task in ("passkey", "niah"):
        assert m[task] and all(0 <= v["accuracy"] <= 1 and v["logprob"] < 0 for v in m[task].values())
    assert ("adapt" in entry) == adapted


def test_tiny_protocol_main_table_then_an_ablation_run(rq, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    scale = rq.SCALES["tiny"]
    common = ["--scale", "tiny", "--device", "cpu", "--out", str(out), "--work", str(work), "--fail-fast"]
    results = rq.main([*common, "--rows", "main"])
    rows = results["rows"]
    assert list(rows) == ["dense", "sse-h", "hla-hybrid", "spla-fresh", "spla", "spa"]
    assert results["skipped"] == [] and results["protocol"]["running"] is None
    for name, entry in rows.items():
        _finite_metrics(entry, scale, adapted=name not in ("dense", "spla-fresh"))
    assert rows["spla-fresh"]["metrics"]["code"]["kl"]  # a real conversion (budget 64 < 512 tokens)
    for name in ("spla", "spa", "sse-h", "hla-hybrid"):
        a = rows[name]["adapt"]
        assert rows[name]["tokens"] == a["max_steps"] * scale.tokens_per_step == a["max_steps"] * a["batch_size"] * \
            a["seq_len"]
        card = (work / "adapted" / name / "README.md").read_text()
        assert "## Evaluation" in card and rows[name]["label"] in card and "dense source, held-out Python" in card
        assert (out / f"adapt_log_{name}.jsonl").is_file()
    assert rows["spla"]["adapt"]["seq_len"] == scale.spla_seq_len and rows["sse-h"]["adapt"]["seq_len"] == 128
    spa = json.loads((work / "converted" / "spa" / "config.json").read_text())
    assert spa["use_rla"] is False
    assert "## Evaluation" in (work / "converted" / "spla-fresh" / "README.md").read_text()
    protocol = results["protocol"]
    train_paths = {json.loads(line)["path"] for line in (work / "corpus" / "train.jsonl").read_text().splitlines()}
    assert train_paths and not train_paths & set(protocol["heldout_used"])
    report = (out / "results.md").read_text()
    assert "## Perplexity and KL to dense" in report and "## Retrieval" in report
    assert "## Python at 512 by position in the window" in report and "| sse-h | " in report.split("by position")[1]
    assert [q["start"] for q in rows["sse-h"]["metrics"]["code"]["kl"][512]["by_position"]] == [0, 128, 256]
    assert {e["run"] for e in rows.values()} == {rows["dense"]["run"]}  # one run measured them all
    assert "subquadratic adapt" in report and "python scripts/studies/real_quality.py --scale tiny" in report
    assert json.loads((out / "results.json").read_text())["rows"].keys() == rows.keys()

    dense_before = json.loads(json.dumps(rows["dense"]))
    second = rq.main([*common, "--rows", "hla-hybrid/stage1-4x,sse-h/auto-layers"])
    rows = second["rows"]
    assert rows["dense"] == dense_before  # the reference row is kept, not measured again
    assert list(rows)[-2:] == ["hla-hybrid/stage1-4x", "sse-h/auto-layers"]
    stage1 = rows["hla-hybrid/stage1-4x"]
    assert stage1["adapt"]["stage1_seq_len"] == 4 * 128 and stage1["tokens"] == rows["hla-hybrid"]["tokens"]
    auto = rows["sse-h/auto-layers"]
    assert len(auto["layer_costs"]["chosen"]) == 1 and len(auto["layer_costs"]["layers"]) == 6
    assert auto["tokens"] == rows["sse-h"]["tokens"] and auto["seed"] == rows["sse-h"]["seed"]
    assert "--calibration-data" in auto["convert_command"]
    for entry in (stage1, auto):
        _finite_metrics(entry, scale, adapted=True)
    report = (out / "results.md").read_text()
    assert "## Ablation from `sse-h`" in report and "## Ablation from `hla-hybrid`" in report
    assert len((out / "commands.txt").read_text().splitlines()) == 2

    before = json.loads((out / "results.json").read_text())["rows"]
    third = rq.main([*common, "--rows", "sse-h,sse-h/decay-long", "--time-budget", "0.01"])
    assert third["rows"] == before  # measured rows are kept, none is measured again
    assert [s["name"] for s in third["skipped"]] == ["sse-h/decay-long"]  # the budget is spent
    assert third["skipped"][0]["needs_seconds"] >= 1
    assert "`sse-h/decay-long`: not started" in (out / "results.md").read_text()
    assert json.loads((out / "results.json").read_text())["skipped"] == third["skipped"]


def test_estimates_prefer_rows_of_the_same_conversion_target(rq):
    """SSE-H adapts slower than the HLA hybrid: a row of one is priced from rows of its own target first."""
    scale = rq.SCALES["h200"]
    table = rq.rows_of(scale, 30)
    kept = {"sse-h": {"seconds": 280.0, "kind": "linear", "seq_len_kind": "base", "to": "sse-h"},
            "hla-hybrid": {"seconds": 177.0, "kind": "linear", "seq_len_kind": "base", "to": "hla-h"},
            "sse-h/rows-4x@seed1": {"seconds": 262.0, "kind": "linear", "seq_len_kind": "4x", "to": "sse-h",
                                    "run": "now"}}
    assert rq.estimate_seconds(table["hla-hybrid"], kept, scale, run_id="now") == 177.0
    assert rq.estimate_seconds(table["hla-hybrid/decay-long"], kept, scale, run_id="now") == 177.0
    assert rq.estimate_seconds(table["sse-h/decay-long"], kept, scale, run_id="now") == 280.0
    # no row of its own target and length: its kind's rows of that length, then of another length
    assert rq.estimate_seconds(table["hla-hybrid/rows-4x"], kept, scale, run_id="now") == 262.0
    del kept["hla-hybrid"]
    assert rq.estimate_seconds(table["hla-hybrid"], kept, scale, run_id="now") == 280.0


def test_estimates_follow_measured_rows_of_the_same_kind(rq):
    scale = rq.SCALES["h200"]
    table = rq.rows_of(scale, 30)
    assert rq.estimate_seconds(table["sse-h"], {}, scale) == scale.prior_seconds["linear"]
    measured = {"sse-h": {"seconds": 150.0, "kind": "linear", "seq_len_kind": "base"},
                "hla-hybrid": {"seconds": 170.0, "kind": "linear", "seq_len_kind": "base"},
                "spla-fresh": {"seconds": 20.0, "kind": "fresh", "seq_len_kind": "base"},
                "failed": {"kind": "linear", "error": "x"}}
    assert rq.estimate_seconds(table["sse-h/decay-long"], measured, scale) == 170.0
    assert rq.estimate_seconds(table["sse-h/rows-4x"], measured, scale) == 1.5 * 170.0  # longer rows
    measured["sse-h/rows-4x"] = {"seconds": 200.0, "kind": "linear", "seq_len_kind": "4x"}
    assert rq.estimate_seconds(table["hla-hybrid/rows-4x"], measured, scale) == 200.0
    assert rq.estimate_seconds(table["spla-fresh"], measured, scale) == 20.0
    assert rq.estimate_seconds(table["spla"], measured, scale) == scale.prior_seconds["spla"]
    assert rq.estimate_seconds(table["sse-h/auto-layers"], measured, scale) == 170.0 + \
        scale.prior_seconds["calibration"]
    # more adaptation steps than a measured row: its adaptation time scales with them, its evaluation does not
    timed = {"sse-h": {"seconds": 150.0, "adapt_seconds": 100.0, "adapt": {"max_steps": 200}, "kind": "linear",
                       "seq_len_kind": "base"}}
    assert rq.estimate_seconds(table["sse-h"], timed, scale, steps=800) == 150.0 + 300.0
    assert rq.estimate_seconds(table["sse-h"], timed, scale) == 150.0
    # a row of this run's kind measured in this run: the kept rows (older code) no longer count
    kept = {"sse-h": {"seconds": 280.0, "kind": "linear", "seq_len_kind": "base", "run": "earlier"},
            "hla-hybrid": {"seconds": 300.0, "kind": "linear", "seq_len_kind": "base"}}
    assert rq.estimate_seconds(table["sse-h/decay-long"], kept, scale, run_id="now") == 300.0
    kept["sse-h/window-128"] = {"seconds": 120.0, "kind": "linear", "seq_len_kind": "base", "run": "now"}
    assert rq.estimate_seconds(table["sse-h/decay-long"], kept, scale, run_id="now") == 120.0
    assert rq.estimate_seconds(table["spla-fresh"], kept, scale, run_id="now") == scale.prior_seconds["fresh"]
    # this run measured only longer rows: the kept rows of the row's own length still come first
    kept = {"sse-h": {"seconds": 280.0, "kind": "linear", "seq_len_kind": "base"},
            "sse-h/rows-4x": {"seconds": 336.0, "kind": "linear", "seq_len_kind": "4x", "run": "now"}}
    assert rq.estimate_seconds(table["sse-h/decay-long"], kept, scale, run_id="now") == 280.0
    assert rq.estimate_seconds(table["hla-hybrid/rows-4x"], kept, scale, run_id="now") == 336.0
    del kept["sse-h"]
    assert rq.estimate_seconds(table["sse-h/decay-long"], kept, scale, run_id="now") == 1.5 * 336.0


def test_missing_packages_are_named_before_the_run(rq, monkeypatch, tmp_path, capsys):
    real = rq.importlib.import_module

    def no_gguf(name, *a):
        if name == "gguf":
            raise ImportError("No module named 'gguf'")
        return real(name, *a)

    monkeypatch.setattr(rq.importlib, "import_module", no_gguf)
    with pytest.raises(SystemExit):
        rq.main(["--out", str(tmp_path), "--gguf", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert "missing Python packages: gguf (de-quantising the GGUF file" in err
    assert not (tmp_path / "results.json").exists()


def test_a_row_past_the_budget_is_stopped_and_the_rest_listed(rq, monkeypatch, tmp_path):
    import signal
    import time
    from types import SimpleNamespace

    scale = rq.SCALES["tiny"]
    table = rq.rows_of(scale, 6)
    started = []

    def fake_row(row, seed, ctx):
        started.append(row.name)
        if row.name == "sse-h":  # runs past the budget: stopped by the deadline, not by its own end
            end = time.perf_counter() + 30.0  # a generous margin over the 0.5 s budget on a loaded machine
            while time.perf_counter() < end:
                time.sleep(0.01)
            handler = signal.getsignal(signal.SIGINT)
            raise AssertionError(f"the deadline did not stop the row in 30 s (SIGINT handler: {handler})")
        return {row.name: {"row": row.name, "seconds": 0.0, "kind": rq.row_kind(row), "metrics": {}}}

    monkeypatch.setattr(rq, "run_row", fake_row)
    monkeypatch.setattr(rq, "estimate_seconds", lambda row, measured, scale, steps=None, run_id=None: 0.0)
    args = SimpleNamespace(time_budget=0.5, t0=time.perf_counter(), remeasure=False, fail_fast=True, tokens=None,
                           spla_seq_len=None, device_type="cpu", steps_per_run=None)
    ctx = dict(args=args, scale=scale, out=tmp_path, device=rq.torch.device("cpu"), run_id="now")
    results = {"protocol": {}, "rows": {}, "skipped": []}
    saved = []
    jobs = [(table[n], 0) for n in ("dense", "sse-h", "hla-hybrid", "spla")]
    rq.measure(jobs, results, ctx, lambda: "t", lambda: saved.append(json.dumps(results)))
    assert started == ["dense", "sse-h"] and list(results["rows"]) == ["dense"]
    assert results["protocol"]["running"] == "sse-h"  # the cut row says so
    assert [s["name"] for s in results["skipped"]] == ["hla-hybrid", "spla"]
    assert json.loads(saved[-1])["rows"] == {"dense": results["rows"]["dense"]}  # written before sse-h started
    time.sleep(0.6)  # a cancelled deadline interrupts nothing later

    for _ in range(20):  # a budget spent before the run starts: the interrupt comes at once, and is caught
        args.t0, args.time_budget, results["skipped"] = time.perf_counter() - 1.0, 0.5, []
        rq.measure(jobs[1:], {"protocol": {}, "rows": {}, "skipped": []}, ctx, lambda: "t", lambda: None)


def test_deadline_cancelled_in_time_interrupts_nothing(rq):
    import time

    deadline = rq.Deadline(time.perf_counter() + 0.2)
    deadline.start()
    deadline.cancel()
    time.sleep(0.4)
    assert not deadline.fired


def test_precision_and_stage1_ablations_change_only_their_setting(rq):
    """`sse-h/fp32` adapts without autocast on the GPU and `sse-h/no-stage1` without attention
    transfer; every other adaptation setting is the base row's."""
    from types import SimpleNamespace

    scale = rq.SCALES["h200"]
    table = rq.rows_of(scale, 30)
    args = SimpleNamespace(tokens=None, spla_seq_len=None, device_type="cuda")
    base = rq.adapt_settings(table["sse-h"], scale, args)
    fp32 = rq.adapt_settings(table["sse-h/fp32"], scale, args)
    plain = rq.adapt_settings(table["sse-h/no-stage1"], scale, args)
    assert base["mixed_precision"] == "bf16" and base["stage1_steps"] > 0
    assert fp32 == {**base, "mixed_precision": "no"}
    assert plain == {**base, "stage1_steps": 0}


def test_deadline_interrupts_where_sigint_is_ignored(rq):
    """A library may leave SIGINT ignored (or to the system); the deadline still interrupts, and puts
    the handler back when cancelled."""
    import signal
    import time

    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        deadline = rq.Deadline(time.perf_counter() + 0.05)
        with pytest.raises(KeyboardInterrupt):
            deadline.start()
            end = time.perf_counter() + 30.0
            while time.perf_counter() < end:
                time.sleep(0.01)
        deadline.cancel()
        assert deadline.fired and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, saved)


def test_a_row_longer_than_the_budget_stops_at_a_checkpoint_and_the_next_run_resumes_it(rq, tmp_path):
    from types import SimpleNamespace

    scale = rq.SCALES["h200"]
    table = rq.rows_of(scale, 30)
    args = SimpleNamespace(tokens=None, spla_seq_len=None, device_type="cuda", steps_per_run=None)
    ref = {"sse-h": {"seconds": 250.0, "adapt_seconds": 200.0, "adapt": {"max_steps": 200}, "kind": "linear",
                     "seq_len_kind": "base"}}
    results = {"rows": dict(ref)}
    row = table["sse-h/decay-long"]
    assert rq.seconds_per_step(row, results["rows"], scale) == 1.0
    assert rq.plan_row(row, results, scale, args, 300.0, None, row.name) == ("run", None, 250.0)  # fits
    # 160 s left: 100 steps fit after the checkpoint margin; stopped there, the rest in the next run
    assert rq.plan_row(row, results, scale, args, 160.0, None, row.name) == ("run", 100, 250.0)
    assert rq.plan_row(row, results, scale, args, 65.0, None, row.name)[0] == "skip"  # fewer than 10 steps fit
    # the next run: 100 steps done, 100 left (est. 150 s with the evaluation)
    results["rows"][row.name] = {"partial": {"steps": 100}}
    assert rq.plan_row(row, results, scale, args, 200.0, None, row.name) == ("run", None, 150.0)
    assert rq.plan_row(row, results, scale, args, 120.0, None, row.name) == ("run", 160, 150.0)
    args.steps_per_run = 30  # a cap on the steps of one run
    assert rq.plan_row(row, results, scale, args, 200.0, None, row.name) == ("run", 130, 150.0)
    assert rq.plan_row(row, results, scale, args, None, None, row.name) == ("run", 130, 150.0)
    assert rq.plan_row(table["dense"], results, scale, args, 1.0, None, "dense")[0] == "skip"  # not adapted: no split

    # end to end on the tiny scale: 2 of the 4 steps, then the same command resumes and evaluates
    out, work = tmp_path / "out", tmp_path / "work"
    command = ["--scale", "tiny", "--device", "cpu", "--out", str(out), "--work", str(work), "--fail-fast",
               "--rows", "sse-h", "--steps-per-run", "2"]
    first = rq.main(command)
    entry = first["rows"]["sse-h"]
    assert "metrics" not in entry and "seconds" not in entry and entry["partial"]["steps"] == 2
    assert "`sse-h`: adapted 2 of 4 steps" in (out / "results.md").read_text()
    second = rq.main(command)  # 2 steps left: within --steps-per-run, so it finishes
    entry = second["rows"]["sse-h"]
    _finite_metrics(entry, rq.SCALES["tiny"], adapted=True)
    assert "partial" not in entry and entry["tokens"] == 4 * rq.SCALES["tiny"].tokens_per_step
    assert [(r["first_step"], r["last_step"]) for r in entry["adapt_runs"]] == [(1, 2), (3, 4)]
    assert entry["adapt_seconds"] == pytest.approx(sum(r["seconds"] for r in entry["adapt_runs"]), abs=1e-3)
    logged = [json.loads(line) for line in (out / "adapt_log_sse-h.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [1, 2, 3, 4]
    assert "adapted 2 of 4" not in (out / "results.md").read_text()
