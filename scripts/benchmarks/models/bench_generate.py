"""End-to-end decode speed (BENCHMARKS.md P7) on one GPU: a 1B-class Llama with random bf16 weights
(Llama-3.2-1B shapes), converted to SPLA by the package's converter, against the dense source with
SDPA in the same run, each with a growing cache run eagerly and with a static cache whose step is
captured (dense: Transformers' StaticCache, which generate() compiles with
torch.compile(mode="reduce-overhead"); SPLA: the package's static cache, whose one-token steps
replay one CUDA graph of the whole model); plus, for the HLA and SSE-H conversions of the same source,
the cache bytes (their linear layers' must not grow with the context) and the decode rate of a plain
generate() call (--modes default: on CUDA their static cache with the captured step) against the
dense model's, and the same rate of `spla-adapted`: the SPLA conversion with gamma = 0.1 in every
layer, as after `adapt`, whose steps compute the residual term (a fresh conversion's gamma is 0 and
its inference skips the term), the SPLA model a user has. Prints one table (peer, ours,
ratio) and writes it as JSON (rewritten after every row, so a run cut short keeps what it measured).

  python -m scripts.benchmarks.models.bench_generate [--contexts 32768,131072] [--batch 1] [--new-tokens 64]
      [--out r.json]
  python -m scripts.benchmarks.models.bench_generate --quick    # tiny model on CPU (reference kernels): a smoke run

Per model and context: the prompt's first C - 1 tokens are prefilled into a cache (in chunks of
--prefill-chunk tokens, not timed), then N = --new-tokens greedy tokens are decoded from copies of
that cache, each run synchronised and timed:
  generate: model.generate(prompt, cache=copy, max_new_tokens=N, min_new_tokens=N), which runs N
            single-token forward steps (the first one reads the prompt's last token);
  loop:     the same N steps as plain cached forward calls with argmax, without generate()'s
            processors and bookkeeping;
  default:  (--modes default) model.generate(prompt, max_new_tokens=...) with no cache given, what a
            user runs: each model's own default cache and step (`measure_default`), the decode rate
            from the times of N + 1 and of 1 new tokens ("default": capture included) and of N + 1 and
            N / 8 + 1 ("steady": a long generation).
An untimed run of the same N steps comes first, so that every Triton kernel variant the steps need
(they depend on the number of blocks) is compiled before the clock starts. Decode tokens/s is
batch x N / seconds. The dense peer's DynamicCache grows by concatenation, as in stock generate().
Static caches (--modes static) are sized for the prompt plus every run and not copied: each run
continues on the same cache from where the last stopped (the first, untimed, compiles or captures),
so run r starts r x N tokens after the prompt. Agreement rows: how many leading greedy tokens and how
close the first step's logits are, captured SPLA vs eager SPLA and dense static vs dense eager (the
second pair measures what two kernel paths of one model differ by in the chosen --dtype).
No network and no downloads: the weights are random (speed does not depend on them), built with
Transformers' LlamaConfig / LlamaForCausalLM, saved and converted on local disk.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import statistics
import tempfile
import traceback
from pathlib import Path

import torch

from scripts.common.models import LLAMA_1B, PAD, TINY, dense_and_conversions, free, load_converted, log, timed


def cache_of(out):
    from subquadratic import CACHE_FIELD

    return getattr(out, CACHE_FIELD)


def prefill(model, ids: torch.Tensor, chunk: int):
    """The cache after ids [B, T], fed in chunks (logits of the last token only)."""
    from subquadratic import CACHE_FIELD

    cache = model.new_cache() if hasattr(model, "new_cache") else None
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            kw = {CACHE_FIELD: cache} if cache is not None else {}
            out = model(ids[:, s:s + chunk], use_cache=True, logits_to_keep=1, **kw)
            cache = cache_of(out)
    return cache


def decode_generate(model, prompt: torch.Tensor, cache, n: int, logits: bool = False):
    """The N new tokens [B, N] (with `logits`: and the logits of each step [B, N, V], fp32)."""
    from subquadratic import CACHE_FIELD

    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n, do_sample=False,
        pad_token_id=PAD, eos_token_id=None, output_logits=logits, return_dict_in_generate=logits,
        **{CACHE_FIELD: cache},
    )
    if logits:
        return out.sequences[:, prompt.shape[1]:], torch.stack(out.logits, 1).float()
    return out[:, prompt.shape[1]:]


def agreement(a: tuple, b: tuple) -> dict:
    """How two runs from the same prompt agree: (tokens [B, N], logits [B, N, V]) each; the logits are
    compared up to the first step where the tokens differ (after it the inputs differ)."""
    same = (a[0] == b[0]).all(0)
    steps = int(same.long().cumprod(0).sum())  # leading steps with equal tokens in every row
    upto = min(steps + 1, same.numel())
    diff = (a[1][:, :upto] - b[1][:, :upto]).abs().amax(-1) / a[1][:, :upto].abs().amax(-1)  # [B, upto]
    return dict(equal_steps=steps, steps=same.numel(), max_rel_logit_diff=float(diff.max()),
                first_step_rel_logit_diff=float(diff[:, 0].max()))


def profile_steps(model, prompt: torch.Tensor, cache, n: int = 4) -> dict:
    """GPU kernels of n one-token steps (a loop, as generate() runs them): kernels and device ms per step,
    the eight kernels with the most device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_loop(model, prompt, cache, n)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    top = sorted(events, key=lambda e: -e.device_time_total)[:8]
    return dict(kernels_per_step=sum(e.count for e in events) / n,
                device_ms_per_step=sum(e.device_time_total for e in events) / n / 1000,
                top={e.key[:70]: round(e.device_time_total / n / 1000, 4) for e in top})


