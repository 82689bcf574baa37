"""Shared pieces of the whole-model benchmarks and studies (run as modules, `python -m scripts...`): the
Llama-3.2-1B shapes, a dense Llama with random weights built on a device, the converted checkpoints
loaded back, and synchronised wall-clock timing. No network and no downloads: the weights are random
(speed does not depend on them), built with Transformers' own classes."""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from pathlib import Path

import torch

#: Llama-3.2-1B shapes (its rope scaling left out: plain RoPE, theta 500000, long enough positions).
LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
)
#: --quick runs: six layers so that SSE-H keeps one softmax layer (every sixth).
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=True,
)
PAD = 0

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(fn, device: torch.device) -> tuple[float, object]:
    """(seconds, result) of fn(), synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    res = fn()
    sync(device)
    return time.perf_counter() - t0, res


def dense_model(shape: dict, max_positions: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A Llama with random weights (Transformers' own initialisation), built on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, max_position_embeddings=max_positions, rope_theta=500000.0, pad_token_id=PAD,
                      bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).eval()
    assert model.config._attn_implementation == "sdpa"
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def dense_and_conversions(work: Path, shape: dict, max_positions: int, device: torch.device, dtype: torch.dtype,
                          families, options: dict | None = None, source: Path | None = None):
    """The dense model of `shape` (random weights, `dense_model`) saved to work / "dense", or the
    checkpoint folder `source` (a real model) as it is, converted by the package's converter to
    work / <family> for each of `families` (options[family]: its conversion options, default none).
    Returns the dense model, on `device` in `dtype`."""
    from subquadratic.conversion import convert

    log("building the dense model and converting it")
    if source is None:
        dense = dense_model(shape, max_positions, device, dtype)
        dense.save_pretrained(work / "dense")
        source = work / "dense"
    else:
        dense = load_converted(source, device, dtype)
    for fam in families:
        base, extra = CONVERSIONS.get(fam, (fam, {}))
        convert(str(source), str(work / fam), base, options={**(options or {}).get(base, {}), **extra},
                progress=False)
    return dense


#: benchmark rows converted otherwise than a `convert --to` target with its defaults: row -> (target,
#: options over the defaults). "spla-adapted" is the SPLA conversion changed after loading
#: (`as_variant`): gamma = 0.1 in every layer, as after adaptation (a fresh conversion has gamma = 0,
#: whose residual term adds exactly nothing and is skipped at inference); the */no-window rows are the
#: SSE-H / HLA-H presets without their window branch (the default before 2026-12-01); "sse-h-own-qkv" is
#: SSE-H as converted before 2026-12-04: its SSE layers' k / v at the query heads (`--sse-kv-heads query`)
#: and the window branch's own q / k / v (`--sse-window-qkv own`); "sse-h-kv-source" the source's K/V heads
#: with the window's own q / k / v; "sse-kv-source" pure SSE with the source's K/V heads (`--sse-kv-heads source`)
CONVERSIONS = {"spla-adapted": ("spla", {}), "sse-h-no-window": ("sse-h", {"sse_sliding_window": 0}),
               "hla-h-no-window": ("hla-h", {"hla_sliding_window": 0}),
               "sse-h-own-qkv": ("sse-h", {"sse_kv_heads": "query", "sse_window_qkv": "own"}),
               "sse-h-kv-source": ("sse-h", {"sse_window_qkv": "own"}),
               "sse-kv-source": ("sse", {"sse_kv_heads": "source"})}
#: the family whose targets (BENCHMARKS.md) a benchmark row is held to: a variant's, a hybrid's family
TARGET_FAMILY = {"spla-adapted": "spla", "sse-h-no-window": "sse-h", "hla-h": "hla", "hla-h-no-window": "hla",
                 "sse-h-own-qkv": "sse-h", "sse-h-kv-source": "sse-h", "sse-kv-source": "sse"}


def as_variant(model, name: str):
    """`model` changed in place into the benchmark row `name` ("spla-adapted"; any other unchanged)."""
    if name == "spla-adapted":
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("rla_norm.weight"):
                    p.fill_(0.1)
    return model


def load_converted(folder: Path, device: torch.device, dtype: torch.dtype):
    """A (converted) checkpoint loaded as a user would, on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    import subquadratic  # noqa: F401  (registers the model types)

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return as_variant(model, folder.name)


def host_info() -> dict:
    """The host a run's calls are enqueued from: its CPU model, the CPUs this process may run on and the load
    average at the start (a slow host makes a host-bound call slow)."""
    model = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return dict(cpu=model, cpus=cpus, loadavg=load)


def versions(device: torch.device) -> dict:
    """Date, device and library versions of a run (and the commit when run inside a git checkout)."""
    import datetime
    import subprocess

    import transformers

    out = dict(date=datetime.date.today().isoformat(), torch=torch.__version__, transformers=transformers.__version__,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", host=host_info())
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    if os.environ.get("BENCH_COMMIT"):  # a copy of the tree whose git metadata is not the tree's own
        out["commit"] = os.environ["BENCH_COMMIT"]
        return out
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["commit"] = None
    return out
