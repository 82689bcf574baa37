"""The `subquadratic` command line: `convert` a dense checkpoint, `demo` the embedded default.

Each family's `convert` options come from its registration (`registry.Family.options`) and are
spelled `--<family prefix>-<option>` (`--spla-top-k-blocks`, `--sse-top-k`, `--hla-softmax-every`).
"""

from __future__ import annotations

import argparse
import sys

from .conversion import ConversionError, convert, push_to_hub
from .registry import families


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="subquadratic", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    targets = sorted(f.name for f in families(lambda f: f.converter is not None))
    c = sub.add_parser("convert", help="convert a dense Llama/Mistral/Qwen2/Qwen3 checkpoint")
    c.add_argument("src", help="source checkpoint folder or Hub id (org/name)")
    c.add_argument("out", help="output folder (written atomically)")
    c.add_argument("--to", required=True, choices=targets, help="target family")
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the written weights (default auto: the source's)")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    c.add_argument("--push-to-hub", metavar="REPO", help="upload the result to this Hub repo")
    c.add_argument("--private", action="store_true", help="create the Hub repo private")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.family_dests = {}
    for fam in families(lambda f: f.converter is not None):
        group = c.add_argument_group(f"{fam.name} options (--to {fam.name})")
        p.family_dests[fam.name] = []
        for flag, kw in fam.cli_options().items():
            kw = dict(kw)
            option = kw.pop("dest")  # the name `convert` receives; argparse's dest is unique per family
            if "choices" not in kw and kw.get("action") is None:
                kw.setdefault("metavar", option.upper())
            p.family_dests[fam.name].append((flag, group.add_argument(flag, dest=f"{fam.name}.{option}", **kw).dest,
                                             option))
    d = sub.add_parser("demo", help="convert SmolLM2-135M to a family and compare generations with the dense model")
    d.add_argument("--to", default="spla", choices=targets, help="target family (default spla)")
    d.add_argument("--prompt", default=None, help="the short prompt (default: a question about the sky)")
    d.add_argument("--max-new-tokens", type=int, default=40, help="tokens generated per case (default 40)")
    d.add_argument("--workdir", default=None, help="where to keep the checkpoints (default: a cache folder)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            options = {}
            for fam, dests in parser.family_dests.items():
                for flag, dest, option in dests:
                    value = getattr(args, dest)
                    if value is None:
                        continue
                    if fam != args.to:
                        raise ConversionError(f"{flag} is an option of --to {fam}, not --to {args.to}")
                    options[option] = value
            out = convert(args.src, args.out, args.to, options=options, dtype=args.dtype,
                          overwrite=args.overwrite, progress=not args.no_progress)
            print(f"wrote {out}")
            if args.push_to_hub:
                print(f"pushed to {push_to_hub(out, args.push_to_hub, private=args.private)}")
        elif args.command == "demo":
            from .demo import run_demo

            run_demo(to=args.to, prompt=args.prompt, max_new_tokens=args.max_new_tokens, workdir=args.workdir)
    except ConversionError as e:
        print(f"subquadratic: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
