"""The `subquadratic` command line: `convert` a dense checkpoint, `push` a converted folder to the
Hub, `demo` the embedded default.

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
    sub = p.add_subparsers(dest="command", required=True, metavar="{convert,push,demo}")
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
    except OSError as e:  # disk full, permissions: nothing was left half-written (convert writes atomically)
        print(f"subquadratic: error: {_one_line(e)}; check the path, its permissions and free space", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
