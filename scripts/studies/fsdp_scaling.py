"""`subquadratic adapt` sharded with FSDP2 at Llama-3.2-1B size on 1, 2, 4 and 8 GPUs of one host:
tokens/s per GPU, scaling efficiency, peak memory per GPU and the longest row each configuration fits.

    python -m scripts.studies.fsdp_scaling --out out/fsdp-scaling --work out/fsdp-work \\
        [--families spla sse-h hla] [--lengths 8192 32768] [--gpus 1 2 4 8] [--global-batch 8] \\
        [--measure throughput fit] [--profile] [--deadline 540]

The model has Llama-3.2-1B's shapes (scripts/common/models.py) and random weights: speed does not depend on
the weights. Its SPLA, SSE-H and HLA conversions are made by subquadratic.conversion.convert with the
defaults. The data is random token ids (a word-level tokenizer over the whole vocabulary, one document
of L tokens per row): throughput does not depend on the tokens either.

Every run is `subquadratic adapt` under `accelerate launch --config_file configs/accelerate/fsdp.yaml
--num_processes n`, one GPU included (the same launch with one process): FSDP2, full sharding, one
shard unit per decoder layer, bf16 parameters with gradients reduced in float32, activation
checkpointing through adapt's --gradient-checkpointing (the configuration's
fsdp_activation_checkpointing stays false; with both, every layer would be recomputed twice), the
next-token loss (`--loss kl` distils from the dense model, which every GPU then holds unsharded).
Every n adapts the same global batch of G rows per optimizer step, G/n rows per GPU as micro-batches of
`--micro-batch` rows (gradient accumulation: one GPU could not hold G rows of activations at once), so
a GPU's activations are the same for every n and what changes is what FSDP shards and communicates.
`--warmup` steps (compilation, autotuning) are left out of the timing of the `--steps` that follow.
NVLink multicast is off in every child (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1).

Per run: tokens/s per GPU, the scaling efficiency (n-GPU tokens/s over n times one GPU's), each GPU's
peak memory (adapt's peak_memory_gib, memory allocated by PyTorch) and its ratio to one GPU's. Per
family and GPU count: the longest row that fits with one row per GPU, searched over powers of two from
the shortest --lengths up to --max-len and stopped at the first out-of-memory, which is recorded as such
(a throughput run of one-row micro-batches that ran counts as a fit). The targets are flagged: scaling
efficiency >= 90% at two GPUs at 8192 tokens per row, peak memory per GPU at two GPUs <= 60% of one
GPU's. `--profile` adds, for every multi-GPU run below 90% efficiency (`--profile all`: every one), a
short run profiled on the first process: the time NCCL kernels run against the rest, and how much of
it no computation hides.

OUT gets results.json and results.md (rewritten as each run finishes, with the exact commands) and
logs/ (each child's output and adapt_log.jsonl). To split the work over calls of limited time: the
selection flags (--families, --lengths, --gpus, --measure); a --work folder prepared by an earlier call
(the dense model, the conversions, the data) is reused; runs already in OUT/results.json that ran or
ran out of memory are kept and not run again (--redo runs them again); --deadline S starts no run
after S seconds and gives each run only the time left before it.

`--dry-run` runs the same pipeline at tiny scale on a CPU with two gloo processes. accelerate does not
shard on CPU (the processes run data-parallel): a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from scripts.common.fsdp import (  # noqa: E402
    FSDP_CONFIG,
    ROOT,
    accelerate_launch,
    child_env,
    read_log,
    run_child,
    shell_line,
    throughput,
)
from scripts.common.models import LLAMA_1B, TINY, dense_model, log, versions  # noqa: E402

FAMILIES = ("spla", "sse-h", "hla")
TARGET_LENGTH = 8192  # tokens per row of the efficiency target
TARGET_EFFICIENCY = 0.9  # two-GPU tokens/s over twice one GPU's
TARGET_MEMORY = 0.6  # two-GPU peak memory per GPU over one GPU's
PROFILER = Path(__file__).resolve().parents[1] / "tools" / "profiled_adapt.py"
#: statuses of a run that are not run again by a later call (without --redo)
FINAL = ("ok", "oom")


@dataclass(frozen=True)
class Scale:
    shape: dict
    weights: torch.dtype  # of the saved checkpoints (adapt trains in float32 with --mixed-precision)
    max_positions: int
    lengths: tuple[int, ...]
    max_len: int
    precision: str  # adapt --mixed-precision
    min_run_s: float  # with --deadline: no run starts with less time left


GPU = Scale(LLAMA_1B, torch.bfloat16, 1 << 20, (8192, 32768), 262144, "bf16", 90.0)
DRY = Scale(TINY, torch.float32, 4096, (64, 128), 256, "no", 0.0)


# --- the model and the data -----------------------------------------------------------------------


def word_tokenizer(vocab: int):
    """A word-level tokenizer with one word per token id: `<pad>` 0, `<eos>` 1, `w2` .. `w{vocab-1}`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<pad>")


