"""GGUF sources: a .gguf file (llama.cpp's format, often quantised) de-quantised through Transformers'
GGUF loader into an ordinary checkpoint folder (safetensors weights, config, generation config and
the tokenizer the file carries) that `convert` then reads like any other source; and the file's
metadata (name, organisation, license, source repo) for the model card.

Transformers reads GGUF with the `gguf` package (`pip install gguf`); it undoes llama.cpp's q/k row
order itself. The de-quantised weights are float32 unless a dtype is asked for.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch

from .sources import SUPPORTED_SOURCES, ConversionError


def gguf_file(path: Path) -> Path | None:
    """The GGUF file a source names: the file itself, or the only .gguf file of a folder that holds no
    safetensors weights; None for a folder of another kind. A folder of several GGUF files is an
    error naming them (the file to convert must be given)."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ConversionError(f"{path} holds several GGUF files ({', '.join(f.name for f in found)}); give the "
                              "file to convert as SRC")
    return found[0] if found else None


def gguf_metadata(path: Path) -> dict[str, str]:
    """The string fields of the file's `general.*` metadata, without the prefix ("architecture",
    "name", "organization", "license", "source.huggingface.repository", ...)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(path))
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("general.") and field.types == [GGUFValueType.STRING]:
            out[key.removeprefix("general.")] = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return out


def gguf_hub_id(meta: dict[str, str]) -> str | None:
    """The Hub repo the GGUF file was made from, where its metadata names one."""
    for key in ("source.huggingface.repository", "base_model.0.repo_url", "source.repo_url", "repo_url"):
        value = meta.get(key, "").strip().rstrip("/")
        if "huggingface.co/" in value:
            value = value.split("huggingface.co/", 1)[1]
        parts = value.split("/")
        if len(parts) == 2 and all(parts) and "://" not in value:
            return value
    return None


def check_gguf(path: Path) -> dict[str, str]:
    """The metadata of a GGUF file `convert` can read; a ConversionError says what is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ConversionError(f"{path} is a GGUF file; reading it needs the gguf package: pip install gguf, then "
                              "run the same command again")
    try:
        meta = gguf_metadata(path)
    except Exception as e:
        raise ConversionError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); download it "
                              "again") from None
    arch = meta.get("architecture")
    if arch not in SUPPORTED_SOURCES:
        raise ConversionError(f"{path} is a GGUF {arch!r} model; supported: {', '.join(SUPPORTED_SOURCES)}")
    return meta


def source_card(path: Path, meta: dict[str, str], base_model: str | None = None) -> str:
    """The card of a folder de-quantised from the GGUF file `path`: front matter with the model it
    was made from (`base_model`, else the repo the file's metadata names) and the file's license,
    which `convert` then carries into the converted folder's card."""
    base_model = base_model or gguf_hub_id(meta)
    lines = [f"base_model: {base_model}", "base_model_relation: quantized"] if base_model else []
    lines += [f"license: {meta['license']}"] if meta.get("license") else []
    front = "---\n" + "".join(f"{line}\n" for line in lines) + "---\n\n" if lines else ""
    return (f"{front}# {path.stem}\n\nThe GGUF file `{path.name}` de-quantised to safetensors by subquadratic "
            "(`conversion.gguf.dequantize_gguf`); the quantisation's error stays in the weights.\n")


def dequantize_gguf(path: Path, out: Path, dtype: torch.dtype = torch.float32, progress: bool = True,
                    base_model: str | None = None) -> Path:
    """Write `path` (a .gguf file) as a checkpoint folder at `out`: the de-quantised weights in
    `dtype` (safetensors), config.json without the GGUF quantisation entry, generation_config.json,
    the tokenizer files and a card naming `base_model` and the file's license (`source_card`).
    Written into a temporary folder beside `out`, renamed at the end.
    `progress` False silences Transformers' loading and saving bars (not the loader's own
    de-quantisation bar, which Transformers always shows)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    meta = check_gguf(path)
    shown = logging.is_progress_bar_enabled()
    if not progress:
        logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    finally:
        if shown and not progress:
            logging.enable_progress_bar()
    # The weights are plain tensors now; Transformers refuses to save a model its GGUF quantiser marks.
    model.hf_quantizer = None
    for key in ("quantization_config", "_model_name_or_path"):  # the GGUF loader's entries, not the model's
        if key in model.config.__dict__:
            delattr(model.config, key)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if not progress:
            logging.disable_progress_bar()
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(source_card(path, meta, base_model))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if shown and not progress:
            logging.enable_progress_bar()
    return out