def profile_captured(model, prompt: torch.Tensor, n: int = 4) -> dict:
    """`profile_steps` of our model's captured one-token step at the prompt's length: a static cache
    prefilled with prompt[:, :-1], two steps to warm up and capture, then n profiled replays."""
    from subquadratic import CACHE_FIELD

    cache = model.new_cache(max_length=prompt.shape[1] + n + 2)
    with torch.no_grad():
        model(prompt[:, :-1], use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})
    decode_loop(model, prompt, cache, 2)
    return profile_steps(model, prompt, cache, n)


def decode_loop(model, prompt: torch.Tensor, cache, n: int) -> torch.Tensor:
    from subquadratic import CACHE_FIELD

    tok, out = prompt[:, -1:], []
    with torch.no_grad():
        for _ in range(n):
            res = model(tok, use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})
            cache = cache_of(res)
            tok = res.logits[:, -1].argmax(-1, keepdim=True)
            out.append(tok)
    return torch.cat(out, 1)


def prefill_static(model, ids: torch.Tensor, chunk: int, max_length: int, fuse: bool = True):
    """A static cache of max_length tokens holding ids [B, T], fed in chunks: the package's for our models,
    Transformers' StaticCache (compiled by generate()) for the dense source."""
    from subquadratic import CACHE_FIELD

    if hasattr(model, "new_cache"):
        cache = model.new_cache(max_length=max_length, fuse=fuse)
    else:
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=max_length)
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            model(ids[:, s:s + chunk], use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})
    return cache