def prepare(work: Path, scale: Scale, families: list[str]) -> dict[str, Path]:
    """The dense model (random weights, the tokenizer) and its conversions in WORK, built where absent:
    a WORK of an earlier call is reused. Returns {"dense": folder, family: folder}."""
    from subquadratic.conversion import convert

    meta = {"shape": scale.shape, "weights": str(scale.weights), "max_positions": scale.max_positions}
    saved = work / "prepared.json"
    if saved.exists() and json.loads(saved.read_text()) != meta:
        raise SystemExit(f"{work} holds another model ({json.loads(saved.read_text())}); give another --work")
    work.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(meta))
    dense = work / "dense"
    if not (dense / "config.json").is_file():
        log(f"building the dense model (random weights) in {dense}")
        model = dense_model(scale.shape, scale.max_positions, torch.device("cpu"), scale.weights)
        tmp = work / "dense.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        word_tokenizer(scale.shape["vocab_size"]).save_pretrained(tmp)
        del model
        tmp.rename(dense)
    folders = {"dense": dense}
    for family in families:
        folder = work / "converted" / family
        if not (folder / "config.json").is_file():  # convert writes complete or nothing
            log(f"converting to {family}")
            convert(str(dense), str(folder), family, overwrite=True, progress=False)
        folders[family] = folder
    return folders


def random_rows(work: Path, seq_len: int, rows: int, vocab: int) -> Path:
    """A jsonl of `rows` documents of random words, each `seq_len` tokens with its end token: packed,
    one document per row of `seq_len` (made once per WORK)."""
    import numpy as np

    path = work / "data" / f"random-{seq_len}x{rows}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seq_len)
        words = np.array([f"w{i}" for i in range(vocab)])
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as f:
            for _ in range(rows):
                f.write(json.dumps({"text": " ".join(words[rng.integers(2, vocab, seq_len - 1)])}) + "\n")
        tmp.rename(path)
    return path


# --- the study ------------------------------------------------------------------------------------


def adapt_args(student: Path, data: Path, out: Path, seq_len: int, micro: int, accum: int, steps: int, loss: str,
               precision: str, teacher: Path | None = None) -> list[str]:
    """The arguments of one `subquadratic adapt` run of this study: `micro` rows per process and forward,
    `accum` micro-batches per optimizer step, no attention transfer, activation checkpointing, no
    checkpoints on the way."""
    args = ["adapt", str(student), "--data", str(data), "-o", str(out), "--overwrite", "--max-steps", str(steps),
            "--stage1-steps", "0", "--loss", loss, "--seq-len", str(seq_len), "--batch-size", str(micro),
            "--grad-accum", str(accum), "--mixed-precision", precision, "--gradient-checkpointing",
            "--save-every", str(10**6), "--no-progress", "--seed", "0"]
    if loss == "kl":
        args += ["--teacher", str(teacher)]
    return args


