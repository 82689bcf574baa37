"""The `subquadratic` command line: `convert` a dense checkpoint, `adapt` a converted one (attention
transfer, then distillation or fine-tuning), `eval` models, `push` a folder to the Hub, `demo` the
embedded default.

Each family's `convert` options come from its declaration (`registry.Family.options`) and are
spelled `--<family prefix>-<option>` (`--spla-top-k-blocks`, `--sse-top-k`, `--hla-softmax-every`);
`--to` takes a family's name or one of its convert presets (`sse-h`, `hla-h`).

Every failure is one line on stderr, `subquadratic COMMAND: error: ...` (the problem and what to do),
with exit status 2. What can be checked without a model (option values, paths, folders, Hub ids, the
teacher a loss needs) is checked before torch or Transformers are imported, so such a mistake is
reported at once, as is `--help`; an unknown option gets the nearest real one ("did you mean
--spla-block-size"), the old unprefixed family options (`--block-size`) included, and a mistyped
choice the nearest value (family names are read in any case: `--to SPLA`). Ctrl-C is one line too
(what the command leaves), exit status 130. A source without tokenizer files converts, with one
warning line; the commands that tokenize (`serve`, `eval`, `adapt`) refuse such a folder in one line.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
import sys
import warnings

from . import checks
from .checks import int_at_least, nonnegative_int, positive_int
from .data import DTYPE_CHOICES
from .families import convert_targets, converted_model_types

#: evaluation.suite.TASKS and DEFAULT_LENGTHS, readable without torch (a test keeps them equal)
EVAL_TASKS = ("ppl", "passkey", "niah", "mv-niah", "vt", "copy", "mqar", "kl")
EVAL_LENGTHS = (1024, 2048)
#: `eval`'s defaults of --max-windows, --trials and --mqar-examples: with them and EVAL_LENGTHS one 135M
#: model against a reference (--data, --reference) forwards 86,016 tokens, timed as EVAL_MEASURED says
#: (docs/benchmarks.md, "CPU")
EVAL_MAX_WINDOWS, EVAL_TRIALS, EVAL_MQAR_EXAMPLES = 4, 1, 4
EVAL_MEASURED = ("3 min 42 s for SmolLM2-135M on this project's quiet 2-core CPU (399 tokens/s; 15 min 17 s "
                 "while two other jobs shared it)")
context_length = int_at_least(2, "L")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the problem and where help is), not the usage block."""

    def error(self, message: str):
        if m := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message):
            near = difflib.get_close_matches(m.group(1).lower(), re.findall(r"'([^']*)'", m.group(2)), n=1)
            message += f": did you mean {near[0]!r}?" if near else ""
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def family_name(text: str) -> str:
    """An argparse type: a family or preset name in any case (`--to SPLA` is `--to spla`)."""
    return text.lower()


class InputProblem(Exception):
    """A problem found before any work: printed like the commands' own input errors."""


def _check(problem: str | None) -> None:
    if problem is not None:
        raise InputProblem(problem)


