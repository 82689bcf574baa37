"""The `subquadratic` command line: `convert` a dense checkpoint, `adapt` a converted one (attention
transfer, then fine-tuning or distillation), `eval` models, `push` a folder to the Hub, `demo` the
embedded default.

Each family's `convert` options come from its declaration (`registry.Family.options`) and are
spelled `--<family prefix>-<option>` (`--spla-top-k-blocks`, `--sse-top-k`, `--hla-softmax-every`);
`--to` takes a family's name or one of its convert presets (`sse-h`).
Every failure is one line on stderr naming the problem and what to do, with exit status 2; torch and
the model code are imported only once a command runs, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import sys

from .data import DTYPE_CHOICES
from .families import convert_targets

EVAL_TASKS = ("ppl", "passkey", "niah", "mqar", "kl")  # evaluation.suite.TASKS, readable without torch


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the problem and where help is), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="subquadratic", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="{convert,adapt,eval,push,demo}")
    families = convert_targets()
    p.target_family = {t: name for name, (_, presets) in families.items() for t in (name, *presets)}
    targets = sorted(p.target_family)
    c = sub.add_parser("convert", help="convert a dense Llama/Mistral/Qwen2/Qwen3 checkpoint")
    c.add_argument("src", help="source checkpoint folder (safetensors) or Hub id (org/name)")
    c.add_argument("out", help="output folder (written atomically: complete or absent)")
    presets = sorted(set(targets) - set(families))
    c.add_argument("--to", required=True, choices=targets,
                   help="target family" + (f", or a convert preset of one ({', '.join(presets)})" if presets else ""))
    c.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="dtype of the written weights: auto keeps the source's, or cast floating-point "
                        "weights to float32, bfloat16 or float16 (default auto)")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    c.add_argument("--push-to-hub", metavar="REPO", help="then upload OUT to this Hub repo (org/name)")
    c.add_argument("--private", action="store_true", help="create the Hub repo private (with --push-to-hub)")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.add_argument("--eval-data", metavar="FILE",
                   help="then measure perplexity (output and source) and next-token KL to the source on this "
                        "held-out .txt/.jsonl/.json/.parquet file and write the table into the output's card")
    c.add_argument("--eval-seq-len", type=int, nargs="+", metavar="L",
                   help="context lengths of --eval-data (default: the budget and twice it for SPLA, else 1024 "
                        "and 2048, capped at the model's max_position_embeddings)")
    c.add_argument("--eval-max-windows", type=int, default=8, metavar="N",
                   help="windows per length of --eval-data (default 8)")
    c.add_argument("--eval-device", default="cpu", help="device of --eval-data: cpu, cuda, cuda:N or auto "
                                                        "(default cpu)")
    p.family_dests = {}
    for name, (options, presets) in families.items():
        said = "".join(f"; --to {p}: " + ", ".join(f"{k}={v}" for k, v in kw.items()) for p, kw in presets.items())
        group = c.add_argument_group(f"{name} options (--to {name}{said})")
        p.family_dests[name] = []
        for flag, kw in options.items():
            kw = dict(kw)
            option = kw.pop("dest")  # the name `convert` receives; argparse's dest is unique per family
            if "choices" not in kw and kw.get("action") is None:
                kw.setdefault("metavar", option.upper())
            p.family_dests[name].append((flag, group.add_argument(flag, dest=f"{name}.{option}", **kw).dest, option))
    _adapt_parser(sub)
    e = sub.add_parser("eval", help="perplexity, passkey, needle, MQAR and KL of one or more models",
                       description="Evaluate checkpoint folders (dense or converted): print a table, and write "
                                   "JSON, one PNG plot per model and the model cards' Evaluation section on request.")
    e.add_argument("models", nargs="+", metavar="MODEL", help="checkpoint folder(s) with tokenizer files")
    e.add_argument("--data", metavar="FILE", help="held-out .txt/.jsonl/.json/.parquet file (tasks ppl and kl)")
    e.add_argument("--text-field", default="text", help="column of --data holding the text (default text)")
    e.add_argument("--seq-len", type=int, nargs="+", default=[512, 1024, 2048], metavar="L",
                   help="context lengths (default 512 1024 2048)")
    e.add_argument("--tasks", default=None,
                   help=f"comma list from {','.join(EVAL_TASKS)} (default: ppl,passkey,niah,mqar, plus kl with "
                        "--reference; ppl needs --data)")
    e.add_argument("--reference", metavar="DIR", help="dense reference folder for kl (same tokenizer)")
    e.add_argument("--json", metavar="FILE", help="write every result to this JSON file")
    e.add_argument("--plot-dir", metavar="DIR", help="write one PNG plot per model into this folder")
    e.add_argument("--card", action="store_true",
                   help="write the table into each MODEL's README.md card (its ## Evaluation section)")
    e.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    e.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="weights dtype (default: the folder's)")
    e.add_argument("--max-windows", type=int, default=8, metavar="N",
                   help="ppl / kl: at most N windows per length (default 8; 0: every window)")
    e.add_argument("--batch-size", type=int, default=1, metavar="B", help="ppl / kl windows per forward (default 1)")
    e.add_argument("--trials", type=int, default=2, metavar="N",
                   help="passkey / niah: prompts per length and depth (default 2)")
    e.add_argument("--template", default="prose", choices=["prose", "code"],
                   help="passkey / niah prompts: prose or code (for models trained on source code; default prose)")
    e.add_argument("--needles", type=int, default=4, metavar="N", help="niah: needles per prompt (default 4)")
    e.add_argument("--seed", type=int, default=0, help="seed of the retrieval and MQAR prompts (default 0)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    u = sub.add_parser("push", help="upload a converted folder to the Hub")
    u.add_argument("folder", help="the converted folder (OUT of convert)")
    u.add_argument("repo", help="Hub repo id (org/name); created if missing")
    u.add_argument("--private", action="store_true", help="create the repo private")
    d = sub.add_parser("demo", help="convert SmolLM2-135M to a family and compare generations with the dense model; "
                                    "keeps about 1 GB of checkpoints under ~/.cache/subquadratic")
    d.add_argument("--to", default="spla", choices=targets, help="target family (default spla)")
    d.add_argument("--prompt", default=None, help="the short prompt (default: a question about the sky)")
    d.add_argument("--max-new-tokens", type=int, default=40, help="tokens generated per case (default 40)")
    d.add_argument("--workdir", default=None,
                   help="where to keep the checkpoints (default ~/.cache/subquadratic, or $SUBQUADRATIC_CACHE)")
    s = sub.add_parser("serve", help="serve a model folder through Transformers' OpenAI-compatible server "
                                     "(chat and completions, streaming); needs subquadratic[serve]",
                       description="Run `transformers serve` on FOLDER with this package's model classes: "
                                   "POST /v1/chat/completions and /v1/completions (streaming or not), GET "
                                   "/v1/models and /health. Options after FOLDER go to `transformers serve` "
                                   "(--host, --port, --device, --dtype, --compile, ...; `subquadratic serve "
                                   "FOLDER --help` lists them).")
    s.add_argument("folder", metavar="FOLDER", help="model folder with tokenizer files (convert or adapt output)")
    s.add_argument("server_args", nargs=argparse.REMAINDER, metavar="...",
                   help="options of `transformers serve`, e.g. --port 8000 --host 127.0.0.1 --compile")
    return p


def _adapt_parser(sub) -> None:
    a = sub.add_parser("adapt", help="train a converted model: attention transfer from the dense teacher, then "
                                     "LM fine-tuning or distillation (accelerate launch for several GPUs)")
    a.add_argument("student", help="the converted folder (OUT of convert, or of an earlier adapt)")
    a.add_argument("--output-dir", "-o", required=True, help="where the adapted model, checkpoints and log go")
    a.add_argument("--data", nargs="+", required=True, metavar="PATH",
                   help="text / code / jsonl / json / parquet files, folders of them, or a cached Hub dataset")
    a.add_argument("--teacher", help="the dense source checkpoint (for attention transfer and --loss kl)")
    a.add_argument("--max-steps", type=int, default=1000, help="optimizer steps in all (default 1000)")
    a.add_argument("--stage1-steps", type=int, default=None,
                   help="attention-transfer steps at the start (default: a quarter of --max-steps, rounded up, with "
                        "--teacher, else 0)")
    a.add_argument("--loss", default="lm", choices=("lm", "kl"),
                   help="stage 2: next-token loss, or KL to the teacher's next-token distribution (default lm)")
    a.add_argument("--train", default="full", choices=("full", "mixer", "new", "lora"),
                   help="what trains: every parameter, the converted layers' mixers, only the parameters the "
                        "dense model lacks, or LoRA adapters + those (default full; stage 1 reaches only mixers)")
    a.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row (default 2048)")
    a.add_argument("--batch-size", type=int, default=8, help="rows per micro-batch and process (default 8)")
    a.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    a.add_argument("--lr", type=float, default=1e-4, help="stage 2 peak learning rate (default 1e-4)")
    a.add_argument("--stage1-lr", type=float, default=1e-3, help="stage 1 peak learning rate (default 1e-3)")
    a.add_argument("--warmup-ratio", type=float, default=0.05, help="warmup share of each stage (default 0.05)")
    a.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay of matrices (default 0)")
    a.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping, 0 = off (default 1)")
    a.add_argument("--mixed-precision", default="no", choices=("no", "bf16", "fp16"),
                   help="autocast precision (weights stay float32; default no)")
    a.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    a.add_argument("--lora-rank", type=int, default=16, help="LoRA rank with --train lora (default 16)")
    a.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha with --train lora (default 32)")
    a.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps (default 500)")
    a.add_argument("--save-total-limit", type=int, default=2, help="checkpoints kept (default 2)")
    a.add_argument("--keep-checkpoints", action="store_true", help="keep OUT/checkpoints after the run ends")
    a.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT")
    a.add_argument("--overwrite", action="store_true", help="start anew in a non-empty OUT")
    a.add_argument("--text-field", default="text", help="column holding the text in jsonl / parquet data")
    a.add_argument("--text-unit", default="document", choices=("document", "paragraph", "line"),
                   help="one document per text file, paragraph or line (default document)")
    a.add_argument("--num-proc", type=int, default=None, metavar="N",
                   help="processes that tokenise the data (default one; more for corpora of many MB)")
    a.add_argument("--eval-data", metavar="FILE",
                   help="held-out text evaluated at the end (perplexity, KL to --teacher) into OUT's model card")
    a.add_argument("--eval-seq-len", type=int, nargs="+", metavar="L",
                   help="context lengths of --eval-data (default: the SPLA budget and twice it, else 1024 2048)")
    a.add_argument("--eval-max-windows", type=int, default=8, metavar="N",
                   help="windows per length of --eval-data (default 8)")
    a.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    a.add_argument("--no-progress", action="store_true", help="no progress bar")


def _adapt(args) -> None:
    from .adaptation import AdaptConfig, adapt

    cfg = AdaptConfig(
        student=args.student, output_dir=args.output_dir, data=args.data, teacher=args.teacher,
        max_steps=args.max_steps, stage1_steps=args.stage1_steps, loss=args.loss, train=args.train,
        seq_len=args.seq_len, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
        stage1_lr=args.stage1_lr, warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, mixed_precision=args.mixed_precision,
        gradient_checkpointing=args.gradient_checkpointing, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        save_every=args.save_every, save_total_limit=args.save_total_limit, keep_checkpoints=args.keep_checkpoints,
        resume=args.resume, overwrite=args.overwrite, text_field=args.text_field, text_unit=args.text_unit,
        num_proc=args.num_proc, seed=args.seed, progress=not args.no_progress,
    )
    after_training = _adapt_card_evaluation(args) if args.eval_data else None
    print(f"wrote {adapt(cfg, after_training=after_training)}")


def _adapt_card_evaluation(args):
    """`adapt --eval-data`: the hook that measures the adapted folder's perplexity (with --teacher, also
    the teacher's and the KL to it) once training ends, and writes the table into its card."""
    _check_eval_data(args)

    def hook(out, device) -> None:
        from .evaluation import evaluate, evaluate_conversion, load_model, write_card_evaluation

        note = f"Measured by `subquadratic adapt --eval-data {args.eval_data}` at the end of the run."
        if args.teacher:
            results = evaluate_conversion(out, args.teacher, args.eval_data, seq_lens=args.eval_seq_len,
                                          max_windows=args.eval_max_windows, device=str(device), name=out.name)
        else:
            model, tokenizer = load_model(out, device=str(device))
            results = [evaluate(model, tokenizer, name=out.name, tasks=("ppl",), data=args.eval_data,
                                seq_lens=args.eval_seq_len or [args.seq_len], max_windows=args.eval_max_windows)]
        write_card_evaluation(out, results, note=note)

    return hook


