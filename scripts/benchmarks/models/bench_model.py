"""Whole-model speed where a user waits (BENCHMARKS.md M1, M2): time to first token and a training step
of a 1B-class Llama with random bf16 weights (Llama-3.2-1B shapes) against its SPLA, SSE-H, HLA-H and HLA
conversions made by the package's converter with the defaults, every row a ratio to the dense model
measured in the same run, with the peak GPU memory of each call. `spla` is the fresh conversion
(gamma = 0: exactly sparse attention, and inference skips the residual term, which adds nothing);
`spla-adapted` the same checkpoint with gamma = 0.1 in every layer, as after adaptation, which
computes it.

  python -m scripts.benchmarks.models.bench_model [--lengths 4096,16384,32768,131072] [--train-lengths 8192,32768]
                                [--families spla,spla-adapted,sse-h,hla-h,hla] [--repeats 3] [--out r.json]
  python -m scripts.benchmarks.models.bench_model --quick    # tiny model on CPU (PyTorch forms): a smoke run
  python -m scripts.benchmarks.models.bench_model --checkpoint DIR --text python   # a real model on real text
      (Python sources)
  python -m scripts.benchmarks.models.bench_model --lengths 16384 --train-lengths 8192 --profile 16384,8192
      --profile-out prof.txt

Measures, each warm (one untimed call of the same shape first, so kernels are compiled and autotuned):
  ttft:  one `model(ids, use_cache=True, logits_to_keep=1)` call on B x T random token ids, no gradients:
         what a user waits for before the first generated token (the prompt's prefill in one call);
  train: one training step's forward and backward, `model(ids, labels=ids).loss.backward()`, with the
         weights in the run's dtype and gradients for every parameter (no optimizer step).
The time of a call is the median of --repeats synchronised wall-clock runs; the ratio is dense time over
ours (above 1: ours is faster). A first token's row also gives the host time: the median time the
call took to return before its synchronisation, what the host spends enqueueing it (near the wall
time: the host bounds the call; well below it: the GPU does). Peak memory is
torch.cuda.max_memory_allocated over the timed runs. Each row also keeps (in the JSON, and in the log)
the caching allocator's device allocations, frees and retries during the timed runs (cudaMalloc /
cudaFree inside a call: host time that is not enqueueing), the time Python's garbage collector ran in
them, the synchronising operations of one more call (`torch.cuda.set_sync_debug_mode`) and a probe of
the host's speed just before the timed calls (`host_probe`: a fixed piece of host work, microseconds). A
call that fails (out of memory, say) is recorded with its error and the run goes on. The table is
printed at the end as Markdown and, with --out, written as JSON after every row. `--profile T[,T..]`
adds, for each model and each measure at those lengths, a torch.profiler table of one warm call (the
kernels by device time beside the call's wall time: `common.profile.kernel_table`), to --profile-out (else
stderr). `--split-train` also times each training step cut in two by a synchronisation after the
forward: each half's host time (to return) and wall time, a second table (`split_train`).
`--checkpointing` runs the training steps of every model (dense too) with non-reentrant gradient
checkpointing on each decoder layer (`subquadratic.adaptation.train.enable_checkpointing`, what `adapt
--gradient-checkpointing` does): each layer's forward recomputed in the backward, what lets a long row's
step fit a smaller GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from scripts.common.models import (
    LLAMA_1B,
    TARGET_FAMILY,
    TINY,
    dense_and_conversions,
    free,
    load_converted,
    log,
    sync,
    versions,
)
from scripts.common.profile import idle_gaps, kernel_table, python_table
from subquadratic.adaptation.train import enable_checkpointing

TARGETS = {  # (measure, family) -> {length: target ratio}, from BENCHMARKS.md M1 / M2 (variants: their family's)
    ("ttft", "spla"): {16384: 1.0, 32768: 1.3, 131072: 2.5},
    ("ttft", "sse-h"): {4096: 1.0, 32768: 1.5, 131072: 2.0},
    ("ttft", "hla"): {4096: 1.0, 131072: 4.0},
    ("train", "spla"): {8192: 1.0, 32768: 1.3},
    ("train", "sse-h"): {8192: 1.0},
    ("train", "hla"): {8192: 1.0},
}


def ttft_call(model, ids: torch.Tensor):
    def run():
        with torch.no_grad():
            return model(ids, use_cache=True, logits_to_keep=1).logits
    return run


def train_call(model, ids: torch.Tensor):
    def run():
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return float(loss.detach())
    return run


#: The caching allocator's counters `measure` reports over its timed calls: a device allocation or free
#: inside a timed call (cudaMalloc / cudaFree, the latter synchronising the device) or an allocation
#: retried after freeing the cache shows in the host time of a call that should only enqueue work.
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_counts(device: torch.device) -> dict:
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    return {k: stats.get(k, 0) for k in ALLOCATOR_COUNTERS}


def synchronising_ops(fn, device: torch.device) -> int | None:
    """The synchronising CUDA operations one call of fn makes (`torch.cuda.set_sync_debug_mode`'s warnings:
    a device-to-host copy, an item(), a blocking copy...), None off CUDA."""
    if device.type != "cuda":
        return None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    return sum("synchroniz" in str(w.message) for w in caught)


class GCTime:
    """The time Python's garbage collector ran (ms) and its collections while in the `with` block."""

    def __enter__(self):
        self.ms, self.collections, self._t0 = 0.0, 0, None
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.ms += 1e3 * (time.perf_counter() - self._t0)
            self.collections += 1