def _description(doc: str) -> str:
    """The first paragraph of a docstring, as one line."""
    return " ".join(doc.split("\n\n")[0].split())


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="subquadratic", description=_description(__doc__))
    sub = p.add_subparsers(dest="command", required=True)
    p.commands = sub.choices  # name -> subparser, for the errors of each command
    families = convert_targets()
    p.target_family = {t: name for name, (_, presets) in families.items() for t in (name, *presets)}
    targets = sorted(p.target_family)
    c = sub.add_parser("convert", help="convert a dense Llama/Mistral/Qwen2/Qwen3 checkpoint")
    c.add_argument("src", help="source checkpoint: a folder (safetensors), a .gguf file, or a Hub id (org/name)")
    c.add_argument("out", help="output folder (written atomically: complete or absent)")
    presets = sorted(set(targets) - set(families))
    c.add_argument("--to", required=True, choices=targets, type=family_name, metavar="{" + ",".join(targets) + "}",
                   help="target family" + (f", or a convert preset of one ({', '.join(presets)})" if presets else ""))
    c.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="dtype of the written weights: auto keeps the source's (float32 for a GGUF source), or "
                        "cast floating-point weights to float32, bfloat16 or float16 (default auto)")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    c.add_argument("--push-to-hub", metavar="REPO", help="then upload OUT to this Hub repo (org/name)")
    c.add_argument("--private", action="store_true", help="create the Hub repo private (with --push-to-hub)")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.add_argument("--eval-data", metavar="FILE",
                   help="then measure perplexity (output and source) and next-token KL to the source on this "
                        "held-out .txt/.jsonl/.json/.parquet file and write the table into the output's card")
    c.add_argument("--eval-seq-len", type=context_length, nargs="+", metavar="L",
                   help="context lengths of --eval-data (default: the budget and twice it for SPLA, else 1024 "
                        "and 2048, capped at the model's max_position_embeddings)")
    c.add_argument("--eval-max-windows", type=positive_int, default=8, metavar="N",
                   help="windows per length of --eval-data (default 8)")
    c.add_argument("--eval-device", default="cpu", metavar="DEVICE",
                   help="device of --eval-data: cpu, cuda, cuda:N or auto "
                                                        "(default cpu)")
    c.add_argument("--calibration-data", nargs="+", metavar="PATH",
                   help="with --<family>-softmax-layers auto:K: the text of the short attention transfer that "
                        "prices each layer (default: CPython's English documentation topics)")
    c.add_argument("--calibration-steps", type=int, metavar="N",
                   help="steps of that attention transfer (default 40, of 4 rows of 1024 tokens)")
    p.family_dests = {}
    for name, (options, presets) in families.items():
        flag_of = {kw["dest"]: flag for flag, kw in options.items()}
        said = "".join(f"; --to {p}: " + ", ".join(f"{flag_of.get(k, k)} {v}" for k, v in kw.items())
                       for p, kw in presets.items())
        group = c.add_argument_group(f"{name} options (--to {name}{said})")
        p.family_dests[name] = []
        for flag, kw in options.items():
            kw = dict(kw)
            option = kw.pop("dest")  # the name `convert` receives; argparse's dest is unique per family
            if "choices" not in kw and kw.get("action") is None:
                kw.setdefault("metavar", getattr(kw.get("type"), "metavar", "VALUE"))
            p.family_dests[name].append((flag, group.add_argument(flag, dest=f"{name}.{option}", **kw).dest, option))
    _adapt_parser(sub)
    e = sub.add_parser("eval", help="perplexity, passkey, needles, variable tracking, copying, MQAR and KL of "
                                    "one or more models",
                       description="Evaluate checkpoint folders (dense or converted): one progress bar over the "
                                   "whole run, a table, and on request JSON (written after each task), one PNG "
                                   "per metric with a line per model, and the model cards' Evaluation section. "
                                   "With the defaults one 135M model against a --reference, with --data, "
                                   f"forwards 86k tokens: {EVAL_MEASURED}. The bar's estimate of the time left "
                                   "covers the whole run. A task is left out at the lengths too short for it, "
                                   "and one line says so.")
    e.add_argument("models", nargs="+", metavar="MODEL", help="checkpoint folder(s) with tokenizer files")
    e.add_argument("--data", metavar="FILE", help="held-out .txt/.jsonl/.json/.parquet file (tasks ppl, kl, copy)")
    e.add_argument("--text-field", default="text", metavar="NAME",
                   help="column of --data holding the text (default text)")
    e.add_argument("--seq-len", type=context_length, nargs="+", default=list(EVAL_LENGTHS), metavar="L",
                   help=f"context lengths (default {' '.join(map(str, EVAL_LENGTHS))})")
    e.add_argument("--tasks", default=None, metavar="LIST",
                   help=f"comma list from {','.join(EVAL_TASKS)} (default: passkey,niah,mqar, plus ppl with "
                        "--data and kl with --reference)")
    e.add_argument("--reference", metavar="DIR", help="dense reference folder for kl (same tokenizer)")
    e.add_argument("--json", metavar="FILE", help="write every result to this JSON file, after each task")
    e.add_argument("--plot-dir", metavar="DIR",
                   help="write one PNG per metric into this folder, a line per MODEL")
    e.add_argument("--card", action="store_true",
                   help="write the table into each MODEL's README.md card (its ## Evaluation section)")
    e.add_argument("--device", default="auto", metavar="DEVICE", help="cpu, cuda, cuda:N or auto (default auto)")
    e.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="weights dtype (default: the folder's)")
    e.add_argument("--max-windows", type=nonnegative_int, default=EVAL_MAX_WINDOWS, metavar="N",
                   help=f"ppl / kl: at most N windows per length (default {EVAL_MAX_WINDOWS}; 0: every window)")
    e.add_argument("--batch-size", type=positive_int, default=1, metavar="B",
                   help="ppl / kl windows per forward (default 1)")
    e.add_argument("--trials", type=positive_int, default=EVAL_TRIALS, metavar="N",
                   help=f"passkey / niah / mv-niah / vt: prompts per length and depth (3 depths; default "
                        f"{EVAL_TRIALS})")
    e.add_argument("--template", default="prose", choices=["prose", "code"],
                   help="retrieval prompts: prose or code (for models trained on source code; default prose)")
    e.add_argument("--needles", type=int_at_least(1), default=4, metavar="N",
                   help="niah / mv-niah: needles (keys, or one key's values) per prompt, 1 to 16 (default 4)")
    e.add_argument("--mqar-examples", type=positive_int, default=EVAL_MQAR_EXAMPLES, metavar="N",
                   help=f"mqar: sequences per length (default {EVAL_MQAR_EXAMPLES})")
    e.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the retrieval and MQAR prompts (default 0)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    u = sub.add_parser("push", help="upload a converted folder to the Hub")
    u.add_argument("folder", help="the converted folder (OUT of convert)")
    u.add_argument("repo", help="Hub repo id (org/name); created if missing")
    u.add_argument("--private", action="store_true", help="create the repo private")
    d = sub.add_parser("demo", help="convert SmolLM2-135M to a family and compare generations with the dense model "
                                    "(3 to 8 minutes on a 2-core CPU); keeps about 0.55 GB of checkpoints per model "
                                    "under ~/.cache/subquadratic")
    d.add_argument("--to", default="spla", choices=targets, type=family_name, metavar="{" + ",".join(targets) + "}",
                   help="target family (default spla)")
    d.add_argument("--prompt", default=None, metavar="TEXT",
                   help="the short prompt (default: a question about the sky)")
    d.add_argument("--max-new-tokens", type=positive_int, default=40, metavar="N",
                   help="tokens generated per case (default 40)")
    d.add_argument("--workdir", default=None, metavar="DIR",
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
                                     "distillation or LM fine-tuning (accelerate launch for several GPUs)")
    a.add_argument("student", help="the converted folder (OUT of convert, or of an earlier adapt)")
    a.add_argument("--output-dir", "-o", required=True, metavar="DIR",
                   help="where the adapted model, checkpoints and log go")
    a.add_argument("--data", nargs="+", required=True, metavar="PATH",
                   help="text / code / jsonl / json / parquet files, folders of them, or a cached Hub dataset")
    a.add_argument("--teacher", metavar="DIR",
                   help="the dense source checkpoint (for attention transfer and --loss kl)")
    a.add_argument("--max-steps", type=positive_int, default=1000, metavar="N",
                   help="optimizer steps in all (default 1000)")
    a.add_argument("--stage1-steps", type=nonnegative_int, default=None, metavar="N",
                   help="attention-transfer steps at the start (default: a quarter of --max-steps, rounded up, with "
                        "--teacher, else 0)")
    a.add_argument("--loss", default=None, choices=("lm", "kl"),
                   help="stage 2: KL to the teacher's next-token distribution, or next-token loss (default kl with "
                        "--teacher, else lm)")
    a.add_argument("--train", default="full", choices=("full", "mixer", "new", "lora"),
                   help="what trains: every parameter, the converted layers' mixers, only the parameters the "
                        "dense model lacks, or LoRA adapters + those (default full; stage 1 reaches only mixers)")
    a.add_argument("--seq-len", type=context_length, default=None, metavar="L",
                   help="tokens per packed row (default 8192, or the model's context if shorter)")
    a.add_argument("--stage1-seq-len", type=context_length, default=None, metavar="L",
                   help="tokens per packed row in attention transfer (default --seq-len), with --batch-size x "
                        "--seq-len / L rows per batch: the same tokens per step")
    a.add_argument("--batch-size", type=positive_int, default=None, metavar="B",
                   help="rows per micro-batch and process (default 16384 / --seq-len: 2 rows of 8192)")
    a.add_argument("--grad-accum", type=positive_int, default=1, metavar="N",
                   help="micro-batches per optimizer step (default 1)")
    a.add_argument("--lr", type=float, default=1e-4, metavar="LR", help="stage 2 peak learning rate (default 1e-4)")
    a.add_argument("--stage1-lr", type=float, default=1e-3, metavar="LR",
                   help="stage 1 peak learning rate (default 1e-3)")
    a.add_argument("--new-lr-scale", type=float, default=1.0, metavar="X",
                   help="learning rates of the parameters the dense model lacks (SPLA's residual gain, the state "
                        "mixers' router, gates and decays) at X times the others' (default 1)")
    a.add_argument("--recall-share", type=float, default=0.0, metavar="F",
                   help="share of the rows made recall rows: passages of the row copied further on, at distances "
                        "up to the row's length, so that the student learns to copy from far back where the "
                        "teacher does (default 0)")
    a.add_argument("--warmup-ratio", type=float, default=0.05, metavar="R",
                   help="warmup share of each stage (default 0.05)")
    a.add_argument("--weight-decay", type=float, default=0.0, metavar="W",
                   help="AdamW weight decay of matrices (default 0)")
    a.add_argument("--max-grad-norm", type=float, default=1.0, metavar="NORM",
                   help="gradient clipping, 0 = off (default 1)")
    a.add_argument("--mixed-precision", default="no", choices=("no", "bf16", "fp16"),
                   help="autocast precision (weights stay float32; default no)")
    a.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    a.add_argument("--lora-rank", type=positive_int, default=16, metavar="R",
                   help="LoRA rank with --train lora (default 16)")
    a.add_argument("--lora-alpha", type=float, default=32.0, metavar="ALPHA",
                   help="LoRA alpha with --train lora (default 32)")
    a.add_argument("--save-every", type=positive_int, default=500, metavar="N",
                   help="checkpoint every N steps (default 500)")
    a.add_argument("--save-total-limit", type=positive_int, default=2, metavar="N",
                   help="checkpoints kept (default 2)")
    a.add_argument("--keep-checkpoints", action="store_true", help="keep OUT/checkpoints after the run ends")
    a.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT")
    a.add_argument("--overwrite", action="store_true", help="start anew in a non-empty OUT")
    a.add_argument("--text-field", default="text", metavar="NAME",
                   help="column holding the text in jsonl / parquet data")
    a.add_argument("--text-unit", default="document", choices=("document", "paragraph", "line"),
                   help="one document per text file, paragraph or line (default document)")
    a.add_argument("--num-proc", type=positive_int, default=None, metavar="N",
                   help="processes that tokenise the data (default one; more for corpora of many MB)")
    a.add_argument("--eval-data", metavar="FILE",
                   help="held-out text evaluated at the end (perplexity, KL to --teacher) into OUT's model card")
    a.add_argument("--eval-seq-len", type=context_length, nargs="+", metavar="L",
                   help="context lengths of --eval-data (default: the SPLA budget and twice it, else 1024 2048)")
    a.add_argument("--eval-max-windows", type=positive_int, default=8, metavar="N",
                   help="windows per length of --eval-data (default 8)")
    a.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    a.add_argument("--no-progress", action="store_true", help="no progress bar")


