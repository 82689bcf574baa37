"""Where a call's time goes, from torch.profiler (shared by the benchmark scripts, run as modules,
`python -m scripts...`): the kernels and the ops / autograd Functions that launched them, by
device time, beside the wall time of the profiled calls, so a host-bound call (wall time well above
the device time) shows as such. On a machine without CUDA the rows are CPU times."""

from __future__ import annotations

import time

import torch

#: host-side events counted per call in the host listing: launches and the calls that wait on the device
HOST_COUNTED = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync",
                "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMalloc", "cudaFree")


def kernel_table(run, calls: int = 3, rows: int = 25, title: str = "", host: int = 0) -> tuple[str, float]:
    """Profile `calls` calls of the no-argument `run` (already warm). Returns (the table as text, device
    ms per call: the sum of the kernels' self times; on CPU the sum of the ops' self CPU times). With
    `host` > 0 a second listing follows: the launches and device waits per call (`HOST_COUNTED`), then
    the `host` Python functions and ops with the most CPU time per call (inclusive; Python functions
    recorded through the profiler's stack tracing): where a host-bound call spends its wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities, with_stack=host > 0) as prof:
        for _ in range(calls):
            run()
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls * 1e3
    events = prof.key_averages()
    if cuda:
        key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        on_device = lambda e: e.device_type != DeviceType.CPU  # noqa: E731  (ops and Functions: the CPU rows)
    else:
        key, on_device = "self_cpu_time_total", (lambda e: True)
    total = sum(getattr(e, key) for e in events if on_device(e)) / calls / 1e3
    lines = [f"{title}: {total:.3f} ms of {'GPU' if cuda else 'CPU'} time per call, {wall:.3f} ms wall per call "
             f"under the profiler ({calls} calls); by {'GPU' if cuda else 'CPU'} time:"]
    ordered = sorted((e for e in events if getattr(e, key) > 0), key=lambda e: -getattr(e, key))
    for e in ordered[:rows]:
        t = getattr(e, key) / calls / 1e3
        kind = "kernel" if cuda and on_device(e) else "op    "
        lines.append(f"  {t:9.3f} ms {100 * t / max(total, 1e-9):5.1f}%  x{e.count // calls:<5} {kind} {e.key[:110]}")
    if host:
        cpu = [e for e in events if e.device_type == DeviceType.CPU]
        counts = {n: 0 for n in HOST_COUNTED}
        for e in cpu:
            if e.key in counts:
                counts[e.key] += e.count
        lines.append("  host, per call: " + ", ".join(f"{n} x{c // calls}" for n, c in counts.items() if c))
        for e in sorted(cpu, key=lambda e: -e.cpu_time_total)[:host]:
            lines.append(f"  {e.cpu_time_total / calls / 1e3:9.3f} ms incl, {e.self_cpu_time_total / calls / 1e3:8.3f} "
                         f"ms self  x{e.count // calls:<5} host   {e.key[:110]}")
        if cuda:
            lines.extend(sync_sites(run))
    return "\n".join(lines), total


def sync_sites(run) -> list[str]:
    """The source lines of one call of `run` that wait on the device (torch's sync debug mode: a
    `.item()`, a boolean of a CUDA tensor, a copy to the host...), each with its count: the waits that
    stop the host from running ahead of the kernels."""
    import collections
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    if not sites:
        return ["  host waits on the device: none"]
    return [f"  host waits on the device: {sum(sites.values())} in one call"] + [
        f"    x{n:<4} {where}" for where, n in sites.most_common(20)]


def python_table(run, calls: int = 5, rows: int = 40, title: str = "") -> str:
    """The Python functions where `calls` calls of the no-argument `run` (already warm) spend their host
    time, from cProfile: first the host time per call without the profiler (the calls back to back,
    one synchronisation after them: on a host-bound call, the wall time), then the `rows` functions with
    the most self time per call (and their inclusive time, calls per call, file:line)."""
    import cProfile
    import pstats

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        run()
    host = (time.perf_counter() - t0) / calls * 1e3
    if cuda:
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        run()
    prof.disable()
    if cuda:
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    lines = [f"{title}: {host:.3f} ms of host time per call to enqueue, {wall:.3f} ms to finish ({calls} calls); "
             f"Python functions by self time per call (cProfile):"]
    for (path, line, fn), (_, ncalls, tt, ct, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:rows]:
        where = fn if path == "~" else f"{'/'.join(path.split('/')[-3:])}:{line} {fn}"
        lines.append(f"  {tt / calls * 1e3:8.3f} ms self {ct / calls * 1e3:8.3f} ms incl  x{ncalls // calls:<5} "
                     f"{where[:120]}")
    return "\n".join(lines)


def idle_gaps(run, rows: int = 30, title: str = "") -> str:
    """Where the GPU waits in one call of the no-argument `run` (already warm): each GPU event (kernel,
    copy, memset) that starts after the previous one ended, the gap before it charged to the outermost
    CPU op around the launch that queued it (on a host-bound call: the host work that made the GPU
    wait), split into the forward and the backward (the backward starting at autograd's first
    `evaluate_function`). The profiler's own host cost makes every gap larger than without it: the
    shares, not the sizes, compare. On a machine without CUDA: a line saying there is nothing to show."""
    import bisect
    import collections
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return f"{title}: no GPU, no idle gaps to show"
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    finally:
        os.unlink(path)
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not gpu:
        return f"{title}: no GPU events recorded"
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e["tid"]].append(e)
    starts = {}
    for tid, lst in ops.items():
        lst.sort(key=lambda e: e["ts"])
        starts[tid] = [e["ts"] for e in lst]

    def outermost(launch) -> str:
        lst, st = ops.get(launch["tid"], []), starts.get(launch["tid"], [])
        i = bisect.bisect_right(st, launch["ts"])
        around = [e for e in lst[max(0, i - 500):i] if e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]]
        return max(around, key=lambda e: e["dur"])["name"][:100] if around else "(launched outside any op)"

    backward = min((e["ts"] for e in events if e.get("cat") == "cpu_op"
                    and e["name"].startswith("autograd::engine::evaluate_function")), default=None)
    charged, count = collections.Counter(), collections.Counter()
    idle = {"forward": 0.0, "backward": 0.0}
    busy, end = 0.0, None
    for g in gpu:
        busy += g["dur"]
        if end is not None and g["ts"] > end:
            launch = launches.get(g["args"].get("correlation"))
            name = outermost(launch) if launch else g["name"][:100]
            charged[name] += g["ts"] - end
            count[name] += 1
            late = backward is not None and launch is not None and launch["ts"] >= backward
            idle["backward" if late else "forward"] += g["ts"] - end
        end = max(end or 0.0, g["ts"] + g["dur"])
    span = end - gpu[0]["ts"]
    lines = [f"{title}: GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {idle['forward'] / 1e3:.1f} ms "
             f"in the forward and {idle['backward'] / 1e3:.1f} ms in the backward (under the profiler); the gaps by "
             f"the op that launched the kernel after them:"]
    for name, t in charged.most_common(rows):
        lines.append(f"  {t / 1e3:9.2f} ms idle  x{count[name]:<5} before {name}")
    return "\n".join(lines)
