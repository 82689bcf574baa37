"""The user's input errors, and the checks of them that need no model (no torch, no Transformers).

`InputError` is the base of every error the package raises for input a user can fix (a path, a
folder, an option value, a Hub id, data): `ConversionError`, `EvaluationError`, `AdaptError` and
`DataError` derive from it, and the command line prints any of them as one line
(`subquadratic COMMAND: error: ...`) with exit status 2.

The option types (`int_at_least`, `power_of_two`, `layer_list`) are what argparse calls on an option's
value: a bad value is refused while the command line is parsed, with the flag named. The `*_problem`
functions look at paths, folders and names only; each returns the one-line problem (what is wrong
and what to do) or None. The command line runs them before it imports anything heavy, so such a
mistake is reported at once; the library functions run the same ones (`conversion.convert`,
`adaptation.adapt`) and raise their own error class.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any


class InputError(ValueError):
    """Input the user can fix: printed as one line naming the problem and the fix, exit status 2."""


# --- option value types -------------------------------------------------------------------------


def int_at_least(low: int, metavar: str = "N") -> Callable[[str], int]:
    """An argparse type: an integer >= `low` (its `metavar` is what --help shows)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}; give an integer >= {low}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    parse.metavar = metavar
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def power_of_two(text: str) -> int:
    """An argparse type: a power of two (1, 2, 4, ...)."""
    value = positive_int(text)
    if value & (value - 1):
        lower = 1 << (value.bit_length() - 1)
        raise argparse.ArgumentTypeError(f"{value} is not a power of two; give {lower} or {2 * lower}")
    return value


power_of_two.metavar = "N"


def layer_list(text: str) -> str:
    """An argparse type: a comma list of layer indices like 5,11,17 (kept as the text)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of layer indices like 5,11,17")
    return ",".join(parts)


layer_list.metavar = "I,J"


#: The ways of choosing softmax layers by measurement, as a `softmax_layers` value names them
#: ("auto:K": the K layers whose replacement costs the most after a short attention transfer;
#: "retrieval:K": the K layers holding the source's strongest retrieval heads; `layer_choice`); the
#: value METHOD:K of each is read by `layer_choice_spec`.
LAYER_CHOICE_METHODS = ("auto", "retrieval")


def layer_choice_spec(value: Any, layers: int | None = None) -> tuple[str, int] | None:
    """(method, K) of a measured `softmax_layers` value "METHOD:K" (a name of LAYER_CHOICE_METHODS),
    or "METHOD:1/N": K = `layers` // N, as many as every N-th layer would keep (the convert presets'
    form; needs `layers`; 0 for a model of fewer than N layers: no softmax layer). None for any other
    value (a layer list, None). A value that starts with a method's name but is neither raises
    ValueError saying how to write it. K is checked against the layer count where the model is known
    (`convert`)."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    method = next((m for m in LAYER_CHOICE_METHODS if text.startswith(m)), None)
    if method is None:
        return None
    m = re.fullmatch(rf"{method}:(?:(\d+)|1/(\d+))", text)
    if m is None or (m.group(2) is not None and (layers is None or int(m.group(2)) < 1)):
        raise ValueError(f"softmax_layers {value!r}: write {method}:K with K the number of softmax layers, "
                         f"like {method}:5, or {method}:1/N for a N-th of the layers")
    return method, int(m.group(1)) if m.group(1) is not None else layers // int(m.group(2))


def layer_list_or_auto(text: str) -> str:
    """An argparse type: a comma list of layer indices (`layer_list`), or a measured choice such as
    auto:K (the K layers whose replacement costs the most; `layer_choice_spec`, read at conversion,
    which checks K against the layer count)."""
    text = text.strip()
    return text if text.startswith(LAYER_CHOICE_METHODS) else layer_list(text)


layer_list_or_auto.metavar = "I,J|auto:K|retrieval:K"


# --- paths, folders, names ----------------------------------------------------------------------


def looks_like_hub_id(name: str) -> bool:
    """`org/name`, not a path (no leading ., / or ~, no file suffix the converter reads)."""
    return (name.count("/") == 1 and not name.startswith((".", "/", "~"))
            and not name.endswith((".gguf", ".safetensors", ".json")))


def source_problem(src: str) -> str | None:
    """SRC of `convert`: a checkpoint folder, a .gguf file, or a Hub id."""
    p = Path(src).expanduser()
    if p.exists():
        if p.is_file() and p.suffix != ".gguf":
            return f"source {src} is a file; give the checkpoint folder (or a .gguf file)"
        return None
    if not looks_like_hub_id(src):
        return f"source {src} does not exist; give a checkpoint folder, a .gguf file or a Hub id like org/name"
    return None


def output_problem(out: str | Path, overwrite: bool, src: str | Path | None = None) -> str | None:
    """OUT of `convert`: not a file, not inside (or around) a local source, empty unless `overwrite`."""
    o = Path(out).expanduser().resolve()
    if src is not None and Path(src).expanduser().exists():
        s = Path(src).expanduser().resolve()
        s = s.parent if s.is_file() else s
        if o == s or s in o.parents or o in s.parents:
            return f"output {out} overlaps the source {src}; choose a folder outside it"
    if o.exists() and not o.is_dir():
        return f"output {out} exists and is a file; choose a folder path"
    if o.is_dir() and any(o.iterdir()) and not overwrite:
        return f"output {out} is not empty; pass --overwrite to replace it"
    return None