# --- what is checked before the heavy imports ----------------------------------------------------


def _family_options(parser, args) -> dict:
    """The family options given to `convert`: {option: value}; one of another family is refused."""
    options = {}
    for fam, dests in parser.family_dests.items():
        for flag, dest, option in dests:
            value = getattr(args, dest)
            if value is None:
                continue
            if fam != parser.target_family[args.to]:
                raise InputProblem(f"{flag} is an option of --to {fam}, not --to {args.to}")
            options[option] = value
    return options


def _precheck(parser, args) -> None:
    """Every check of `args` that needs no model (no torch, no Transformers)."""
    if args.command == "convert":
        options = _family_options(parser, args)
        if (args.calibration_data or args.calibration_steps is not None) and \
                not str(options.get("softmax_layers", "")).startswith(checks.LAYER_CHOICE_METHODS):
            raise InputProblem("--calibration-data / --calibration-steps price the layers of a "
                               "--<family>-softmax-layers auto:K layout; add one or drop them")
        if args.private and not args.push_to_hub:
            raise InputProblem("--private applies to --push-to-hub REPO; add it or drop --private")
        if args.push_to_hub:
            _check(checks.repo_id_problem(args.push_to_hub, "--push-to-hub"))
        _check(checks.source_problem(args.src))
        _check(checks.output_problem(args.out, args.overwrite, args.src))
        _check(checks.file_problem(args.eval_data, "--eval-data"))
        _check(checks.device_problem(args.eval_device))
    elif args.command == "adapt":
        _check(checks.adapt_problem(args, converted_model_types()))
        _check(checks.file_problem(args.eval_data, "--eval-data"))
    elif args.command == "eval":
        _eval_tasks(args)
        for m in args.models:
            _check(checks.checkpoint_problem(m))
        if args.reference:
            _check(checks.checkpoint_problem(args.reference, "--reference"))
        _check(checks.file_problem(args.data, "--data"))
        _check(checks.device_problem(args.device))
        if args.needles > 16:  # evaluation.retrieval.KEYS
            raise InputProblem(f"--needles must be in 1..16, got {args.needles}")
        if args.plot_dir:
            import importlib.util

            if importlib.util.find_spec("matplotlib") is None:
                raise InputProblem("--plot-dir needs matplotlib: pip install matplotlib (or pip install "
                                   "'subquadratic[eval]'), or leave out --plot-dir")
        for m in args.models:  # last: a folder may lack only its tokenizer (converted from weights alone)
            _check(checks.tokenizer_problem(m))
    elif args.command == "push":
        _check(checks.checkpoint_problem(args.folder, "folder"))
        _check(checks.repo_id_problem(args.repo))


