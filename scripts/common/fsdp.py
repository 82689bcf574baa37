"""Shared pieces of the FSDP studies (`scripts.studies.fsdp_*`, run as modules): the `accelerate launch`
line that runs `subquadratic adapt` on N processes with configs/accelerate/fsdp.yaml, the environment of
every child (NVLink multicast off), a child run that may run out of memory or time without taking its
caller down, the child's adapt_log.jsonl, tokens/s past the warm-up steps, and the communication /
compute split of profiled intervals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FSDP_CONFIG = ROOT / "configs" / "accelerate" / "fsdp.yaml"
#: NVLink multicast stays off (the GPU host's rule for NCCL), in every child
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: what a child that ran out of GPU memory prints (PyTorch's allocator, cuBLAS, NCCL, Triton launches);
#: Triton's "out of resource: shared memory" is a kernel configuration problem, not this
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|"
                 r"NCCL.*[Oo]ut of memory|cudaErrorMemoryAllocation")


def child_env(cuda: bool) -> dict[str, str]:
    """The variables every adaptation child gets on top of the caller's environment: this checkout
    first on PYTHONPATH, NVLink multicast off, and on CPU the gloo processes accelerate runs when
    ACCELERATE_USE_CPU is set (one thread each)."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TOKENIZERS_PARALLELISM": "false", **NCCL_ENV}
    if not cuda:
        env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    return env


def accelerate_launch(processes: int, config: Path = FSDP_CONFIG) -> list[str]:
    """`accelerate launch --config_file CONFIG --num_processes N` (through this Python). With the FSDP
    configuration it starts N processes through torchrun, on GPUs sharded, on CPU (ACCELERATE_USE_CPU=1)
    data-parallel over gloo: accelerate shards only on GPUs."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            "--num_processes", str(processes)]


def shell_line(cmd: list[str], env: dict[str, str]) -> str:
    """The command as one shell line, with the variables it sets on top of the caller's environment
    (PYTHONPATH left out: it only puts this checkout first)."""
    import shlex

    return shlex.join([f"{k}={v}" for k, v in env.items() if k != "PYTHONPATH"] + cmd)


@dataclass
class ChildRun:
    """How a child ended: `ok`, `oom` (out of GPU memory), `timeout` or `failed`; its wall seconds and
    the tail of its output (stdout and stderr, in `log_file`)."""

    status: str
    seconds: float
    tail: str
    returncode: int | None


def run_child(cmd: list[str], env: dict[str, str], log_file: Path, timeout: float | None = None) -> ChildRun:
    """Run `cmd` with `env` added to the environment, its output going to `log_file`, in a process
    group of its own, so that a timeout ends every process it started (torchrun's workers too)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with log_file.open("w") as f:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _end_group(proc)
            rc = proc.returncode
    seconds = round(time.perf_counter() - started, 1)
    text = log_file.read_text(errors="replace")
    tail = text[-4000:]
    if timed_out:
        return ChildRun("timeout", seconds, tail, rc)
    if rc == 0:
        return ChildRun("ok", seconds, tail, rc)
    return ChildRun("oom" if OOM.search(text) else "failed", seconds, tail, rc)


def _end_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_log(folder: Path) -> list[dict]:
    """The entries of `folder`/adapt_log.jsonl (one per optimizer step)."""
    return [json.loads(line) for line in (folder / "adapt_log.jsonl").read_text().splitlines()]


def throughput(entries: list[dict], gpus: int, warmup: int) -> float:
    """Tokens/s per GPU over the steps after the first `warmup` (compilation, autotuning, the allocator
    and caches warming up), from the cumulative tokens and seconds adapt logs after every step."""
    if not 0 <= warmup < len(entries):
        raise ValueError(f"{len(entries)} logged steps leave none to time after {warmup} warm-up steps")
    first = entries[warmup - 1] if warmup else {"tokens": 0, "seconds": 0.0}
    last = entries[-1]
    return (last["tokens"] - first["tokens"]) / (last["seconds"] - first["seconds"]) / gpus


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted unions of disjoint intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_compute_split(comm: list[tuple[float, float]], compute: list[tuple[float, float]], wall: float) -> dict:
    """Seconds of `wall` during which communication runs (the union of its intervals), compute runs,
    both at once, communication alone (exposed: nothing hides it) and neither (idle: the host, or a
    wait). Intervals are (start, end) in seconds on one clock."""
    c, k = _union(comm), _union(compute)
    both = _intersection(c, k)
    busy = _length(_union(c + k))
    return {"wall_s": wall, "comm_s": _length(c), "compute_s": _length(k), "overlap_s": both,
            "exposed_comm_s": _length(c) - both, "idle_s": max(0.0, wall - busy)}