def measure_static(model, prompt: torch.Tensor, n: int, chunk: int, repeats: int, device: torch.device,
                   loop: bool, fuse: bool = True, profile: bool = False) -> dict:
    """Prefill prompt[:, :-1] into a static cache, then 1 + `repeats` generate() runs of N steps (and,
    with `loop`, as many plain loops) continuing on it; the first run is not timed (compile / capture)
    and keeps its logits. `fuse`: our cache's fused elementwise chains; `profile`: the GPU kernels of
    a few more steps."""
    max_length = prompt.shape[1] + (2 * repeats + 3) * n + 8
    t_prefill, cache = timed(lambda: prefill_static(model, prompt[:, :-1], chunk, max_length, fuse), device)
    res = dict(prefill_s=t_prefill, cache_bytes=cache_bytes(cache) if hasattr(cache, "nbytes") else None)
    times: dict[str, list[float]] = {"generate": []}
    if loop:
        times["loop"] = []
    seq, first = prompt, {}
    for r in range(repeats + 1):
        for how, fn in (("generate", decode_generate), ("loop", decode_loop)):
            if how not in times:
                continue
            if not r and how == "generate":
                t, (new, logits) = timed(lambda seq=seq: decode_generate(model, seq, cache, n, logits=True), device)
                res["first_run"] = (new, logits)
            else:
                t, new = timed(lambda fn=fn, seq=seq: fn(model, seq, cache, n), device)
            first.setdefault(how, new)
            if r:
                times[how].append(t)
            seq = torch.cat([seq, new], 1)
    B = prompt.shape[0]
    for how, ts in times.items():
        res[how + "_s"] = statistics.median(ts)
        res[how + "_tok_s"] = B * n / res[how + "_s"]
    res["first_tokens"] = first["generate"]
    if profile and device.type == "cuda":
        try:
            res["profile"] = profile_steps(model, seq, cache)
        except Exception as e:  # noqa: BLE001 (a profiler failure must not lose the run's figures)
            res["profile"] = f"failed: {type(e).__name__}: {e}"
    return res


