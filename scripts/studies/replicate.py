"""Small-scale replication of the papers' quality claims, in one run, offline.

A small dense Llama-style model is pretrained from scratch on a real corpus found on any machine with
Python: the Python sources of the standard library and of the installed packages. It is converted to
SPLA, SPA (SPLA without its residual term), SSE-H, SSE (no softmax layers) and an HLA hybrid, each
adapted with at most 5% of the pretraining tokens (`subquadratic.adaptation.adapt`, one recipe per
family, SPLA and SPA alike), then evaluated (`subquadratic.evaluation`):

  Q3  perplexity on held-out source files, vs dense
  Q4  passkey / multi-key needle retrieval (code prompts) at 4x and 8x the adaptation length
  Q5  MQAR from scratch at equal state size: SSE vs a GLA-style baseline vs HLA
  Q6  SPLA vs SPA at 4x the SPLA budget

Results go to OUT: results.json, results.md (tables beside each paper's claim), the adaptation logs
and one plot per model. `--scale h200` fits one H200 in under ten minutes; `--scale tiny` runs the
same pipeline on a CPU in a few minutes (numbers meaningless, for checking the script).

    python -m scripts.studies.replicate --out results/ [--scale h200|tiny] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sysconfig
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

import subquadratic  # noqa: E402, F401  (registers the families)
from scripts.studies.mqar_contenders import MQARSettings, mqar_compare  # noqa: E402
from subquadratic.adaptation import AdaptConfig, adapt  # noqa: E402
from subquadratic.conversion import convert  # noqa: E402
from subquadratic.data import tokenize_and_pack  # noqa: E402
from subquadratic.evaluation import evaluate, markdown_table  # noqa: E402
from subquadratic.evaluation.report import plot_results  # noqa: E402


@dataclass
class Scale:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    seq_len: int
    batch: int
    pretrain_seconds: float
    pretrain_max_steps: int
    lr: float
    adapt_share: float  # adaptation tokens / pretraining tokens
    adapt_max_steps: int
    spla: dict
    retrieval_lengths: tuple[int, ...]
    ppl_windows: int
    trials: int
    mqar: MQARSettings
    corpus_bytes: int  # cap on the training text read
    retrieval_tasks: tuple[str, ...] = ("passkey", "niah")


SCALES = {
    "h200": Scale(vocab=8192, hidden=512, layers=8, heads=8, kv_heads=2, seq_len=1024, batch=32,
                  pretrain_seconds=60, pretrain_max_steps=4000, lr=1.5e-3, adapt_share=0.05, adapt_max_steps=64,
                  spla=dict(block_size=32, top_k_blocks=8, num_sink_blocks=1, num_local_blocks=2),
                  retrieval_lengths=(1024, 4096), ppl_windows=12, trials=2,
                  mqar=MQARSettings.gpu(seq_len=128, num_kv_pairs=16, vocab_size=256, steps=800, lr=3e-3,
                                         test_examples=512), corpus_bytes=100_000_000, retrieval_tasks=("passkey",)),
    "tiny": Scale(vocab=512, hidden=64, layers=4, heads=4, kv_heads=2, seq_len=128, batch=8,
                  pretrain_seconds=25, pretrain_max_steps=300, lr=3e-3, adapt_share=0.05, adapt_max_steps=8,
                  spla=dict(block_size=8, top_k_blocks=4, num_sink_blocks=1, num_local_blocks=2),
                  retrieval_lengths=(128, 512), ppl_windows=4, trials=1,
                  mqar=MQARSettings.tiny(), corpus_bytes=3_000_000),
}

#: converted contenders: name -> (family, conversion options); the SSE rows are the paper's layers,
#: without the window branch that the sse-h preset adds (the recorded replication's recipe)
CONTENDERS = {
    "SPLA": ("spla", None),
    "SPA (use_rla=False)": ("spla", None),
    "SSE-H": ("sse-h", dict(softmax_every=4, sse_sliding_window=0)),
    "SSE (no softmax layers)": ("sse-h", dict(softmax_every=0, sse_sliding_window=0)),
    "HLA hybrid": ("hla", dict(softmax_every=4)),
}


#: adaptation per family: SPLA starts as sparse attention and continues training (no attention
#: transfer, a gentle learning rate); SSE and HLA layers start far from the dense layers and first
#: learn to imitate them (a quarter of the steps), then distil
RECIPES = {"spla": dict(stage1_share=0.0, lr=1e-4), "sse-h": dict(stage1_share=0.25, lr=3e-4),
           "hla": dict(stage1_share=0.25, lr=3e-4)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- corpus and tokenizer -----------------------------------------------------------------------


def source_files() -> list[tuple[Path, str]]:
    """Every .py file of the standard library and of the installed packages (site-packages), with
    its path relative to its root, in an order fixed by a hash of that relative path (so that a cap
    on the bytes read takes a spread of packages, the same on every run)."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    roots += [Path(p) for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}]
    seen, files = set(), []
    for root in roots:
        if not root.is_dir():
            continue
        for path in root.rglob("*.py"):
            rel = str(path.relative_to(root))
            if rel in seen or (root == roots[0] and ("site-packages" in path.parts or "dist-packages" in path.parts)):
                continue
            seen.add(rel)
            files.append((path, rel))
    return sorted(files, key=lambda f: (zlib.crc32(f[1].encode()), f[1]))