def host_probe(device: torch.device, calls: int = 2000) -> float:
    """Microseconds per step of a fixed piece of host work (an allocation on the device, a view, a Python
    call), the median of five rounds, measured before each row's timed calls: the host's speed at that
    moment. Beside it a row's host time reads as the code's cost (the probe as fast as elsewhere) or the
    host's (the probe slow too)."""
    def step(x):
        return x.view(-1)

    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            step(torch.empty(256, device=device))
        rounds.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(rounds) / calls


def measure(fn, device: torch.device, repeats: int) -> dict:
    """Median seconds of `repeats` timed calls after one untimed call, the median seconds each took to
    return before its synchronisation (`host_s`: the time the host takes to enqueue a call that does
    not wait on the device, a first token's; a training step's waits for its loss), the peak memory
    of the timed calls, the allocator's counters over them (`allocator`: `ALLOCATOR_COUNTERS`, their
    increase), the garbage collector's time and collections during them (`gc`) and the synchronising
    operations of one more call (`syncs`), and `host_probe`'s microseconds just before the timed calls
    (`probe_us`)."""
    fn()
    probe = host_probe(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = allocator_counts(device)
    times, host = [], []
    with GCTime() as collector:
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            sync(device)
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    after = allocator_counts(device)
    return dict(s=statistics.median(times), runs=times, host_s=statistics.median(host), host_runs=host,
                peak_bytes=peak, allocator={k: after[k] - before[k] for k in ALLOCATOR_COUNTERS},
                gc=dict(ms=collector.ms, collections=collector.collections), syncs=synchronising_ops(fn, device),
                probe_us=probe)


def split_train(model, ids: torch.Tensor, device: torch.device, repeats: int) -> dict:
    """A training step cut in two by a synchronisation after the forward (after one untimed step): the
    medians (ms) of the time the forward and the backward each take to return (host) and of their time to
    the synchronisation after them (wall). Host near wall: the host bounds that half; well below: the GPU."""
    times = []
    for i in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        loss = model(ids, labels=ids, use_cache=False).loss
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        sync(device)
        t4 = time.perf_counter()
        for p in model.parameters():
            p.grad = None
        if i:
            times.append((t1 - t0, t2 - t0, t3 - t2, t4 - t2))
    names = ("forward_host_ms", "forward_wall_ms", "backward_host_ms", "backward_wall_ms")
    return {n: 1e3 * statistics.median(col) for n, col in zip(names, zip(*times, strict=True), strict=True)}


def run_model(name: str, model, measures: dict, prompts: dict, device, repeats: int, results: dict, emit,
              profile: tuple = (), report=None, host: int = 0, python: int = 0, gaps: int = 0,
              split: bool = False) -> None:
    """Every (measure, length) of `measures` on one model, into results[name, measure, length]; at the
    lengths of `profile`, a profiler table of one more call (and with `gaps`, its GPU idle gaps by the
    op launching after them: `common.profile.idle_gaps`), given to `report`; with `split`, each training step
    also cut in two (`split_train`)."""
    for what, lengths in measures.items():
        if what == "train":
            model.train()
        for T in lengths:
            log(f"{name}: {what} at {T} tokens")
            fn = (train_call if what == "train" else ttft_call)(model, prompts[T])
            try:
                res = measure(fn, device, repeats)
                if split and what == "train":
                    res["split"] = split_train(model, prompts[T], device, repeats)
                if T in profile:
                    table, busy = kernel_table(fn, calls=1, rows=30, title=f"{name} {what} T={T}", host=host)
                    res["profiled_device_ms"] = busy
                    report(table)
                    if python:
                        report(python_table(fn, calls=3, rows=python, title=f"{name} {what} T={T}"))
                    if gaps:
                        report(idle_gaps(fn, rows=gaps, title=f"{name} {what} T={T}"))
            except Exception as e:  # noqa: BLE001 (out of memory, say: record it and go on)
                log(f"  failed:\n{traceback.format_exc()}")
                res = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            finally:
                for p in model.parameters():
                    p.grad = None
                free(device)
            results[name, what, T] = res
            if "s" in res:
                log(f"  {res['s'] * 1000:.1f} ms (host {res['host_s'] * 1000:.1f}), peak "
                    f"{fmt_bytes(res['peak_bytes'])}, allocator {res['allocator']}, gc {res['gc']}, "
                    f"synchronising ops {res['syncs']}, host probe {res['probe_us']:.2f} us")
            emit()
        model.eval()


def fmt_ms(ms) -> str:
    return "-" if ms is None else f"{ms:.1f}"


def fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def rows_of(results: dict, families: list[str], measures: dict, checkpointing: bool = False) -> list[dict]:
    rows = []
    for what, lengths in measures.items():
        for T in lengths:
            dense = results.get(("dense", what, T), {})
            for fam in families:
                ours = results.get((fam, what, T))
                if ours is None:
                    continue
                ratio = dense["s"] / ours["s"] if "s" in dense and "s" in ours else math.nan
                target = TARGETS.get((what, TARGET_FAMILY.get(fam, fam)), {}).get(T)  # a variant: its family's
                rows.append(dict(id="M1" if what == "ttft" else "M2", measure=what, T=T, family=fam,
                                 dense_ms=dense.get("s", math.nan) * 1000, ours_ms=ours.get("s", math.nan) * 1000,
                                 ratio=ratio, target=target, met=None if target is None else ratio >= target,
                                 checkpointing=checkpointing and what == "train",
                                 dense_peak=dense.get("peak_bytes"), ours_peak=ours.get("peak_bytes"),
                                 **{f"{who}_host_ms": r["host_s"] * 1000 if what == "ttft" and "host_s" in r else None
                                    for who, r in (("dense", dense), ("ours", ours))},
                                 **{f"{who}_{k}": r.get(k) for who, r in (("dense", dense), ("ours", ours))
                                    for k in ("split", "allocator", "gc", "syncs", "probe_us")},
                                 error=ours.get("error") or dense.get("error")))
    return rows


def markdown(rows: list[dict], batch: int) -> str:
    lines = [f"| id | measure (B{batch}) | T | family | dense ms | ours ms | ratio | target | peak GiB dense / ours "
             "| host ms dense / ours |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        target = "" if r["target"] is None else f">= {r['target']}x ({'met' if r['met'] else 'missed'})"
        what = {"ttft": "time to first token", "train": "training step"}[r["measure"]]
        what += " (checkpointed)" if r.get("checkpointing") else ""
        if r["error"]:
            target = f"{target} error: {r['error']}".strip()
        lines.append(f"| {r['id']} | {what} | {r['T']} | {r['family']} | {r['dense_ms']:.1f} | {r['ours_ms']:.1f} | "
                     f"{r['ratio']:.2f}x | {target} | {fmt_bytes(r['dense_peak'])} / {fmt_bytes(r['ours_peak'])} | "
                     f"{fmt_ms(r['dense_host_ms'])} / {fmt_ms(r['ours_host_ms'])} |")
    return "\n".join(lines)


def split_markdown(rows: list[dict]) -> str:
    """The training rows' halves (`split_train`), dense's once per length, as a Markdown table ("" without)."""
    lines, seen = [], set()
    for r in rows:
        for fam, half in (("dense", r.get("dense_split")), (r["family"], r.get("ours_split"))):
            if half and (fam, r["T"]) not in seen:
                seen.add((fam, r["T"]))
                lines.append(f"| {r['T']} | {fam} | {half['forward_host_ms']:.1f} / {half['forward_wall_ms']:.1f} | "
                             f"{half['backward_host_ms']:.1f} / {half['backward_wall_ms']:.1f} |")
    if not lines:
        return ""
    return "\n".join(["| T | model | forward host / wall ms | backward host / wall ms |", "| --- | --- | --- | --- |",
                      *lines])


def text_ids(checkpoint: str, text: str, n: int) -> torch.Tensor:
    """The first n token ids [n] of real text, tokenised by the checkpoint's tokenizer as adaptation and
    evaluation tokenise documents (`subquadratic.data.tokenize`): the *.py files of the folder `text`
    (or, for "python", of the installed torch package), sorted by path, one document each, concatenated
    (repeated from the start if they hold fewer than n tokens)."""
    from transformers import AutoTokenizer

    from subquadratic.data import tokenize

    root = Path(torch.__file__).parent if text == "python" else Path(text)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    ids: list[int] = []
    for f in sorted(root.rglob("*.py")):
        ids += tokenize([f.read_text(errors="replace")], tok)[0]
        if len(ids) >= n:
            break
    if not ids:
        raise SystemExit(f"no *.py text under {root}")
    while len(ids) < n:
        ids += ids
    return torch.tensor(ids[:n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default=None, help="comma list of prompt lengths for time to first token "
                                                    "(default 4096,16384,32768,131072)")
    ap.add_argument("--train-lengths", default=None, help="comma list of row lengths of the training step "
                                                          "(default 8192,32768; empty: none)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--families", default="spla,spla-adapted,sse-h,hla-h,hla",
                    help="conversions to measure beside the dense model: convert targets (spla, sse, sse-h, hla, "
                         "hla-h) or spla-adapted (SPLA with gamma = 0.1, as after adaptation: its residual term is "
                         "computed), sse-h-no-window, hla-h-no-window (the presets without their window branch), "
                         "sse-h-own-qkv (SSE-H with --sse-kv-heads query --sse-window-qkv own, the conversion "
                         "before 2026-12-04), sse-h-kv-source (with --sse-window-qkv own)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per measure (median)")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU, short lengths (smoke run)")
    ap.add_argument("--checkpoint", default=None,
                    help="a dense checkpoint folder (a real model) to measure instead of the random 1B Llama")
    ap.add_argument("--text", default=None,
                    help="prompts from real text instead of random ids: a folder (its *.py files, sorted, "
                         "concatenated) or 'python' (the installed torch package's sources); needs --checkpoint "
                         "(its tokenizer)")
    ap.add_argument("--profile", default="", help="comma list of lengths whose calls are also profiled")
    ap.add_argument("--profile-host", type=int, default=0,
                    help="with --profile, also list this many host functions / ops by CPU time, the launches "
                         "and the source lines that wait on the device")
    ap.add_argument("--profile-python", type=int, default=0,
                    help="with --profile, also list this many Python functions by host time per call (cProfile)")
    ap.add_argument("--profile-gaps", type=int, default=0,
                    help="with --profile, also list this many ops by the GPU idle time before the kernels they "
                         "launched (where a host-bound call makes the GPU wait, forward and backward apart)")
    ap.add_argument("--profile-out", default=None, help="append the profiler tables here (default: stderr)")
    ap.add_argument("--split-train", action="store_true",
                    help="also time each training step cut in two by a synchronisation after the forward: each "
                         "half's host time (to return) and wall time, where a host-bound step waits")
    ap.add_argument("--checkpointing", action="store_true",
                    help="training steps with gradient checkpointing on every decoder layer, dense and ours (what "
                         "adapt --gradient-checkpointing does): long rows on a smaller GPU")
    args = ap.parse_args()
    profile = tuple(int(x) for x in args.profile.split(",") if x)

    def report(table: str) -> None:
        if args.profile_out:
            with open(args.profile_out, "a") as f:
                f.write(table + "\n\n")
        else:
            log("\n" + table)

    if args.quick:
        device, dtype, shape = torch.device("cpu"), torch.float32, TINY
        lengths, train_lengths = [128, 320], [128]
        options = {"spla": dict(block_size=16, top_k_blocks=4)}  # a budget below the lengths: selection at work
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_model.py needs a CUDA GPU; use --quick for a CPU smoke run")
        device, dtype, shape = torch.device("cuda"), torch.bfloat16, LLAMA_1B
        lengths, train_lengths = [4096, 16384, 32768, 131072], [8192, 32768]
        options = {}  # the defaults of every family
    lengths = [int(x) for x in args.lengths.split(",") if x] if args.lengths is not None else lengths
    if args.train_lengths is not None:
        train_lengths = [int(x) for x in args.train_lengths.split(",") if x]
    families = [f for f in args.families.split(",") if f]
    measures = {k: v for k, v in (("ttft", lengths), ("train", train_lengths)) if v}
    max_pos = -(-max([*lengths, *train_lengths, 1024]) // 1024) * 1024
    meta = dict(versions(device), batch=args.batch, dtype=str(dtype), model=shape, families=families,
                lengths=lengths, train_lengths=train_lengths, repeats=args.repeats, quick=args.quick,
                options=options, checkpointing=args.checkpointing)
    if args.text and not args.checkpoint:
        raise SystemExit("--text needs --checkpoint (its tokenizer)")
    if args.checkpoint:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(args.checkpoint)
        shape = dict(model=args.checkpoint, vocab_size=cfg.vocab_size, num_hidden_layers=cfg.num_hidden_layers,
                     hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                     num_key_value_heads=cfg.num_key_value_heads)
        meta.update(model=shape, text=args.text)
    print(json.dumps(meta), flush=True)
    all_lengths = sorted({*lengths, *train_lengths})
    if args.text:
        ids = text_ids(args.checkpoint, args.text, args.batch * max(all_lengths))
        prompts = {T: ids[: args.batch * T].view(args.batch, T).to(device) for T in all_lengths}
    else:
        g = torch.Generator().manual_seed(1)
        prompts = {T: torch.randint(1, shape["vocab_size"], (args.batch, T), generator=g).to(device)
                   for T in all_lengths}
    results: dict = {}

    def emit() -> None:
        if args.out:
            rows = rows_of(results, families, measures, args.checkpointing)
            Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2, default=str) + "\n")

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        dense = dense_and_conversions(work, shape, max_pos, device, dtype, families, options,
                                      source=Path(args.checkpoint) if args.checkpoint else None)
        if args.checkpointing:
            enable_checkpointing(dense)
        run_model("dense", dense, measures, prompts, device, args.repeats, results, emit, profile, report,
                  args.profile_host, args.profile_python, args.profile_gaps, args.split_train)
        del dense
        free(device)
        for fam in families:
            model = load_converted(work / fam, device, dtype)
            if args.checkpointing:
                enable_checkpointing(model)
            run_model(fam, model, measures, prompts, device, args.repeats, results, emit, profile, report,
                      args.profile_host, args.profile_python, args.profile_gaps, args.split_train)
            del model
            free(device)
    rows = rows_of(results, families, measures, args.checkpointing)
    emit()
    print(markdown(rows, args.batch), flush=True)
    if args.split_train:
        print("\n" + split_markdown(rows), flush=True)


if __name__ == "__main__":
    main()