def _check_eval_data(args) -> None:
    """The --eval-* flags of convert and adapt, checked before any work."""
    from pathlib import Path

    from .data import DataError
    from .evaluation import EvaluationError

    if not Path(args.eval_data).expanduser().is_file():
        raise DataError(f"--eval-data {args.eval_data} does not exist; give a .txt, .jsonl, .json or .parquet file")
    if args.eval_max_windows < 1 or any(L < 2 for L in args.eval_seq_len or []):
        raise EvaluationError("--eval-max-windows must be >= 1 and --eval-seq-len values >= 2")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _push_later(folder, repo: str, private: bool) -> str:
    return f"subquadratic push {folder} {repo}" + (" --private" if private else "")


def _push(folder, repo: str, private: bool) -> str:
    """Upload `folder`; a failure becomes a ConversionError saying the folder is complete and how to retry."""
    from .conversion import ConversionError, push_to_hub

    try:
        return push_to_hub(folder, repo, private=private)
    except Exception as e:  # network, credentials, permissions: the folder itself is complete
        raise ConversionError(
            f"could not push to {repo} ({type(e).__name__}: {_one_line(e)[:200]}); the converted folder is "
            f"complete at {folder}; log in (hf auth login) or restore the network, then run: "
            f"{_push_later(folder, repo, private)}"
        ) from None