def key(kind: str, family: str, gpus: int, seq_len: int) -> str:
    return f"{kind}/{family}/{gpus}/{seq_len}"


def search_lengths(shortest: int, max_len: int) -> list[int]:
    """Powers of two times the shortest length, up to max_len."""
    out, n = [], shortest
    while n <= max_len:
        out.append(n)
        n *= 2
    return out


def fit_search(lengths: list[int], status_at: Callable[[int], str | None]) -> dict:
    """Walk `lengths` upwards while `status_at(L)` (a run's status, or None when it could not run) is
    "ok"; stop at the first other status. Returns the longest fitting length (None if none), the
    length it stopped at and why (None: every length fits), and whether runs are still pending."""
    longest = None
    for n in lengths:
        status = status_at(n)
        if status is None:
            return {"longest": longest, "stopped_at": None, "reason": None, "pending": True}
        if status != "ok":
            return {"longest": longest, "stopped_at": n, "reason": status, "pending": False}
        longest = n
    return {"longest": longest, "stopped_at": None, "reason": None, "pending": False}


class Study:
    """The selected runs, the results they add to OUT/results.json, and the report."""

    def __init__(self, args: argparse.Namespace, scale: Scale, cuda: bool, folders: dict[str, Path],
                 results: dict) -> None:
        self.args, self.scale, self.cuda, self.folders, self.results = args, scale, cuda, folders, results
        self.out, self.work = Path(args.out), Path(args.work)
        self.started = time.perf_counter()
        self.rows = results.setdefault("rows", {})
        self.pending: list[str] = []  # runs the deadline left for a later call
        self.fresh: set[str] = set()  # runs of this call

    # -- running ---------------------------------------------------------------------------------

    def time_left(self) -> float:
        """Seconds a run may take (--timeout, or what --deadline leaves), 0 when none may start."""
        left = self.args.timeout
        if self.args.deadline is not None:
            rest = self.args.deadline - (time.perf_counter() - self.started)
            if rest < self.scale.min_run_s or rest <= 0:
                return 0
            left = min(left, rest)
        return left

    def execute(self, kind: str, family: str, gpus: int, seq_len: int, micro: int, accum: int, steps: int,
                profile: bool = False) -> dict | None:
        """One adaptation run, recorded under its key; None when the deadline leaves no time for it."""
        k = key(kind, family, gpus, seq_len)
        left = self.time_left()
        if left == 0:
            self.pending.append(k)
            return None
        name = k.replace("/", "-")
        folder = self.work / "runs" / name
        rows = max(self.args.global_batch, max(self.args.gpus))
        data = random_rows(self.work, seq_len, rows, self.scale.shape["vocab_size"])
        env = child_env(self.cuda)
        program = ["-m", "subquadratic"]
        if profile:
            report = self.out / "logs" / f"{name}.profile.json"
            report.unlink(missing_ok=True)
            env.update(PROFILE_AFTER=str(self.args.warmup), PROFILE_STEPS=str(self.args.profile_steps),
                       PROFILE_OUT=str(report))
            program = [str(PROFILER)]
        cmd = [*accelerate_launch(gpus), *program,
               *adapt_args(self.folders[family], data, folder, seq_len, micro, accum, steps, self.args.loss,
                           self.scale.precision, self.folders["dense"])]
        log(f"{k}: {steps} steps of {gpus} process(es) x {accum} micro-batch(es) x {micro} row(s) x {seq_len} tokens")
        run = run_child(cmd, env, self.out / "logs" / f"{name}.log", timeout=left)
        row = {"kind": kind, "family": family, "gpus": gpus, "seq_len": seq_len, "micro_batch": micro,
               "grad_accum": accum, "rows_per_gpu": micro * accum, "steps": steps, "status": run.status,
               "wall_seconds": run.seconds, "command": shell_line(cmd, env)}
        if run.status == "ok":
            try:
                entries = read_log(folder)
                shutil.copy(folder / "adapt_log.jsonl", self.out / "logs" / f"{name}.adapt_log.jsonl")
                row.update(self.measure(kind, entries, gpus, name))
            except (OSError, ValueError, KeyError) as e:
                row.update(status="failed", error=f"the run ended but its log or profile is unusable: {e}")
        else:
            row["error"] = run.tail[-1500:]
        shutil.rmtree(folder, ignore_errors=True)  # the adapted weights: only the log is wanted
        self.rows[k] = row
        self.fresh.add(k)
        self.save()
        log(f"{k}: {row['status']}" + (f", {row['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU"
                                        if "tokens_per_s_per_gpu" in row else ""))
        return row

    def measure(self, kind: str, entries: list[dict], gpus: int, name: str) -> dict:
        m = {"peak_memory_gib": entries[-1].get("peak_memory_gib"), "loss_first": entries[0]["loss"],
             "loss_last": entries[-1]["loss"]}
        if kind == "throughput":
            w = self.args.warmup
            m.update(tokens_per_s_per_gpu=throughput(entries, gpus, w),
                     step_seconds=(entries[-1]["seconds"] - entries[w - 1]["seconds"]) / (len(entries) - w))
        if kind == "profile":
            m["profile"] = json.loads((self.out / "logs" / f"{name}.profile.json").read_text())
        return m

    def done(self, k: str) -> dict | None:
        """The row of `k` from this or an earlier call, if it need not run (again)."""
        row = self.rows.get(k)
        if row is None or row["status"] not in FINAL or (self.args.redo and k not in self.fresh):
            return None
        return row

    def run_throughput(self) -> None:
        a = self.args
        for family in a.families:
            for seq_len in a.lengths:
                for gpus in a.gpus:
                    if self.done(key("throughput", family, gpus, seq_len)) is None:
                        per_gpu = a.global_batch // gpus
                        self.execute("throughput", family, gpus, seq_len, a.micro_batch, per_gpu // a.micro_batch,
                                     a.warmup + a.steps)

    def run_profiles(self) -> None:
        a = self.args
        for family in a.families:
            for seq_len in a.lengths:
                for gpus in a.gpus:
                    eff = self.efficiency(family, gpus, seq_len)
                    if gpus == 1 or eff is None or (a.profile == "missed" and eff >= TARGET_EFFICIENCY):
                        continue
                    if self.done(key("profile", family, gpus, seq_len)) is None:
                        thr = self.rows[key("throughput", family, gpus, seq_len)]
                        self.execute("profile", family, gpus, seq_len, thr["micro_batch"], thr["grad_accum"],
                                     a.warmup + a.profile_steps, profile=True)

    def run_fits(self) -> None:
        lengths = search_lengths(min(self.args.lengths), self.args.max_len)
        for family in self.args.families:
            for gpus in self.args.gpus:
                fit_search(lengths, lambda n, family=family, gpus=gpus: self.fit_status(family, gpus, n, run=True))

    def fit_status(self, family: str, gpus: int, seq_len: int, run: bool) -> str | None:
        """Whether one row per GPU of `seq_len` tokens fits: "ok" when a throughput run of one-row
        micro-batches ran (its gradient accumulation only adds memory), else the status of the fit run,
        made now if `run` and none counts yet; None when unknown (or left to a later call)."""
        if (thr := self.ok("throughput", family, gpus, seq_len)) is not None and thr["micro_batch"] == 1:
            return "ok"
        k = key("fit", family, gpus, seq_len)
        if run:
            row = self.done(k) or self.execute("fit", family, gpus, seq_len, 1, 1, self.args.fit_steps)
        else:
            row = self.rows.get(k)
        return None if row is None or row["status"] == "timeout" else row["status"]

    # -- reading the rows ------------------------------------------------------------------------

    def ok(self, kind: str, family: str, gpus: int, seq_len: int) -> dict | None:
        row = self.rows.get(key(kind, family, gpus, seq_len))
        return row if row is not None and row["status"] == "ok" else None

    def efficiency(self, family: str, gpus: int, seq_len: int) -> float | None:
        one, many = self.ok("throughput", family, 1, seq_len), self.ok("throughput", family, gpus, seq_len)
        if one is None or many is None:
            return None
        return many["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]

    def memory_ratio(self, family: str, gpus: int, seq_len: int) -> float | None:
        one, many = self.ok("throughput", family, 1, seq_len), self.ok("throughput", family, gpus, seq_len)
        if one is None or many is None or not one.get("peak_memory_gib") or not many.get("peak_memory_gib"):
            return None
        return max(many["peak_memory_gib"]) / max(one["peak_memory_gib"])

    def fits(self) -> dict:
        """{family: {gpus: fit_search result}} from the rows so far (no runs)."""
        out: dict = {}
        lengths = search_lengths(min(self.args.lengths), self.args.max_len)
        for family, gpus in sorted({(r["family"], r["gpus"]) for r in self.rows.values()}):
            r = fit_search(lengths, lambda n, family=family, gpus=gpus: self.fit_status(family, gpus, n, run=False))
            if r["longest"] is not None or r["stopped_at"] is not None:
                at = r["longest"]
                row = (self.ok("fit", family, gpus, at) or self.ok("throughput", family, gpus, at)) if at else None
                r["peak_memory_gib"] = row.get("peak_memory_gib") if row else None
                r["peak_from"] = row["kind"] if row else None
                out.setdefault(family, {})[gpus] = r
        return out

    def targets(self) -> list[dict]:
        out = []
        for family in sorted({r["family"] for r in self.rows.values()}):
            eff = self.efficiency(family, 2, TARGET_LENGTH)
            out.append({"family": family, "target": f"scaling efficiency at 2 GPUs, {TARGET_LENGTH} tokens per row",
                        "bound": f">= {TARGET_EFFICIENCY:.0%}", "measured": eff,
                        "met": None if eff is None else eff >= TARGET_EFFICIENCY})
            for seq_len in sorted({r["seq_len"] for r in self.rows.values() if r["kind"] == "throughput"}):
                mem = self.memory_ratio(family, 2, seq_len)
                if mem is not None:
                    out.append({"family": family, "target": f"peak memory per GPU at 2 GPUs over 1 GPU's, {seq_len} "
                                "tokens per row", "bound": f"<= {TARGET_MEMORY:.0%}", "measured": mem,
                                "met": mem <= TARGET_MEMORY})
        return out

    def save(self) -> None:
        self.results["targets"] = self.targets()
        self.results["fits"] = self.fits()
        self.results["pending"] = self.pending
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / "results.md").write_text(report(self))


