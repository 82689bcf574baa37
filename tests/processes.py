"""Child processes of the tests: each runs from an environment without the variables of a
distributed launch (a stale MASTER_PORT or RANK would send it to another run's rendezvous), in its
own session, under a deadline; a child that does not finish in time is stopped (SIGTERM, which
torchrun passes on to its workers, then SIGKILL) and fails the test with the end of its stderr."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence

import pytest

#: what torchrun, accelerate launch or a previous test may have left in os.environ
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "NODE_RANK")
LAUNCH_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_", "FSDP_")


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any distributed launch's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith(LAUNCH_PREFIXES)}
    return {**env, **extra}


def _stop(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(cmd: Sequence[str], *, timeout: float, env: dict[str, str] | None = None,
        cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` to its end, or fail the test once `timeout` seconds have passed."""
    cmd = [str(c) for c in cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env() if env is None else env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        out, err = proc.communicate()
        pytest.fail(f"`{' '.join(cmd[:8])} ...` did not finish within {timeout:.0f} s and was stopped; "
                    f"its stderr ends with:\n{err[-3000:]}", pytrace=False)
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): leave nothing behind
            _stop(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_script(module: str, *args, timeout: float = 900, **extra_env: str) -> subprocess.CompletedProcess:
    """`python -m <module> args...` (a script such as scripts.benchmarks.kernels.bench_host) from the
    repository root with the package on PYTHONPATH (and `extra_env`), under `run_child`'s deadline."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return run_child([sys.executable, "-m", module, *args], timeout=timeout,
                     env=clean_env(PYTHONPATH=path, **extra_env), cwd=str(root))