def _eval_tasks(args) -> list[str]:
    """The tasks of `eval`: --tasks as given, checked; by default passkey, niah and mqar, with ppl when
    --data is given and kl when --reference is."""
    if args.tasks is None:
        return (["ppl"] if args.data else []) + ["passkey", "niah", "mqar"] + (["kl"] if args.reference else [])
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in EVAL_TASKS]
    if bad or not tasks:
        raise InputProblem(f"unknown task(s) {', '.join(bad) or '(none)'}; choose from {','.join(EVAL_TASKS)}")
    if {"ppl", "kl", "copy"} & set(tasks) and not args.data:
        raise InputProblem("tasks ppl, kl and copy need held-out text: pass --data FILE")
    if "kl" in tasks and not args.reference:
        raise InputProblem("task kl needs a reference model: pass --reference DIR (the dense source)")
    if args.reference and "kl" not in tasks:
        raise InputProblem("--reference is used by task kl only; add kl to --tasks or drop --reference")
    return tasks


def _unknown_option(parser, args, extras: list[str]) -> str:
    """The message for arguments argparse did not recognise: the nearest real option where there is
    one (an old family option without its prefix, `--block-size`, gets `--spla-block-size`)."""
    word = next((a.split("=")[0] for a in extras if a.startswith("-")), None)
    if word is None:
        return f"unrecognized arguments: {' '.join(extras)}"
    command = parser.commands[args.command]
    flags = [s for a in command._actions for s in a.option_strings if s.startswith("--")]
    renamed = []
    if args.command == "convert":
        target = parser.target_family.get(getattr(args, "to", None))
        renamed = [flag for fam, dests in parser.family_dests.items() for flag, _, _ in dests
                   if flag.endswith("-" + word.lstrip("-")) and flag.startswith(f"--{fam}-")
                   and fam == (target or fam)]
    near = renamed or difflib.get_close_matches(word, flags, n=2, cutoff=0.6)
    if not near:
        return f"unrecognized argument {word}"
    said = " or ".join(near)
    if renamed:
        return f"unrecognized argument {word}: did you mean {said}? (family options carry the family's prefix)"
    return f"unrecognized argument {word}: did you mean {said}?"