# --- the report -----------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def _gib(peak: list[float] | None) -> str:
    return ", ".join(f"{m:.1f}" for m in peak) if peak else "-"


def _why(row: dict) -> str:
    if row["status"] == "ok":
        return "ran"
    if row["status"] == "oom":
        return "out of memory"
    if row["status"] == "timeout":
        return "timed out"
    lines = [ln for ln in row.get("error", "").splitlines() if ln.strip()]
    return "failed: " + (lines[-1][:160].replace("|", "/") if lines else "no output")


def bound(study: Study, row: dict) -> str:
    """What bounds a profiled multi-GPU run: the time it loses per step against a perfect split of
    the one-GPU step (one GPU's step time over n), and how much of that the exposed NCCL time covers."""
    one = study.ok("throughput", row["family"], 1, row["seq_len"])
    many = study.ok("throughput", row["family"], row["gpus"], row["seq_len"])
    if one is None or many is None:
        return ""
    lost = many["step_seconds"] - one["step_seconds"] / row["gpus"]
    exposed = row["profile"]["per_step"]["exposed_comm_s"]
    if lost <= 0:
        return "nothing lost"
    share = exposed / lost
    what = "communication" if share >= 0.5 else "not communication (compute, FSDP's copies, the host)"
    return f"{what}: exposed NCCL {exposed:.3f} s of {lost:.3f} s lost per step ({share:.0%})"