def build_corpus(work: Path, cap: int, min_bytes: int) -> tuple[Path, Path, dict]:
    """train.jsonl (one record per file) and heldout.txt (2% of the files, chosen by a hash of the
    relative path) from the Python sources on this machine, at most `cap` bytes of training text.
    Files shorter than `min_bytes` are left out: a packed row then holds one or two documents, and the
    model's one-document-per-row layout of a packed batch pads little."""
    train, held = [], []
    sizes = {"train_files": 0, "heldout_files": 0, "train_bytes": 0, "heldout_bytes": 0}
    for path, rel in source_files():
        if sizes["train_bytes"] > cap:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < min_bytes or len(text) > 1_000_000:  # short files; generated tables, vendored bundles
            continue
        key = "heldout" if zlib.crc32(rel.encode()) % 50 == 0 else "train"
        (held if key == "heldout" else train).append(text)
        sizes[f"{key}_files"] += 1
        sizes[f"{key}_bytes"] += len(text)
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    with (corpus / "train.jsonl").open("w") as f:
        for text in train:
            f.write(json.dumps({"text": text}) + "\n")
    (corpus / "heldout.txt").write_text("\n\n".join(held[:200]))
    sizes["roots"] = sorted({str(Path(sysconfig.get_paths()[k])) for k in ("stdlib", "purelib", "platlib")})
    return corpus / "train.jsonl", corpus / "heldout.txt", sizes


def adaptation_subset(train: Path, nbytes: float) -> Path:
    """The first files of the training corpus, about `nbytes` of text: the adaptation reads a small
    share of the corpus, and tokenising all of it for each contender would cost more than training."""
    out, n = train.with_name("adapt.jsonl"), 0
    with train.open() as src, out.open("w") as dst:
        for line in src:
            dst.write(line)
            n += len(json.loads(line)["text"])
            if n >= nbytes:
                break
    return out