def _convert(parser, args) -> None:
    from .conversion import ConversionError, convert

    options = {}
    for fam, dests in parser.family_dests.items():
        for flag, dest, option in dests:
            value = getattr(args, dest)
            if value is None:
                continue
            if fam != parser.target_family[args.to]:
                raise ConversionError(f"{flag} is an option of --to {fam}, not --to {args.to}")
            options[option] = value
    if args.private and not args.push_to_hub:
        raise ConversionError("--private applies to --push-to-hub REPO; add it or drop --private")
    before_finish = None
    if args.eval_data:
        before_finish = _card_evaluation(args)
    out = convert(args.src, args.out, args.to, options=options, dtype=args.dtype,
                  overwrite=args.overwrite, progress=not args.no_progress, before_finish=before_finish)
    print(f"wrote {out}")
    if args.push_to_hub:
        print(f"pushed to {_push(out, args.push_to_hub, args.private)}")


def _card_evaluation(args):
    """`convert --eval-data`: the hook that evaluates the finished temporary folder and writes its card."""
    _check_eval_data(args)

    def hook(folder, src_folder) -> None:
        from .evaluation import evaluate_conversion, markdown_table, write_card_evaluation

        if args.no_progress:
            from transformers.utils import logging

            logging.disable_progress_bar()

        results = evaluate_conversion(folder, src_folder, args.eval_data, seq_lens=args.eval_seq_len,
                                      max_windows=args.eval_max_windows, device=args.eval_device,
                                      progress=not args.no_progress)
        write_card_evaluation(folder, results)
        print(markdown_table(results))

    return hook


