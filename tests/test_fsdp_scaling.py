"""scripts/studies/fsdp_scaling.py: its bookkeeping (fit search, targets, profiles, resuming, the deadline) on
fake runs, the child runner's out-of-memory / failure / timeout verdicts, the communication / compute
split, the configuration its GPU runs use (FSDP2 with one-row micro-batches and gradient accumulation)
training as one process does, and the whole --dry-run on CPU processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

from scripts.common import fsdp as _fsdp  # noqa: E402
from scripts.studies import fsdp_scaling  # noqa: E402

PY = sys.executable


def test_fit_search_stops_at_the_first_run_that_does_not_fit():
    lengths = [8192, 16384, 32768, 65536]
    seen = []

    def status(n):
        seen.append(n)
        return "ok" if n < 32768 else "oom"

    assert fsdp_scaling.fit_search(lengths, status) == {"longest": 16384, "stopped_at": 32768, "reason": "oom",
                                                        "pending": False}
    assert seen == [8192, 16384, 32768]  # nothing longer is tried after the out-of-memory
    assert fsdp_scaling.fit_search(lengths, lambda n: "ok")["longest"] == 65536
    assert fsdp_scaling.fit_search(lengths, lambda n: "oom")["longest"] is None
    left = fsdp_scaling.fit_search(lengths, lambda n: "ok" if n == 8192 else None)
    assert left["pending"] and left["longest"] == 8192
    assert fsdp_scaling.search_lengths(8192, 65536) == lengths
    assert fsdp_scaling.search_lengths(8192, 60000) == lengths[:3]


def test_comm_compute_split_measures_overlap_from_intervals():
    # compute [0, 4) and [5, 7); communication [3, 6) and [6.5, 8): overlap 1 + 1 + 0.5, alone 0.5 + 1
    split = _fsdp.comm_compute_split([(3.0, 6.0), (6.5, 8.0)], [(0.0, 2.0), (1.0, 4.0), (5.0, 7.0)], wall=10.0)
    assert split["comm_s"] == pytest.approx(4.5)
    assert split["compute_s"] == pytest.approx(6.0)
    assert split["overlap_s"] == pytest.approx(2.5)
    assert split["exposed_comm_s"] == pytest.approx(2.0)
    assert split["idle_s"] == pytest.approx(2.0)  # busy [0, 8)


def test_throughput_leaves_the_warmup_steps_out():
    entries = [{"tokens": 100 * (i + 1), "seconds": s} for i, s in enumerate([10.0, 11.0, 12.0, 13.0])]
    assert _fsdp.throughput(entries, gpus=2, warmup=1) == pytest.approx(300 / 3 / 2)
    assert _fsdp.throughput(entries, gpus=1, warmup=0) == pytest.approx(400 / 13)
    with pytest.raises(ValueError, match="none to time"):
        _fsdp.throughput(entries, gpus=1, warmup=4)


@pytest.mark.parametrize("code, status", [
    ("print('done')", "ok"),
    ("import sys; print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.0 GiB', file=sys.stderr); "
     "sys.exit(1)", "oom"),
    ("raise ValueError('a broken run')", "failed"),
    # Triton's shared-memory limit is a kernel configuration error, not the GPU's memory
    ("import sys; print('triton.runtime.errors.OutOfResources: out of resource: shared memory'); sys.exit(1)",
     "failed"),
])
def test_run_child_says_how_a_child_ended(tmp_path, code, status):
    run = _fsdp.run_child([PY, "-c", code], {"MARK": "1"}, tmp_path / "child.log")
    assert run.status == status, run.tail
    assert (tmp_path / "child.log").read_text() == run.tail


def test_run_child_timeout_ends_the_children_of_the_child(tmp_path):
    """A timed-out launcher's workers (torchrun's processes) end with it: the whole process group."""
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(300)")
    started = time.perf_counter()
    run = _fsdp.run_child([PY, "-c", code], {}, tmp_path / "child.log", timeout=3)
    assert run.status == "timeout" and time.perf_counter() - started < 60
    pid = int(pid_file.read_text())
    for _ in range(50):  # the grandchild is gone (reaped by init, or a zombie at most)
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {pid} of the timed-out child still runs")


def test_child_env_keeps_nvlink_multicast_off_and_names_the_fsdp_config():
    for cuda in (True, False):
        env = _fsdp.child_env(cuda)
        assert {k: env[k] for k in _fsdp.NCCL_ENV} == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                                       "NVSHMEM_DISABLE_NVLS": "1"}
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    assert _fsdp.child_env(False)["ACCELERATE_USE_CPU"] == "1" and "ACCELERATE_USE_CPU" not in _fsdp.child_env(True)
    launch = _fsdp.accelerate_launch(4)
    assert launch[-4:] == ["--config_file", str(ROOT / "configs" / "accelerate" / "fsdp.yaml"), "--num_processes", "4"]
    fsdp_scaling.check_config(_fsdp.FSDP_CONFIG)  # FSDP2, full sharding, checkpointing left to adapt


def test_check_config_refuses_checkpointing_twice(tmp_path):
    cfg = tmp_path / "fsdp.yaml"
    cfg.write_text(_fsdp.FSDP_CONFIG.read_text().replace("fsdp_activation_checkpointing: false",
                                                         "fsdp_activation_checkpointing: true"))
    with pytest.raises(SystemExit, match="fsdp_activation_checkpointing is True"):
        fsdp_scaling.check_config(cfg)


class FakeRuns:
    """Stands in for the adaptation children: parses the adapt command, writes the adapt_log.jsonl a run
    of the given speed and memory would write, or ends out of memory from `oom_at[gpus]` tokens per row."""

    def __init__(self, speed: dict, memory: dict, oom_at: dict) -> None:
        self.speed, self.memory, self.oom_at, self.calls = speed, memory, oom_at, []

    def __call__(self, cmd, env, log_file, timeout=None):
        arg = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
        gpus, seq_len = int(arg("--num_processes")), int(arg("--seq-len"))
        micro, accum, steps = int(arg("--batch-size")), int(arg("--grad-accum")), int(arg("--max-steps"))
        family, out = Path(arg("adapt")).name, Path(arg("-o"))
        self.calls.append((family, gpus, seq_len, micro, accum, "PROFILE_OUT" in env))
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log_file.write_text("fake\n")
        assert {k: env[k] for k in _fsdp.NCCL_ENV} == _fsdp.NCCL_ENV
        if seq_len >= self.oom_at[gpus]:
            return _fsdp.ChildRun("oom", 1.0, "torch.OutOfMemoryError: CUDA out of memory.", 1)
        out.mkdir(parents=True, exist_ok=True)
        tokens = gpus * micro * accum * seq_len
        per_gpu = self.speed[family] * (1.0 if gpus == 1 else self.speed[f"{family}/scaling"])
        step_s = tokens / gpus / per_gpu
        peak = self.memory[family] * seq_len * (1.0 if gpus == 1 else self.memory[f"{family}/scaling"])
        entries = [{"step": s, "stage": 2, "loss": 5.0 - 0.1 * s, "tokens": s * tokens,
                    "seconds": 10.0 + s * step_s, "peak_memory_gib": [peak] * gpus}  # step 1: 10 s more
                   for s in range(1, steps + 1)]
        (out / "adapt_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
        if "PROFILE_OUT" in env:
            per_step = {"wall_s": step_s, "comm_s": 0.4 * step_s, "compute_s": 0.5 * step_s,
                        "overlap_s": 0.1 * step_s, "exposed_comm_s": 0.3 * step_s, "idle_s": 0.2 * step_s}
            Path(env["PROFILE_OUT"]).write_text(json.dumps({"steps": 3, "per_step": per_step}))
        return _fsdp.ChildRun("ok", 2.0, "fake", 0)


def test_study_on_fake_runs_flags_targets_searches_fits_and_resumes(tmp_path, monkeypatch):
    fake = FakeRuns(speed={"spla": 1000.0, "spla/scaling": 0.95, "hla": 2000.0, "hla/scaling": 0.5},
                    memory={"spla": 0.01, "spla/scaling": 0.55, "hla": 0.01, "hla/scaling": 0.8},
                    oom_at={1: 512, 2: 1024})
    monkeypatch.setattr(fsdp_scaling, "run_child", fake)
    monkeypatch.setattr(fsdp_scaling, "prepare", lambda work, scale, families: {
        "dense": work / "dense", **{f: work / "converted" / f for f in families}})
    out = tmp_path / "out"
    common = ["--dry-run", "--out", str(out), "--work", str(tmp_path / "work"), "--families", "spla,hla",
              "--lengths", "64", "128", "--max-len", "2048", "--warmup", "1", "--steps", "3"]
    fsdp_scaling.main([*common, "--profile"])
    res = json.loads((out / "results.json").read_text())
    rows = res["rows"]
    thr = rows["throughput/spla/2/128"]
    assert (thr["micro_batch"], thr["grad_accum"], thr["rows_per_gpu"]) == (1, 4, 4)  # global batch 8 on 2 GPUs
    assert rows["throughput/spla/1/128"]["grad_accum"] == 8
    assert thr["tokens_per_s_per_gpu"] == pytest.approx(950.0)  # the warm-up step's 10 s left out
    assert "--num_processes 2" in thr["command"] and "NCCL_NVLS_ENABLE=0" in thr["command"]
    met = {(t["family"], t["target"].split(",")[0][:10], t["target"].split(", ")[-1]): t["met"] for t in res["targets"]}
    assert met[("spla", "scaling ef", "8192 tokens per row")] is None  # not measured at 8192 in this run
    assert met[("spla", "peak memor", "128 tokens per row")] is True
    assert met[("hla", "peak memor", "64 tokens per row")] is False
    # profiles only where the efficiency missed 90%: HLA at 50%, not SPLA at 95%
    assert sorted(k for k in rows if k.startswith("profile/")) == ["profile/hla/2/128", "profile/hla/2/64"]
    # fits: 64 and 128 come from the throughput runs; then 256 ran, 512 (one GPU) / 1024 (two) ran out of memory
    fits = res["fits"]["spla"]
    assert (fits["1"]["longest"], fits["1"]["stopped_at"], fits["1"]["reason"]) == (256, 512, "oom")
    assert (fits["2"]["longest"], fits["2"]["stopped_at"], fits["2"]["reason"]) == (512, 1024, "oom")
    fit_runs = sorted((g, n) for f, g, n, micro, accum, _ in fake.calls if f == "spla" and (micro, accum) == (1, 1))
    assert fit_runs == [(1, 256), (1, 512), (2, 256), (2, 512), (2, 1024)]
    md = (out / "results.md").read_text()
    assert "| spla | 128 | 2 | 4 (1 x 4) |" in md and "| 95% |" in md
    assert "| hla | 1 | 256 | 512: out of memory |" in md
    assert "## Communication vs compute" in md and "communication: exposed NCCL" in md
    assert md.count("- throughput/") == 8

    # a second call into the same OUT runs nothing that ran or ran out of memory
    n = len(fake.calls)
    fsdp_scaling.main([*common, "--profile"])
    assert len(fake.calls) == n
    # --redo runs the selection again, once each; --deadline 0 leaves every run for a later call
    fsdp_scaling.main([*common, "--families", "spla", "--lengths", "64", "--gpus", "1", "--measure", "throughput",
                       "--redo"])
    assert fake.calls[n:] == [("spla", 1, 64, 1, 8, False)]
    fsdp_scaling.main([*common, "--lengths", "32", "--measure", "throughput", "--deadline", "0"])
    res = json.loads((out / "results.json").read_text())
    assert len(fake.calls) == n + 1 and "throughput/hla/2/32" in res["pending"]
    assert "Not run in this call (deadline)" in (out / "results.md").read_text()


def test_global_batch_must_split_over_every_gpu_count(tmp_path):
    for bad in (["--global-batch", "6", "--micro-batch", "2"], ["--global-batch", "3"], ["--gpus", "4"]):
        with pytest.raises(SystemExit):
            fsdp_scaling.parse(["--dry-run", "--out", str(tmp_path), *bad])
    args, scale, cuda = fsdp_scaling.parse(["--dry-run", "--out", str(tmp_path)])
    assert (args.gpus, args.lengths, scale, cuda) == ([1, 2], [64, 128], fsdp_scaling.DRY, False)
    assert fsdp_scaling.GPU.shape["hidden_size"] == 2048 and fsdp_scaling.GPU.lengths == (8192, 32768)


@pytest.mark.slow
def test_fsdp_gradient_accumulation_trains_as_one_process(tmp_path):
    """What the GPU runs rely on: accelerate's FSDP2 path with configs/accelerate/fsdp.yaml, on one and
    on two processes (taken on CPU by tests/adaptation/fsdp_cpu.py, gloo), with one-row micro-batches
    accumulated to the global batch and activation checkpointing (fsdp_scaling.adapt_args), follows one
    plain process that takes the global batch at once."""
    sys.path.insert(0, str(ROOT / "tests" / "adaptation"))
    from fsdp_cpu import fsdp_env

    folders = fsdp_scaling.prepare(tmp_path / "work", fsdp_scaling.DRY, ["hla"])
    data = fsdp_scaling.random_rows(tmp_path / "work", 64, 8, fsdp_scaling.DRY.shape["vocab_size"])

    def args(out, micro, accum):
        return fsdp_scaling.adapt_args(folders["hla"], data, tmp_path / out, 64, micro, accum, 3, "lm", "no")

    base = {**os.environ, **_fsdp.child_env(cuda=False)}
    plain = subprocess.run([PY, "-m", "subquadratic", *args("plain", 8, 1)], capture_output=True, text=True, env=base)
    assert plain.returncode == 0, plain.stderr[-3000:]
    logs = {}
    for n in (1, 2):
        env = {**base, **fsdp_env(str(_fsdp.FSDP_CONFIG)), "FSDP_UNITS_FILE": str(tmp_path / f"units{n}"),
               "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "adaptation"), base["PYTHONPATH"]])}
        r = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
                            str(ROOT / "tests" / "adaptation" / "fsdp_cpu.py"), *args(f"fsdp{n}", 1, 8 // n)],
                           capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        units = json.loads((tmp_path / f"units{n}.0").read_text())
        assert units.count("SubquadraticDecoderLayer") == fsdp_scaling.DRY.shape["num_hidden_layers"], units
        logs[n] = _fsdp.read_log(tmp_path / f"fsdp{n}")
    ref = _fsdp.read_log(tmp_path / "plain")
    assert ref[-1]["loss"] < ref[0]["loss"]  # it trains: equal curves are not equal constants
    for n, entries in logs.items():
        assert [e["tokens"] for e in entries] == [e["tokens"] for e in ref] == [512, 1024, 1536]
        for x, y in zip(ref, entries, strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (n, x, y)
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4), (n, x, y)


@pytest.mark.slow
def test_dry_run_measures_every_cell_and_resumes(tmp_path):
    """The whole pipeline on two gloo processes: the tiny dense model and its conversion, the
    throughput runs on one and two processes, a profiled run, the fit search; a second call into the
    same OUT and WORK runs nothing again."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [PY, "-m", "scripts.studies.fsdp_scaling", "--dry-run", "--out", str(out), "--work", str(work),
           "--families", "sse-h", "--lengths", "64", "--max-len", "128", "--warmup", "1", "--steps", "2",
           "--profile", "all", "--profile-steps", "1"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert sorted(rows) == ["fit/sse-h/1/128", "fit/sse-h/2/128", "profile/sse-h/2/64", "throughput/sse-h/1/64",
                            "throughput/sse-h/2/64"]
    assert all(r["status"] == "ok" for r in rows.values()), {k: r.get("error") for k, r in rows.items()}
    for gpus in (1, 2):
        r = rows[f"throughput/sse-h/{gpus}/64"]
        assert r["tokens_per_s_per_gpu"] > 0 and r["rows_per_gpu"] * gpus == 8
        assert f"--num_processes {gpus} -m subquadratic adapt" in r["command"]
        log = (out / "logs" / f"throughput-sse-h-{gpus}-64.adapt_log.jsonl").read_text().splitlines()
        assert len(log) == 3
    profile = rows["profile/sse-h/2/64"]["profile"]
    assert profile["steps"] == 1 and profile["wall_s"] > 0 and profile["compute_s"] > 0
    assert results["fits"]["sse-h"]["2"]["longest"] == 128
    md = (out / "results.md").read_text()
    assert "cpu (dry run)" in md and "not a measurement" in md and "| sse-h | 64 | 2 | 4 (1 x 4) |" in md
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "throughput/" not in again.stderr  # nothing ran again
    assert json.loads((out / "results.json").read_text())["rows"] == rows