def train_tokenizer(train: Path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts(limit: int = 40_000_000):  # the merges are learned from the first 40 MB
        n = 0
        with train.open() as f:
            for line in f:
                text = json.loads(line)["text"]
                n += len(text)
                yield text
                if n > limit:
                    return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


# --- dense pretraining --------------------------------------------------------------------------


def pretrain(scale: Scale, train: Path, tokenizer, out: Path, device: torch.device) -> dict:
    """A dense Llama-style model from scratch: AdamW, warm-up then cosine, bf16 autocast on GPU, for
    `pretrain_seconds` (the step count is fixed after timing the first steps)."""
    from datasets import load_dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = load_dataset("json", data_files=str(train), split="train")
    rows = tokenize_and_pack(texts, tokenizer, scale.seq_len, num_proc=min(16, os.cpu_count() or 1))
    rows = rows[:]["input_ids"]  # [N, seq_len]
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=scale.hidden, intermediate_size=3 * scale.hidden,
        num_hidden_layers=scale.layers, num_attention_heads=scale.heads, num_key_value_heads=scale.kv_heads,
        max_position_embeddings=max(scale.retrieval_lengths) * 2, rope_theta=10000.0, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=scale.lr, betas=(0.9, 0.95), weight_decay=0.1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    total, warm, step, started, losses = scale.pretrain_max_steps, 50, 0, time.perf_counter(), []
    model.train()
    while step < total:
        idx = torch.randint(len(rows), (scale.batch,), generator=g)
        ids = rows[idx].to(device)
        frac = step / max(1, total)
        lr = scale.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 10:
            _sync(device)
            warm_end = time.perf_counter()
        if step == 30:  # fix the length of the run from the speed of steps 10..30 (past the warm-up)
            _sync(device)
            per_step = (time.perf_counter() - warm_end) / 20
            left = scale.pretrain_seconds - (warm_end - started)
            total = min(scale.pretrain_max_steps, max(40, int(left / per_step)))
        if step % 50 == 0 or step == total:
            losses.append((step, loss.item()))
            log(f"pretrain step {step}/{total} loss {losses[-1][1]:.3f}")
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tokens = step * scale.batch * scale.seq_len
    return {"steps": step, "tokens": tokens, "seconds": round(time.perf_counter() - started, 1),
            "parameters": sum(p.numel() for p in model.parameters()), "corpus_tokens": rows.numel(),
            "losses": losses, "config": {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers",
                                                                         "num_attention_heads", "num_key_value_heads",
                                                                         "vocab_size", "intermediate_size")}}


# --- the run ------------------------------------------------------------------------------------


def convert_all(scale: Scale, dense: Path, work: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    folders = {}
    for name, (family, options) in CONTENDERS.items():
        folder = work / "converted" / name.split()[0].lower()
        opts = dict(scale.spla) if family == "spla" else dict(options)
        if name.startswith("SPA"):
            spla = AutoModelForCausalLM.from_pretrained(folders["SPLA"], use_rla=False)
            spla.save_pretrained(folder)
            for f in folders["SPLA"].glob("tokenizer*"):
                shutil.copy(f, folder / f.name)
        else:
            convert(str(dense), str(folder), family, options=opts, overwrite=True, progress=False)
        folders[name] = folder
    return folders


def run(args) -> dict:
    scale = SCALES[args.scale]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="replicate-"))
    results: dict = {"scale": args.scale, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "versions": {"torch": torch.__version__, **_versions()}, "date": time.strftime("%Y-%m-%d")}

    def save():
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))

    t0 = time.perf_counter()
    train, held, sizes = build_corpus(work, scale.corpus_bytes, min_bytes=8 * scale.seq_len)
    results["corpus"] = sizes
    tokenizer = train_tokenizer(train, scale.vocab)
    log(f"corpus {sizes['train_files']} train / {sizes['heldout_files']} held-out files; tokenizer {len(tokenizer)}")

    dense = work / "dense"
    results["pretrain"] = pretrain(scale, train, tokenizer, dense, device)
    save()
    log(f"pretrained: {results['pretrain']['tokens']:,} tokens in {results['pretrain']['seconds']} s")

    folders = convert_all(scale, dense, work)
    tokens_per_step = scale.batch * scale.seq_len
    steps = max(4, min(scale.adapt_max_steps, int(scale.adapt_share * results["pretrain"]["tokens"] / tokens_per_step)))
    adapt_data = adaptation_subset(train, 4 * steps * tokens_per_step * sizes["train_bytes"]
                                   / results["pretrain"]["corpus_tokens"])
    common = dict(data=[str(adapt_data)], num_proc=min(16, os.cpu_count() or 1), teacher=str(dense),
                  max_steps=steps, loss="kl", train="full",
                  seq_len=scale.seq_len, batch_size=scale.batch, stage1_lr=1e-3,
                  mixed_precision="bf16" if device.type == "cuda" else "no", save_every=10 ** 6, progress=False,
                  overwrite=True)
    results["adaptation"] = {"steps": steps, "tokens": steps * tokens_per_step, "recipes": RECIPES,
                             "share_of_pretraining": steps * tokens_per_step / results["pretrain"]["tokens"],
                             "settings": {k: v for k, v in common.items() if k not in ("data", "teacher")}}
    adapted = {}
    for name, folder in folders.items():
        started = time.perf_counter()
        recipe = RECIPES[CONTENDERS[name][0]]
        adapted[name] = adapt(AdaptConfig(student=str(folder), output_dir=str(work / "adapted" / folder.name),
                                          stage1_steps=int(recipe["stage1_share"] * steps), lr=recipe["lr"],
                                          **common))
        shutil.copy(adapted[name] / "adapt_log.jsonl", out / f"adapt_log_{folder.name}.jsonl")
        results["adaptation"][name] = {"seconds": round(time.perf_counter() - started, 1),
                                       "final_loss": _last_loss(adapted[name])}
        log(f"adapted {name} in {results['adaptation'][name]['seconds']} s")
    save()

    results["evaluation"] = evaluate_all(scale, dense, adapted, held, device, out)
    save()
    (out / "results.md").write_text(report(results, scale))
    log(f"evaluated ({time.perf_counter() - t0:.0f} s so far)")

    started = time.perf_counter()
    results["mqar"] = mqar_compare(scale.mqar, device=device)
    results["mqar"]["seconds"] = round(time.perf_counter() - started, 1)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    save()
    (out / "results.md").write_text(report(results, scale))
    log(f"done in {results['seconds']} s")
    return results


