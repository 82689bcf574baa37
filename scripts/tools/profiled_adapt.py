"""`python -m subquadratic` with torch.profiler around a few optimizer steps of the first process, for
`scripts/studies/fsdp_scaling.py --profile` (run as the script `accelerate launch` starts, with the arguments
of `subquadratic adapt`).

The steps are counted by a hook after every optimizer step: the profiler starts after step
$PROFILE_AFTER and stops after $PROFILE_STEPS more, synchronised with the GPU at both ends. On GPUs
it records the kernels only: communication is the time NCCL kernels run and compute the time every
other kernel runs (their intervals on one clock, so overlap is measured, not assumed). On CPU
processes (gloo, no kernels) it records the operators: communication is the time of the collective
calls and compute that of every other operator, a check of the code path, not a measurement. The
split (`common.fsdp.comm_compute_split`), the kernels that took longest and the wall seconds go to
$PROFILE_OUT as JSON."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from scripts.common.fsdp import comm_compute_split

#: collectives: NCCL kernels on GPUs, gloo / c10d calls on CPU
COMM = re.compile(r"nccl|gloo|c10d::|record_param_comms", re.IGNORECASE)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def summarise(prof, wall: float, steps: int) -> dict:
    """The communication / compute split of a finished profile of `steps` optimizer steps."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    if torch.cuda.is_available():
        source = "CUDA kernels"
        timed = [e for e in events if e.device_type == DeviceType.CUDA]
        if not timed:
            raise RuntimeError(f"the profile of {steps} steps holds no CUDA kernel; is CUPTI available?")
    else:
        source = "CPU operators (no kernels: a CPU run)"
        timed = [e for e in events if e.device_type == DeviceType.CPU and
                 (COMM.search(e.name) or e.name.startswith("aten::"))]
    comm = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in timed if COMM.search(e.name)]
    compute = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in timed if not COMM.search(e.name)]
    split = comm_compute_split(comm, compute, wall)
    totals: dict[str, float] = {}
    for e in timed:
        totals[e.name] = totals.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e6
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:15]
    return {"steps": steps, "source": source, "events": len(timed), **split,
            "per_step": {k: v / steps for k, v in split.items()},
            "top": [{"name": n[:160], "seconds": s, "comm": bool(COMM.search(n))} for n, s in top]}


def install(after: int, steps: int, out: Path) -> None:
    # on GPUs the kernels alone: a billion-parameter step records too many CPU operators to parse quickly
    activities = [torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else
                  torch.profiler.ProfilerActivity.CPU]
    state = {"count": 0, "prof": None, "t0": 0.0}

    def hook(optimizer, args, kwargs) -> None:
        state["count"] += 1
        if state["count"] == after:
            _sync()
            state["prof"] = torch.profiler.profile(activities=activities)
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        elif state["count"] == after + steps and state["prof"] is not None:
            _sync()
            wall = time.perf_counter() - state["t0"]
            state["prof"].__exit__(None, None, None)
            out.write_text(json.dumps(summarise(state["prof"], wall, steps), indent=1))
            state["prof"] = None

    register_optimizer_step_post_hook(hook)


if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) == 0:
        install(int(os.environ["PROFILE_AFTER"]), int(os.environ["PROFILE_STEPS"]), Path(os.environ["PROFILE_OUT"]))
    from subquadratic.cli import main

    raise SystemExit(main())