def measure_default(model, prompt: torch.Tensor, n: int, repeats: int, device: torch.device) -> dict:
    """Decode tokens/s of a plain `model.generate(prompt, max_new_tokens=...)`, what a user runs: the
    cache and the step are the model's defaults (the dense model: Transformers' growing cache, eager;
    ours on CUDA: the static cache with the captured step, which the model keeps between calls: the
    untimed call builds and captures it, the timed ones rewind it and replay the step).
    Prefill is inside every call, so rates come from differences of medians over `repeats` calls
    (after one untimed call) of 1, k + 1 and n + 1 new tokens, k = n // 8: `default_tok_s` = B x n
    over t(n + 1) - t(1), everything after the first token (the first decode steps, and for a
    captured step its warm-up and capture, included), and `steady_tok_s` = B x (n - k) over
    t(n + 1) - t(k + 1), the rate of a long generation."""
    def gen(m: int):
        return decode_generate(model, prompt, None, m)  # no cache given: the model's default

    k = max(1, n // 8)
    gen(n + 1)
    times: dict[int, list[float]] = {1: [], k + 1: [], n + 1: []}
    for _ in range(repeats):
        for m in times:
            times[m].append(timed(lambda m=m: gen(m), device)[0])
    t1, tk, tn = (statistics.median(times[m]) for m in (1, k + 1, n + 1))
    B = prompt.shape[0]
    return dict(default_tok_s=B * n / max(tn - t1, 1e-9), steady_tok_s=B * (n - k) / max(tn - tk, 1e-9),
                first_token_s=t1, all_tokens_s=tn)


def cache_bytes(cache) -> int:
    """Bytes of the keys/values or states in use: ours report them; DynamicCache layers hold keys and values."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def measure_decode(model, prompt: torch.Tensor, n: int, chunk: int, repeats: int, device: torch.device,
                   keep_logits: bool = False) -> dict:
    """Prefill prompt[:, :-1] once, then time N decode steps through generate() and through a plain
    loop, each from a fresh copy of the prefilled cache (copied before the clock starts); medians of
    `repeats` runs."""
    t_prefill, cache = timed(lambda: prefill(model, prompt[:, :-1], chunk), device)
    res = dict(prefill_s=t_prefill, cache_bytes=cache_bytes(cache))
    decode_loop(model, prompt, copy.deepcopy(cache), n)  # warm-up: compiles every kernel variant the steps use
    times: dict[str, list[float]] = {"generate": [], "loop": []}
    tokens = {}
    for _ in range(repeats):
        for how, fn in (("generate", decode_generate), ("loop", decode_loop)):
            fresh = copy.deepcopy(cache)
            t, tokens[how] = timed(lambda fn=fn, fresh=fresh: fn(model, prompt, fresh, n), device)
            times[how].append(t)
            del fresh
    B = prompt.shape[0]
    for how, ts in times.items():
        res[how + "_s"] = statistics.median(ts)
        res[how + "_tok_s"] = B * n / res[how + "_s"]
    res["same_tokens"] = bool(torch.equal(tokens["generate"], tokens["loop"]))
    res["first_tokens"] = tokens["generate"]
    if keep_logits:
        res["first_run"] = decode_generate(model, prompt, copy.deepcopy(cache), n, logits=True)
    del cache
    free(device)
    return res


def state_bytes(model, ids: torch.Tensor, chunk: int) -> dict:
    """Cache bytes after prefilling ids and one decode step, split into linear (recurrent) and softmax layers."""
    from subquadratic import CACHE_FIELD, RecurrentLayer

    cache = prefill(model, ids[:, :-1], chunk)
    with torch.no_grad():
        model(ids[:, -1:], use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})
    linear = sum(layer.nbytes() for layer in cache.layers if isinstance(layer, RecurrentLayer))
    return dict(linear=linear, softmax=cache.nbytes() - linear, allocated=cache.nbytes(allocated=True),
                tokens=cache.get_seq_length())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default=None, help="comma list of prompt lengths (default 32768,131072)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=None, help="decode steps timed (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measure (median)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill call (default 8192)")
    ap.add_argument("--families", default="spla-adapted,spla,hla,sse-h,hla-h",
                    help="conversions to run (spla, the fresh conversion: every mode; spla-adapted, the same with "
                         "gamma = 0.1 as after adaptation, which computes the residual term: the default mode; hla, "
                         "sse-h, ...: cache bytes and the default mode)")
    ap.add_argument("--modes", default="dynamic,static,default",
                    help="caches to time: dynamic (growing, eager), static (static cache, step compiled / captured), "
                         "default (a plain generate() call: the model's own default cache)")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="weights and activations (default bfloat16 on the GPU, float32 on the CPU)")
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU, short contexts (smoke run)")
    args = ap.parse_args()
    import transformers

    if args.quick:
        device, dtype, shape = torch.device("cpu"), torch.float32, TINY
        contexts, new_tokens, chunk = [256, 1024], 8, 512
        spla_options = dict(block_size=16, top_k_blocks=4)  # a budget below the context: selection at work
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU; use --quick for a CPU smoke run")
        device, dtype, shape = torch.device("cuda"), torch.bfloat16, LLAMA_1B
        contexts, new_tokens, chunk = [32768, 131072], 64, 8192
        spla_options = {}  # the defaults: 16 blocks of 64
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else contexts
    dtype = getattr(torch, args.dtype) if args.dtype else dtype
    new_tokens = args.new_tokens or new_tokens
    chunk = args.prefill_chunk or chunk
    families = [f for f in args.families.split(",") if f]
    modes = [m for m in args.modes.split(",") if m]
    max_pos = -(-(max(131072, *contexts) + new_tokens + 1) // 1024) * 1024  # >= 128k + the new tokens

    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name() if device.type == "cuda"
                else "cpu", torch=torch.__version__, transformers=transformers.__version__, batch=args.batch,
                new_tokens=new_tokens, contexts=contexts, prefill_chunk=chunk, dtype=str(dtype), model=shape,
                spla_options=spla_options, quick=args.quick, commit=os.environ.get("BENCH_COMMIT"))
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        ratio = row.get("ratio", math.nan)
        print(f"{row['id']:4} {row['what']:52} {row['peer']:>14} {row['ours']:>14} {ratio:8.2f}  {row['target']}",
              flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2, default=str) + "\n")

    print(json.dumps(meta))
    print(f"{'id':4} {'what':52} {'peer':>14} {'ours':>14} {'ratio':>8}  target")
    g = torch.Generator().manual_seed(1)
    prompts = {c: torch.randint(1, shape["vocab_size"], (args.batch, c), generator=g).to(device) for c in contexts}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        dense = dense_and_conversions(work, shape, max_pos, device, dtype, families, {"spla": spla_options})
        dense_default: dict[int, dict] = {}  # context -> the dense model's plain generate() rates

        if "spla" in families:
            spla = load_converted(work / "spla", device, dtype)
            for c in contexts:
                res = {}
                runs = [("spla", "dynamic"), ("dense", "dynamic"), ("spla", "static"), ("spla", "static-unfused"),
                        ("dense", "static"), ("spla", "default"), ("dense", "default")]
                for name, mode in runs:
                    if mode.split("-")[0] not in modes:
                        continue
                    model = spla if name == "spla" else dense
                    spla.drop_generation_cache()  # the static cache generate() kept: 16+ GiB at 4 rows of 128k
                    log(f"{name}, {mode} cache, context {c}")
                    try:
                        if mode == "default":
                            res[name, mode] = measure_default(model, prompts[c], new_tokens, args.repeats, device)
                        elif mode == "dynamic":
                            res[name, mode] = measure_decode(model, prompts[c], new_tokens, chunk, args.repeats,
                                                             device, keep_logits=True)
                        else:
                            res[name, mode] = measure_static(model, prompts[c], new_tokens, chunk, args.repeats,
                                                             device, loop=name == "spla", fuse=mode == "static",
                                                             profile=name == "spla" and not args.quick)
                    except Exception:  # noqa: BLE001 (one failed measurement must not lose the others)
                        log(f"  failed:\n{traceback.format_exc()}")
                        free(device)
                        continue
                    if (name, mode) == ("dense", "default"):
                        dense_default[c] = res[name, mode]
                    got = res[name, mode].items()
                    log("  " + ", ".join(f"{k} {v:.4g}" for k, v in got if isinstance(v, float)))
                    if "profile" in res[name, mode]:
                        log(f"  profile: {json.dumps(res[name, mode]['profile'])}")
                    free(device)
                label = {("dense", "dynamic"): "dense eager", ("dense", "static"): "dense static+compile",
                         ("spla", "dynamic"): "SPLA eager", ("spla", "static"): "SPLA static+graph",
                         ("spla", "static-unfused"): "SPLA static+graph unfused", ("dense", "default"): "dense default",
                         ("spla", "default"): "SPLA default"}
                pairs = [(("dense", "default"), ("spla", "default"), "default", ">= 5x at 128k, B1 and B4"),
                         (("dense", "default"), ("spla", "default"), "steady", "(info: a long generation)"),
                         (("dense", "dynamic"), ("spla", "dynamic"), "generate", ">= 5x at 128k"),
                         (("dense", "dynamic"), ("spla", "static"), "generate", ">= 5x at 128k"),
                         (("dense", "static"), ("spla", "static"), "generate", ">= 2x at B1, 5x at B4"),
                         (("dense", "dynamic"), ("spla", "static-unfused"), "generate", "(info)"),
                         (("dense", "dynamic"), ("spla", "dynamic"), "loop", "(info)"),
                         (("dense", "dynamic"), ("spla", "static"), "loop", "(info)")]
                hidden = ("first_tokens", "first_run")
                for pk, ok, how, target in pairs:
                    if pk not in res or ok not in res or how + "_tok_s" not in res[ok]:
                        continue
                    peer, ours = res[pk], res[ok]
                    emit(dict(id="P7", what=f"tok/s {how}, {c}, B{args.batch}: {label[ok]} vs {label[pk]}",
                              peer=f"{peer[how + '_tok_s']:.1f}", ours=f"{ours[how + '_tok_s']:.1f}",
                              ratio=ours[how + "_tok_s"] / peer[how + "_tok_s"], target=target,
                              dense={k: v for k, v in peer.items() if k not in hidden},
                              spla={k: v for k, v in ours.items() if k not in hidden}))
                for mode in ("static", "static-unfused"):
                    if ("spla", "dynamic") in res and ("spla", mode) in res:
                        agree = agreement(res["spla", "dynamic"]["first_run"], res["spla", mode]["first_run"])
                        emit(dict(id="", what=f"  {label['spla', mode]} vs SPLA eager: equal greedy steps",
                                  peer=str(agree["steps"]), ours=str(agree["equal_steps"]),
                                  ratio=agree["first_step_rel_logit_diff"], target="ratio: step-1 logit diff / max",
                                  agreement=agree))
                if ("dense", "dynamic") in res and ("dense", "static") in res:  # how far two dense paths differ
                    agree = agreement(res["dense", "dynamic"]["first_run"], res["dense", "static"]["first_run"])
                    emit(dict(id="", what=f"  {label['dense', 'static']} vs dense eager: equal greedy steps",
                              peer=str(agree["steps"]), ours=str(agree["equal_steps"]),
                              ratio=agree["first_step_rel_logit_diff"], target="ratio: step-1 logit diff / max",
                              agreement=agree))
                if ("spla", "dynamic") in res and ("dense", "dynamic") in res:
                    peer, ours = res["dense", "dynamic"], res["spla", "dynamic"]
                    emit(dict(id="", what=f"  cache bytes after prefill, ctx {c} (SPLA vs dense)",
                              peer=str(peer["cache_bytes"]), ours=str(ours["cache_bytes"]),
                              ratio=ours["cache_bytes"] / peer["cache_bytes"], target="(info)"))
            del spla
        others = [f for f in families if f != "spla"]
        if others and "default" in modes:  # the peer of the other families' default rows
            for c in [c for c in contexts if c not in dense_default]:
                log(f"dense, default cache, context {c}")
                dense_default[c] = measure_default(dense, prompts[c], new_tokens, args.repeats, device)
                free(device)
        del dense
        free(device)

        for fam in [f for f in families if f != "spla"]:
            model = load_converted(work / fam, device, dtype)
            sizes = {}
            for c in contexts if fam != "spla-adapted" else []:  # its cache is the fresh conversion's
                log(f"{fam} cache bytes, context {c}")
                sizes[c] = state_bytes(model, prompts[c], chunk)
            lo, hi = contexts[0], contexts[-1]
            if sizes:
                emit(dict(id="P7", what=f"{fam} linear-layer cache bytes, ctx {hi} vs {lo}",
                          peer=str(sizes[lo]["linear"]), ours=str(sizes[hi]["linear"]),
                          ratio=sizes[hi]["linear"] / max(1, sizes[lo]["linear"]), target="= 1.00 (independent)",
                          sizes=sizes))
            if sizes and sizes[hi]["softmax"]:
                emit(dict(id="", what=f"  {fam} softmax-layer KV bytes, ctx {hi} vs {lo}",
                          peer=str(sizes[lo]["softmax"]), ours=str(sizes[hi]["softmax"]),
                          ratio=sizes[hi]["softmax"] / sizes[lo]["softmax"], target="(grow with context)"))
            for c in contexts if "default" in modes else []:
                log(f"{fam}, default cache, context {c}")
                try:
                    ours = measure_default(model, prompts[c], new_tokens, args.repeats, device)
                    if device.type == "cuda" and not args.quick:
                        model.drop_generation_cache()
                        ours["profile"] = profile_captured(model, prompts[c])
                        log(f"  profile of the captured step: {json.dumps(ours['profile'])}")
                except Exception:  # noqa: BLE001
                    log(f"  failed:\n{traceback.format_exc()}")
                    free(device)
                    continue
                peer = dense_default[c]
                for how, target in (("default", ">= 5x at 128k"), ("steady", "(info: a long generation)")):
                    emit(dict(id="P7", what=f"tok/s {how}, {c}, B{args.batch}: {fam} default vs dense default",
                              peer=f"{peer[how + '_tok_s']:.1f}", ours=f"{ours[how + '_tok_s']:.1f}",
                              ratio=ours[how + "_tok_s"] / peer[how + "_tok_s"], target=target, dense=peer,
                              **{fam: ours}))
                free(device)
            del model
            free(device)


if __name__ == "__main__":
    main()