def evaluate_all(scale: Scale, dense_dir: Path, adapted: dict[str, Path], held: Path, device, out: Path) -> list:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=dtype).to(device).eval()
    evals = []
    budget = scale.spla["block_size"] * scale.spla["top_k_blocks"]
    ppl_lengths = sorted({scale.seq_len, 4 * budget})
    for name, folder in [("dense", dense_dir), *adapted.items()]:
        model = dense
        if name != "dense":
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        tasks = ("ppl",) if name == "dense" else ("ppl", "kl")
        first = evaluate(model, tokenizer, name=name, tasks=tasks, seq_lens=ppl_lengths, data=str(held),
                         reference=dense, max_windows=scale.ppl_windows)
        second = evaluate(model, tokenizer, name=name, tasks=scale.retrieval_tasks,
                          seq_lens=scale.retrieval_lengths,
                          template="code", trials=scale.trials, num_needles=4)
        first["tasks"].update(second["tasks"])
        first["settings"]["retrieval"] = second["settings"]
        evals.append(first)
        log(f"evaluated {name}: ppl {[round(v['ppl'], 3) for v in first['tasks']['ppl'].values()]}")
        if name != "dense":
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    plot_results(evals, out / "plots")
    (out / "evaluation.md").write_text(markdown_table(evals))
    return evals


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _last_loss(folder: Path) -> float:
    lines = (folder / "adapt_log.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["loss"]


def _versions() -> dict:
    import transformers

    out = {"transformers": transformers.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def _metric(evals: list, model: str, task: str, length: int, key: str):
    for r in evals:
        if r["model"] == model:
            value = r["tasks"].get(task, {}).get(length, r["tasks"].get(task, {}).get(str(length)))
            return None if value is None else value.get(key)
    return None


TASK_LABELS = {"passkey": "passkey", "niah": "4-needle"}


def report(results: dict, scale: Scale) -> str:
    evals = results["evaluation"]
    budget = scale.spla["block_size"] * scale.spla["top_k_blocks"]
    L, L4 = scale.seq_len, 4 * budget
    pre, ad = results["pretrain"], results["adaptation"]
    lines = [
        f"# Small-scale replication ({results['scale']}, {results['device']}, {results['date']})",
        "",
        f"Dense Llama-style model: {pre['parameters'] / 1e6:.1f}M parameters ({pre['config']}), pretrained from "
        f"scratch on {results['corpus']['train_files']} Python source files ({pre['corpus_tokens']:,} "
        f"tokens), {pre['tokens']:,} tokens in {pre['steps']} steps ({pre['seconds']} s). Each conversion adapted "
        f"with {ad['tokens']:,} tokens ({100 * ad['share_of_pretraining']:.1f}% of pretraining): {ad['steps']} "
        f"steps of {scale.batch} x {L} tokens, KL distillation from the dense model, every parameter trained; "
        "SSE and HLA spend the first quarter on attention transfer (learning rate 1e-3) and distil at 3e-4, SPLA "
        "and SPA distil at 1e-4 from the start. SPLA "
        f"budget {budget} tokens (B{scale.spla['block_size']} x {scale.spla['top_k_blocks']}). Held-out: "
        f"{results['corpus']['heldout_files']} other source files (2% of the files, by a hash of the path); sources: "
        f"the standard library and the installed packages of {', '.join(results['corpus']['roots'])}.",
        "",
        "## Q3: perplexity after adaptation, vs dense",
        "",
        f"| model | ppl @ {L} | vs dense | KL to dense | paper's claim / target |",
        "| --- | --- | --- | --- | --- |",
    ]
    dense_ppl = _metric(evals, "dense", "ppl", L, "ppl")
    claims = {"SPLA": "within 5% of dense", "SSE-H": "within 10% of dense", "HLA hybrid": "reported"}
    for r in evals:
        ppl = _metric(evals, r["model"], "ppl", L, "ppl")
        kl = _metric(evals, r["model"], "kl", L, "kl")
        rel = "" if r["model"] == "dense" else f"{100 * (ppl / dense_ppl - 1):+.1f}%"
        lines.append(f"| {r['model']} | {ppl:.3f} | {rel} | {'' if kl is None else f'{kl:.4f}'} | "
                     f"{claims.get(r['model'], '')} |")
    lines += ["", f"## Q4: retrieval at {', '.join(map(str, scale.retrieval_lengths))} tokens "
              f"({', '.join(f'{n // L}x' for n in scale.retrieval_lengths)} the adaptation length), code prompts",
              "", "| model | " + " | ".join(f"{TASK_LABELS[t]} @ {n}" for t in scale.retrieval_tasks
                                             for n in scale.retrieval_lengths) + " |",
              "| --- |" + " --- |" * (len(scale.retrieval_tasks) * len(scale.retrieval_lengths))]
    for r in evals:
        cells = []
        for task in scale.retrieval_tasks:
            for n in scale.retrieval_lengths:
                acc = _metric(evals, r["model"], task, n, "accuracy")
                lp = _metric(evals, r["model"], task, n, "logprob")
                cells.append("-" if acc is None else f"{acc:.2f} (log p {lp:.2f})")
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    lines += ["", "Accuracy is greedy exact match; log p is the answer's mean log-probability per token. Paper's "
              "claims: SPLA >= dense; SSE-H better than SSE without softmax layers.", "",
              f"## Q6: SPLA vs SPA (use_rla=False) at 4x the budget ({L4} tokens)", "",
              "| model | ppl | KL to dense | paper's claim |", "| --- | --- | --- | --- |"]
    for name in ("SPLA", "SPA (use_rla=False)"):
        ppl, kl = _metric(evals, name, "ppl", L4, "ppl"), _metric(evals, name, "kl", L4, "kl")
        lines.append(f"| {name} | {ppl:.3f} | {kl:.4f} | SPLA lower than SPA |")
    m = results.get("mqar")
    if m is None:
        return "\n".join(lines + ["", "(MQAR not run yet)", ""])
    s = m["settings"]
    lines += ["", "## Q5: MQAR from scratch at equal state size", "",
              f"Sequence {s['seq_len']}, {s['num_kv_pairs']} key-value pairs, vocabulary {s['vocab_size']}, "
              f"{s['num_layers']} layers, d_model {s['hidden_size']}, head dim {s['head_dim']}, {s['steps']} steps "
              f"of batch {s['batch_size']}; chance {m['chance']:.4f}. ({m['seconds']} s)", "",
              "| model | heads | state bytes / sequence | accuracy | final loss | paper's claim |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, claim in (("sse", "SSE > GLA-style"), ("gla", ""), ("hla", "reported")):
        r = m[name]
        label = {"sse": f"SSE (N={r['num_partitions']}, top-1)", "gla": "GLA-style (SSE, N=1)", "hla": "HLA (hla2)"}
        lines.append(f"| {label[name]} | {r['num_heads']} | {r['state_bytes']:,} | {r['accuracy']:.3f} | "
                     f"{r['final_loss']:.3f} | {claim} |")
    lines += ["", f"Whole run: {results.get('seconds')} s; versions {results['versions']}.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for results.json, results.md, logs and plots")
    p.add_argument("--scale", default="h200", choices=sorted(SCALES))
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--work", default=None, help="folder for the corpus and checkpoints (default: a temporary one)")
    args = p.parse_args()
    run(args)


if __name__ == "__main__":
    main()