def report(study: Study) -> str:
    r, s = study.results, study.results["settings"]
    rows = study.rows
    thr = sorted((x for x in rows.values() if x["kind"] == "throughput"),
                 key=lambda x: (x["family"], x["seq_len"], x["gpus"]))
    model = "Llama-3.2-1B shapes" if s["model"] == LLAMA_1B else "tiny shapes (dry run)"
    lines = [f"# `subquadratic adapt` sharded with FSDP2: {model}, {r['device']}, {r['date']}", "",
             s["description"], "", f"Versions: {r['versions']}.", "",
             "## Throughput and memory", "",
             "| family | tokens per row | GPUs | rows per GPU per step (micro-batch x accumulation) | step s | "
             "tokens/s per GPU | scaling efficiency | peak memory per GPU (GiB) | peak vs 1 GPU | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in thr:
        f, g, n = x["family"], x["gpus"], x["seq_len"]
        if x["status"] == "ok":
            eff = _pct(study.efficiency(f, g, n)) if g > 1 else ""
            mem = _pct(study.memory_ratio(f, g, n)) if g > 1 else ""
            cells = [f"{x['step_seconds']:.3f}", f"{x['tokens_per_s_per_gpu']:,.0f}", eff,
                     _gib(x.get("peak_memory_gib")), mem, "ran"]
        else:
            cells = ["-", "-", "", "-", "", _why(x)]
        batch = f"{x['rows_per_gpu']} ({x['micro_batch']} x {x['grad_accum']})"
        lines.append("| " + " | ".join([f, str(n), str(g), batch, *cells]) + " |")
    lines += ["", "## Targets", "", "| family | target | bound | measured | met |", "| --- | --- | --- | --- | --- |"]
    for t in r["targets"]:
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['family']} | {t['target']} | {t['bound']} | {_pct(t['measured'])} | {met} |")
    lines += ["", f"## Longest row that fits (one row per GPU, powers of two up to {s['max_len']})", "",
              "| family | GPUs | longest row that fits | stopped at | peak memory per GPU there (GiB) |",
              "| --- | --- | --- | --- | --- |"]
    for family, per in r["fits"].items():
        for gpus, fit in sorted(per.items()):
            stop = ("pending" if fit["pending"] else f"every length fits up to {s['max_len']}"
                    if fit["stopped_at"] is None else f"{fit['stopped_at']}: {_why({'status': fit['reason']})}")
            peak = f"{_gib(fit['peak_memory_gib'])} ({fit['peak_from']} run)" if fit["peak_memory_gib"] else "-"
            lines.append(f"| {family} | {gpus} | {fit['longest'] or 'none'} | {stop} | {peak} |")
    profiled = sorted((x for x in rows.values() if x["kind"] == "profile" and x["status"] == "ok"),
                      key=lambda x: (x["family"], x["seq_len"], x["gpus"]))
    if profiled:
        lines += ["", "## Communication vs compute (profiled steps on the first process)", "",
                  f"Per step, over {s['profile_steps']} profiled steps after {s['warmup']} warm-up steps: time in "
                  "NCCL kernels, in every other kernel (compute), both at once, NCCL alone (exposed) and neither "
                  "(idle).", "",
                  "| family | tokens per row | GPUs | step s (profiled) | compute s | NCCL s | overlap s | exposed "
                  "NCCL s | idle s | what bounds it |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for x in profiled:
            p = x["profile"]["per_step"]
            lines.append(f"| {x['family']} | {x['seq_len']} | {x['gpus']} | {p['wall_s']:.3f} | {p['compute_s']:.3f} "
                         f"| {p['comm_s']:.3f} | {p['overlap_s']:.3f} | {p['exposed_comm_s']:.3f} | {p['idle_s']:.3f} "
                         f"| {bound(study, x)} |")
    if r["pending"]:
        lines += ["", f"Not run in this call (deadline): {', '.join(r['pending'])}."]
    lines += ["", "## Commands", "", f"This script: `{r['script_command']}`", ""]
    for k in sorted(rows, key=lambda k: (rows[k]["kind"], rows[k]["family"], rows[k]["seq_len"], rows[k]["gpus"])):
        lines.append(f"- {k}: `{rows[k]['command']}`")
    return "\n".join(lines) + "\n"


# --- the command line -----------------------------------------------------------------------------


def describe(args: argparse.Namespace, scale: Scale, cuda: bool) -> str:
    model = "Llama-3.2-1B shapes" if scale.shape is LLAMA_1B else "tiny Llama shapes (dry run)"
    how = ("FSDP2 through `accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes n` (full "
           "sharding, one shard unit per decoder layer, bf16 parameters, gradients reduced in float32)" if cuda else
           "the same `accelerate launch` line on CPU processes (gloo, data-parallel: accelerate shards only on GPUs; "
           "a check of the script, not a measurement)")
    loss = "next-token loss" if args.loss == "lm" else "KL distillation from the dense model (unsharded on every GPU)"
    return (f"{model} with random weights (speed does not depend on the weights), converted with the defaults; "
            f"rows of random token ids, one document per row (throughput does not depend on the tokens). "
            f"`subquadratic adapt`, {loss}, {how}, activation checkpointing (adapt's --gradient-checkpointing), "
            f"`--mixed-precision {scale.precision}`. Every GPU count adapts the same global batch of "
            f"{args.global_batch} rows per optimizer step: {args.global_batch} / n rows per GPU in micro-batches of "
            f"{args.micro_batch} (gradient accumulation). {args.warmup} warm-up steps, then {args.steps} timed "
            f"steps; tokens/s per GPU over the timed steps; scaling efficiency = n-GPU tokens/s per GPU over one "
            f"GPU's; peak memory = PyTorch's peak allocated memory on each GPU. NVLink multicast off "
            f"(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).")


def check_config(path: Path) -> None:
    """The FSDP configuration is what these runs claim: FSDP2, full sharding, and activation
    checkpointing left to adapt (both would recompute every layer twice)."""
    import yaml

    fsdp = yaml.safe_load(path.read_text()).get("fsdp_config", {})
    want = {"fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_activation_checkpointing": False}
    wrong = [f"{k} is {fsdp.get(k)!r}, not {v!r}" for k, v in want.items() if fsdp.get(k) != v]
    if wrong:
        raise SystemExit(f"{path}: {'; '.join(wrong)} (these runs are FSDP2 with full sharding, and adapt's "
                         "--gradient-checkpointing does the activation checkpointing)")


def gpu_name() -> str:
    """The GPUs' name from nvidia-smi (this process leaves CUDA uninitialised: no memory on GPU 0)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"
    return out[0].strip() if out else "unknown GPU"


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, Scale, bool]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for results.json, results.md and logs/")
    p.add_argument("--work", default=None, help="folder for the models, the data and the runs (reused when given "
                   "again; default: a temporary folder)")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), help=f"of {', '.join(FAMILIES)} (default all)")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="tokens per row of the throughput runs "
                   "(default 8192 32768)")
    p.add_argument("--gpus", nargs="+", type=int, default=None, help="GPU counts (default 1 2 4 8, those present)")
    p.add_argument("--global-batch", type=int, default=8, help="rows per optimizer step, for every GPU count "
                   "(default 8; divisible by every count times --micro-batch)")
    p.add_argument("--micro-batch", type=int, default=1, help="rows per GPU per forward (default 1)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (default 2, at least 1)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--loss", default="lm", choices=("lm", "kl"), help="adapt --loss (default lm)")
    p.add_argument("--measure", nargs="+", default=["throughput", "fit"], choices=("throughput", "fit"))
    p.add_argument("--max-len", type=int, default=None, help="longest row the fit search tries (default 262144)")
    p.add_argument("--fit-steps", type=int, default=2, help="steps of a fit run (default 2)")
    p.add_argument("--profile", nargs="?", const="missed", default=None, choices=("missed", "all"),
                   help="profile multi-GPU runs below 90%% efficiency (all: every multi-GPU run)")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps after the warm-up (default 3)")
    p.add_argument("--deadline", type=float, default=None, help="seconds after which no run starts; each run gets "
                   "only the time left")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take (default 1800)")
    p.add_argument("--redo", action="store_true", help="run again the selected runs that OUT/results.json holds")
    p.add_argument("--dry-run", action="store_true", help="tiny scale on a CPU, two gloo processes (no sharding)")
    args = p.parse_args(argv)
    cuda = not args.dry_run
    scale = DRY if args.dry_run else GPU
    args.families = [f for item in args.families for f in item.split(",") if f]
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown --families {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    args.lengths = args.lengths or list(scale.lengths)
    args.max_len = args.max_len or scale.max_len
    present = torch.cuda.device_count() if cuda else 2
    if args.gpus is None:
        args.gpus = [n for n in (1, 2, 4, 8) if n <= present]
    args.gpus = sorted(set(args.gpus))
    if cuda and present < 1:
        p.error("no GPU is visible; --dry-run checks the script on a CPU")
    if max(args.gpus) > present:
        p.error(f"--gpus {max(args.gpus)} asks for more GPUs than the {present} visible")
    for n in args.gpus:
        if args.global_batch % (n * args.micro_batch):
            p.error(f"--global-batch {args.global_batch} does not split into {n} GPU(s) x --micro-batch "
                    f"{args.micro_batch}; choose a multiple of {n * args.micro_batch}")
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1")
    if min(args.lengths) > args.max_len:
        p.error(f"--max-len {args.max_len} is below the shortest --lengths {min(args.lengths)}")
    if max(args.max_len, *args.lengths) > scale.max_positions:
        p.error(f"rows of more than {scale.max_positions} tokens exceed the model's positions")
    return args, scale, cuda


def main(argv: list[str] | None = None) -> None:
    args, scale, cuda = parse(argv)
    check_config(FSDP_CONFIG)
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    args.work = args.work or tempfile.mkdtemp(prefix="fsdp-scaling-")
    import accelerate

    results = {"device": gpu_name() if cuda else "cpu (dry run)", "gpus_visible": torch.cuda.device_count(),
               "date": time.strftime("%Y-%m-%d"),
               "versions": {**versions(torch.device("cpu")), "accelerate": accelerate.__version__}}
    results["versions"].pop("device", None)
    results["versions"].pop("date", None)
    previous = out / "results.json"
    if previous.exists():  # earlier calls into the same OUT: their rows stay
        results["rows"] = json.loads(previous.read_text()).get("rows", {})
    results["settings"] = {"model": scale.shape, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                           "warmup": args.warmup, "steps": args.steps, "loss": args.loss, "max_len": args.max_len,
                           "fit_steps": args.fit_steps, "profile_steps": args.profile_steps,
                           "precision": scale.precision, "config": str(FSDP_CONFIG.relative_to(ROOT)),
                           "description": describe(args, scale, cuda)}
    results["script_command"] = " ".join(["python", "scripts/studies/fsdp_scaling.py", *(argv if argv is not None
                                                                                  else sys.argv[1:])])
    folders = prepare(Path(args.work), scale, args.families)
    study = Study(args, scale, cuda, folders, results)
    study.save()
    if "throughput" in args.measure:
        study.run_throughput()
    if args.profile:
        study.run_profiles()
    if "fit" in args.measure:
        study.run_fits()
    study.save()
    log(f"wrote {out / 'results.md'}" + (f"; {len(study.pending)} runs left for a later call" if study.pending else ""))


if __name__ == "__main__":
    main()
