"""The `subquadratic` command line: `convert` a dense checkpoint, `adapt` a converted one (attention
transfer and fine-tuning or distillation), `push` a folder to the Hub, `demo` the embedded default.

Each family's `convert` options come from its registration (`registry.Family.options`) and are
spelled `--<family prefix>-<option>` (`--spla-top-k-blocks`, `--sse-top-k`, `--hla-softmax-every`).
Every failure is one line on stderr naming the problem and what to do, with exit status 2; torch and
the model code are imported only once a command runs, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import sys

from .families import convert_targets

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the problem and where help is), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="subquadratic", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="{convert,adapt,push,demo}")
    flags = convert_targets()
    targets = sorted(flags)
    c = sub.add_parser("convert", help="convert a dense Llama/Mistral/Qwen2/Qwen3 checkpoint")
    c.add_argument("src", help="source checkpoint folder (safetensors) or Hub id (org/name)")
    c.add_argument("out", help="output folder (written atomically: complete or absent)")
    c.add_argument("--to", required=True, choices=targets, help="target family")
    c.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="dtype of the written weights: auto keeps the source's, or cast floating-point "
                        "weights to float32, bfloat16 or float16 (default auto)")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    c.add_argument("--push-to-hub", metavar="REPO", help="then upload OUT to this Hub repo (org/name)")
    c.add_argument("--private", action="store_true", help="create the Hub repo private (with --push-to-hub)")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.family_dests = {}
    for name, options in flags.items():
        group = c.add_argument_group(f"{name} options (--to {name})")
        p.family_dests[name] = []
        for flag, kw in options.items():
            kw = dict(kw)
            option = kw.pop("dest")  # the name `convert` receives; argparse's dest is unique per family
            if "choices" not in kw and kw.get("action") is None:
                kw.setdefault("metavar", option.upper())
            p.family_dests[name].append((flag, group.add_argument(flag, dest=f"{name}.{option}", **kw).dest, option))
    _adapt_parser(sub)
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
        seed=args.seed, progress=not args.no_progress,
    )
    print(f"wrote {adapt(cfg)}")


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
            if fam != args.to:
                raise ConversionError(f"{flag} is an option of --to {fam}, not --to {args.to}")
            options[option] = value
    if args.private and not args.push_to_hub:
        raise ConversionError("--private applies to --push-to-hub REPO; add it or drop --private")
    out = convert(args.src, args.out, args.to, options=options, dtype=args.dtype,
                  overwrite=args.overwrite, progress=not args.no_progress)
    print(f"wrote {out}")
    if args.push_to_hub:
        print(f"pushed to {_push(out, args.push_to_hub, args.private)}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .conversion import ConversionError  # imports torch: only once a command runs
    from .families import register_builtin

    register_builtin()

    try:
        if args.command == "convert":
            _convert(parser, args)
        elif args.command == "adapt":
            _adapt(args)
        elif args.command == "push":
            from pathlib import Path

            folder = Path(args.folder)
            if not (folder / "config.json").is_file():
                raise ConversionError(f"{folder} has no config.json; give the folder that convert wrote")
            print(f"pushed to {_push(folder, args.repo, args.private)}")
        elif args.command == "demo":
            from .demo import run_demo

            run_demo(to=args.to, prompt=args.prompt, max_new_tokens=args.max_new_tokens, workdir=args.workdir)
    except ConversionError as e:
        print(f"subquadratic: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except ValueError as e:  # AdaptError, DataError: bad settings or data
        from .adaptation import AdaptError, DataError

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