# --- the commands -----------------------------------------------------------------------------------


def _adapt(args) -> None:
    from .adaptation import AdaptConfig, adapt

    cfg = AdaptConfig(
        student=args.student, output_dir=args.output_dir, data=args.data, teacher=args.teacher,
        max_steps=args.max_steps, stage1_steps=args.stage1_steps, loss=args.loss, train=args.train,
        seq_len=args.seq_len, stage1_seq_len=args.stage1_seq_len, batch_size=args.batch_size,
        grad_accum=args.grad_accum, lr=args.lr, stage1_lr=args.stage1_lr, new_lr_scale=args.new_lr_scale,
        recall_share=args.recall_share, warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, mixed_precision=args.mixed_precision,
        gradient_checkpointing=args.gradient_checkpointing, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        save_every=args.save_every, save_total_limit=args.save_total_limit, keep_checkpoints=args.keep_checkpoints,
        resume=args.resume, overwrite=args.overwrite, text_field=args.text_field, text_unit=args.text_unit,
        num_proc=args.num_proc, seed=args.seed, progress=not args.no_progress,
    )
    after_training = _adapt_card_evaluation(args, cfg) if args.eval_data else None
    print(f"wrote {adapt(cfg, after_training=after_training)}")


def _adapt_card_evaluation(args, cfg):
    """`adapt --eval-data`: the hook that measures the adapted folder's perplexity (with --teacher, also
    the teacher's and the KL to it) once training ends, and writes the table into its card."""

    def hook(out, device) -> None:
        from .evaluation import evaluate, evaluate_conversion, load_model, write_card_evaluation

        note = f"Measured by `subquadratic adapt --eval-data {args.eval_data}` at the end of the run."
        if args.teacher:
            results = evaluate_conversion(out, args.teacher, args.eval_data, seq_lens=args.eval_seq_len,
                                          max_windows=args.eval_max_windows, device=str(device), name=out.name)
        else:
            model, tokenizer = load_model(out, device=str(device))
            results = [evaluate(model, tokenizer, name=out.name, tasks=("ppl",), data=args.eval_data,
                                seq_lens=args.eval_seq_len or [cfg.seq_len], max_windows=args.eval_max_windows)]
        write_card_evaluation(out, results, note=note)

    return hook


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