def _eval(args) -> None:
    from pathlib import Path

    from .data import DataError
    from .evaluation import (
        EvaluationError,
        evaluate,
        load_model,
        markdown_table,
        plot_results,
        write_card_evaluation,
        write_json,
    )
    from .evaluation.suite import check_tasks, resolve_device

    tasks = check_tasks((args.tasks or "ppl,passkey,niah,mqar" + (",kl" if args.reference else "")).split(","))
    if args.max_windows < 0 or args.batch_size < 1 or args.trials < 1 or args.needles < 1:
        raise EvaluationError("--max-windows must be >= 0 and --batch-size, --trials, --needles >= 1")
    if args.reference and "kl" not in tasks:
        raise EvaluationError("--reference is used by task kl only; add kl to --tasks or drop --reference")
    for m in args.models:
        if not (Path(m).expanduser() / "config.json").is_file():
            raise EvaluationError(f"{m} is not a checkpoint folder (no config.json); give local folders")
    if args.data and not Path(args.data).expanduser().is_file():
        raise DataError(f"--data {args.data} does not exist; give a .txt, .jsonl, .json or .parquet file")
    if args.plot_dir:
        from .evaluation.report import require_matplotlib

        require_matplotlib()  # fail before the work, not after it
    resolve_device(args.device)
    if args.no_progress:
        from transformers.utils import logging

        logging.disable_progress_bar()
    reference = None
    if "kl" in tasks:
        if not args.reference:
            raise EvaluationError("task kl needs a reference model: pass --reference DIR (the dense source)")
        reference, _ = load_model(args.reference, device=args.device, dtype=args.dtype)
    results = []
    for m in args.models:
        model, tokenizer = load_model(m, device=args.device, dtype=args.dtype)
        results.append(evaluate(
            model, tokenizer, name=m, tasks=tasks, seq_lens=args.seq_len, data=args.data, reference=reference,
            max_windows=args.max_windows or None, batch_size=args.batch_size, trials=args.trials,
            template=args.template, num_needles=args.needles, text_field=args.text_field, seed=args.seed,
            progress=not args.no_progress,
        ))
        del model
    print(markdown_table(results))
    if args.json:
        print(f"wrote {write_json(results, args.json)}")
    if args.plot_dir:
        for path in plot_results(results, args.plot_dir):
            print(f"wrote {path}")
    if args.card:
        for r in results:  # the card names the model by its folder
            print(f"wrote {write_card_evaluation(r['model'], {**r, 'model': Path(r['model']).name})}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .conversion import ConversionError  # imports torch: only once a command runs
    from .evaluation import EvaluationError

    try:
        if args.command == "convert":
            _convert(parser, args)
        elif args.command == "adapt":
            _adapt(args)
        elif args.command == "eval":
            _eval(args)
        elif args.command == "push":
            from pathlib import Path

            folder = Path(args.folder)
            if not (folder / "config.json").is_file():
                raise ConversionError(f"{folder} has no config.json; give the folder that convert wrote")
            print(f"pushed to {_push(folder, args.repo, args.private)}")
        elif args.command == "demo":
            from .demo import run_demo

            run_demo(to=args.to, prompt=args.prompt, max_new_tokens=args.max_new_tokens, workdir=args.workdir)
        elif args.command == "serve":
            from .serving import main as serve_main

            return serve_main(args.folder, args.server_args)
    except (ConversionError, EvaluationError) as e:
        print(f"subquadratic: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except ValueError as e:  # AdaptError, DataError: bad settings or data
        from .adaptation import AdaptError
        from .data import DataError

        if not isinstance(e, AdaptError | DataError):
            raise
        print(f"subquadratic: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, permissions: nothing was left half-written (convert writes atomically)
        print(f"subquadratic: error: {_one_line(e)}; check the path, its permissions and free space", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