def repo_id_problem(repo: str, flag: str = "REPO") -> str | None:
    """A Hub repo id as huggingface_hub validates it (offline)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        return f"{flag} {repo!r} is not a valid Hub repo id ({' '.join(str(e).split())}); use org/name"
    return None


def file_problem(path: str | Path | None, flag: str) -> str | None:
    """A held-out data file given with `flag`: it must exist."""
    if path is not None and not Path(path).expanduser().is_file():
        return f"{flag} {path} does not exist; give a .txt, .jsonl, .json or .parquet file"
    return None


def checkpoint_problem(path: str | Path, what: str = "model") -> str | None:
    """A checkpoint folder: it must hold a config.json."""
    if not (Path(path).expanduser() / "config.json").is_file():
        return f"{what} {path} is not a checkpoint folder (no config.json); give a local model folder"
    return None


def data_problem(source: str) -> str | None:
    """The problem with one `--data` source that needs no reading (a path that does not exist, or
    is neither a file nor a folder), or None; a name that is not a path is taken for a cached Hub
    dataset."""
    path = Path(source).expanduser()
    if path.exists():
        if not (path.is_file() or path.is_dir()):
            return (f"{source} is neither a readable file nor a folder; give text, jsonl or parquet files or a "
                    "folder of them")
        return None
    if source.startswith(("/", ".", "~")) or Path(source).suffix:
        return f"{source} does not exist; check the path"
    return None


#: files any one of which gives a folder a tokenizer (with its tokenizer_config.json)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def tokenizer_problem(path: str | Path, what: str = "model") -> str | None:
    """A folder that commands tokenize text with: it must hold tokenizer files (`TOKENIZER_FILES`)."""
    folder = Path(path).expanduser()
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (f"{what} {path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]}); "
            f"copy them, with tokenizer_config.json, from its source model into it (AutoTokenizer.from_pretrained"
            f"(SOURCE).save_pretrained(FOLDER))")


def device_problem(device: str) -> str | None:
    """The spelling of a --device value (whether it is present is checked once torch is imported)."""
    if re.fullmatch(r"auto|cpu|mps|(cuda|xpu)(:\d+)?", device):
        return None
    return f"unknown device {device!r}; use auto, cpu, cuda or cuda:N"


# --- adapt ----------------------------------------------------------------------------------------

#: the file a finished checkpoint of `adapt` holds (`OUT/checkpoints/step-N/trainer_state.json`)
STATE_FILE = "trainer_state.json"


def latest_checkpoint(out: Path) -> Path | None:
    """The newest finished checkpoint of an `adapt` run in `out`, or None."""
    done = [p for p in (Path(out) / "checkpoints").glob("step-*") if (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1])) if done else None


def adapt_problem(s: Any, model_types: Collection[str]) -> str | None:
    """The settings of `adapt` (an `AdaptConfig`, or the command line's arguments: the same names)
    that can be checked before any model loads: numbers, the teacher the losses need, the folders,
    the data paths."""
    for name in ("max_steps", "seq_len", "batch_size", "grad_accum", "save_every", "save_total_limit"):
        if getattr(s, name) is not None and getattr(s, name) < 1:  # seq_len / batch_size None: by default
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(s, name)}"
    stage1_len = getattr(s, "stage1_seq_len", None)
    if stage1_len is not None and s.seq_len is not None and s.batch_size is not None \
            and not 2 <= stage1_len <= s.batch_size * s.seq_len:
        return (f"--stage1-seq-len must lie in 2..--batch-size x --seq-len ({s.batch_size * s.seq_len}: a stage-1 "
                f"batch holds as many tokens as a stage-2 one), got {stage1_len}")
    if not s.new_lr_scale > 0:  # NaN too
        return f"--new-lr-scale must be positive, got {s.new_lr_scale}"
    if not 0 <= getattr(s, "recall_share", 0.0) <= 1:  # NaN too
        return f"--recall-share must lie in 0..1, got {s.recall_share}"
    if s.num_proc is not None and s.num_proc < 1:
        return f"--num-proc must be at least 1, got {s.num_proc}"
    if s.stage1_steps is not None and not 0 <= s.stage1_steps <= s.max_steps:
        return f"--stage1-steps must lie in 0..--max-steps ({s.max_steps}), got {s.stage1_steps}"
    if s.teacher is None and s.loss == "kl":
        return "--loss kl distils from the dense model: give it with --teacher"
    if s.teacher is None and s.stage1_steps:
        return "attention transfer (--stage1-steps) matches the dense layers: give them with --teacher"
    out = Path(s.output_dir).expanduser()
    if out.resolve() == Path(s.student).expanduser().resolve():
        return "--output-dir is the student folder; write the adapted model elsewhere"
    config = Path(s.student).expanduser() / "config.json"
    if not config.is_file():
        return f"{s.student} has no config.json; give a folder written by subquadratic convert (or adapt)"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except json.JSONDecodeError as e:
        return f"{config} is not valid JSON ({e}); convert the model again"
    if model_type not in model_types:
        return (f"{s.student} is a {model_type} model, not a converted one; convert it first "
                "(subquadratic convert SRC OUT --to spla|hla|sse-h)")
    if s.teacher is not None and not (Path(s.teacher).expanduser() / "config.json").is_file():
        return f"teacher {s.teacher} has no config.json; give the dense checkpoint the student came from"
    for source in s.data:
        if (problem := data_problem(str(source))) is not None:
            return problem
    if out.exists() and not out.is_dir():
        return f"--output-dir {out} is a file; give a folder"
    if out.is_dir() and any(out.iterdir()):
        if s.resume and latest_checkpoint(out) is None:
            return f"{out} holds no checkpoint to resume from; drop --resume (with --overwrite) to start anew"
        if not s.resume and not s.overwrite:
            return f"{out} is not empty; pass --resume to continue its run or --overwrite to start anew"
    return tokenizer_problem(s.student, "student")