def _flags_for_fields(parser, args, message: str) -> str:
    """A config error of `convert` with the target family's field names spelled as its flags
    ("top_k_blocks (2) is smaller ..." -> "--spla-top-k-blocks (2) is smaller ...")."""
    for flag, _, option in parser.family_dests[parser.target_family[args.to]]:
        message = re.sub(rf"(?<![\w-]){re.escape(option)}(?![\w-])", flag, message)
    return message


def _convert(parser, args, command: str) -> None:
    from .conversion import ConversionError, ConversionWarning
    from .layer_choice import Calibration, convert

    options = _family_options(parser, args)
    calibration = None
    if args.calibration_data or args.calibration_steps is not None:
        calibration = Calibration(data=args.calibration_data, device="auto",
                                  **({} if args.calibration_steps is None else {"steps": args.calibration_steps}))
    before_finish = _card_evaluation(args) if args.eval_data else None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConversionWarning)
            out = convert(args.src, args.out, args.to, options=options, dtype=args.dtype,
                          overwrite=args.overwrite, progress=not args.no_progress, before_finish=before_finish,
                          command=command, calibration=calibration)
    except ConversionError as e:
        raise ConversionError(_flags_for_fields(parser, args, str(e))) from None
    for w in caught:  # the conversion's own warnings as one line each; any other as Python shows it
        if issubclass(w.category, ConversionWarning):
            print(f"subquadratic convert: warning: {_one_line(w.message)}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    print(f"wrote {out}")
    if args.push_to_hub:
        print(f"pushed to {_push(out, args.push_to_hub, args.private)}")


def _card_evaluation(args):
    """`convert --eval-data`: the hook that evaluates the finished temporary folder and writes its card."""

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

    from tqdm.auto import tqdm

    from .data import load_stream
    from .evaluation import (
        EvaluationError,
        evaluate,
        load_model,
        markdown_table,
        plot_results,
        position_table,
        write_card_evaluation,
        write_json,
    )
    from .evaluation.suite import load_tokenizer, plan, resolve_device, skipped_line

    tasks = _eval_tasks(args)
    resolve_device(args.device)
    if args.no_progress:
        from transformers.utils import logging

        logging.disable_progress_bar()
    settings = dict(max_windows=args.max_windows or None, trials=args.trials, template=args.template,
                    num_needles=args.needles, mqar_examples=args.mqar_examples)
    work, skipped = [], {}  # per model: (tokenizer, token stream, jobs); what is left out, why
    for m in args.models:  # the plan of the whole run, from the tokenizers alone
        tokenizer = load_tokenizer(m)
        stream = load_stream(args.data, tokenizer, args.text_field) if {"ppl", "kl"} & set(tasks) else None
        jobs, left_out = plan(tokenizer, tasks, args.seq_len, stream_tokens=None if stream is None else stream.numel(),
                              **settings)
        work.append((stream, jobs))
        skipped.update(left_out)
    if args.tasks is None and not args.data:
        skipped = {"ppl": "(needs --data)", **skipped}
    planned = {j.task for _, jobs in work for j in jobs}
    asked = [t for t in tasks if t not in planned]
    if asked and (args.tasks is not None or not planned):  # a task asked for that runs nowhere
        raise EvaluationError(f"every length is too short for {', '.join(asked)}: {skipped_line(skipped)}; "
                              "add a longer --seq-len or leave the task out of --tasks")
    if skipped:
        print(skipped_line(skipped), file=sys.stderr)
    reference = None
    if "kl" in tasks:
        reference, _ = load_model(args.reference, device=args.device, dtype=args.dtype)
    results: list[dict] = []
    running: list[dict] = []  # the result of the model being evaluated, as far as it got

    def save(partial: dict) -> None:  # after each task at each length
        partial["settings"]["data"] = args.data
        running[:] = [partial]
        if args.json:
            write_json([*results, partial], args.json)

    bar = tqdm(total=sum(j.tokens for _, jobs in work for j in jobs), desc="eval", unit="tok", unit_scale=True,
               disable=args.no_progress)
    try:
        for m, (stream, _) in zip(args.models, work, strict=True):
            model, tokenizer = load_model(m, device=args.device, dtype=args.dtype)
            running.clear()
            results.append(evaluate(model, tokenizer, name=m, tasks=tasks, seq_lens=args.seq_len, data=stream,
                                    reference=reference, batch_size=args.batch_size, seed=args.seed,
                                    progress=bar, on_result=save, **settings))
            running.clear()
            del model
    except BaseException:  # an error or an interruption: what was measured is shown, and kept in --json
        bar.close()
        done = [*results, *running]
        if done:
            print(markdown_table(done))
            if args.json:
                print(f"kept in {args.json}: every task finished before the run stopped")
        raise
    bar.close()
    print(markdown_table(results))
    if positions := position_table(results):
        print("\nBy position in the window:\n" + positions)
    if args.json:
        print(f"wrote {args.json}")
    if args.plot_dir:
        for path in plot_results(results, args.plot_dir):
            print(f"wrote {path}")
    if args.card:
        for r in results:  # the card names the model by its folder
            print(f"wrote {write_card_evaluation(r['model'], {**r, 'model': Path(r['model']).name})}")


#: what a command leaves when Ctrl-C stops it
INTERRUPTED = {
    "convert": "nothing was written (the temporary folder is removed; an existing OUT is untouched)",
    "adapt": "the checkpoints already saved in --output-dir stay; --resume continues from the latest",
    "eval": "the results above are every task that finished (kept in --json where given)",
    "push": "the upload stopped; run the same command again to finish it",
    "demo": "the checkpoints already written stay in the work folder and are reused next time",
}


def _fail(command: str | None, message: str) -> int:
    print(f"subquadratic{' ' + command if command else ''}: error: {_one_line(message)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        parser.commands[args.command].error(_unknown_option(parser, args, extras))
    try:
        _precheck(parser, args)
    except InputProblem as e:
        return _fail(args.command, str(e))
    from .checks import InputError

    try:
        if args.command == "convert":
            _convert(parser, args, shlex.join(["subquadratic", *argv]))
        elif args.command == "adapt":
            _adapt(args)
        elif args.command == "eval":
            _eval(args)
        elif args.command == "push":
            from pathlib import Path

            print(f"pushed to {_push(Path(args.folder), args.repo, args.private)}")
        elif args.command == "demo":
            from .demo import run_demo

            run_demo(to=args.to, prompt=args.prompt, max_new_tokens=args.max_new_tokens, workdir=args.workdir)
        elif args.command == "serve":
            from .serving import main as serve_main

            return serve_main(args.folder, args.server_args)
    except InputError as e:  # ConversionError, EvaluationError, AdaptError, DataError
        return _fail(args.command, str(e))
    except KeyboardInterrupt:  # Ctrl-C: what each command leaves, in one line
        print(f"subquadratic {args.command}: interrupted; {INTERRUPTED.get(args.command, 'stopped')}", file=sys.stderr)
        return 130
    except OSError as e:  # disk full, permissions: nothing was left half-written (convert writes atomically)
        return _fail(args.command, f"{_one_line(e)}; check the path, its permissions and free space")
    return 0


def run() -> None:
    """The process entry point (the `subquadratic` script, `python -m subquadratic`): `main`'s status as
    the exit status. After Ctrl-C (130) the process ends at once with that status: CPython marks a
    KeyboardInterrupt raised while an extension ran Python code through PyRun_* (pybind11's exec does)
    as unhandled even when `main` handled it, and would then kill itself with SIGINT at exit (status -2
    instead of 130); there is nothing left to clean up by then (convert removed its temporary folder)."""
    import os

    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
