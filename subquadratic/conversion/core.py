"""Dense checkpoint -> subquadratic checkpoint, streamed shard by shard.

The conversion of the common weights (embeddings, norms, MLP, q/k/v/o) is written once here; a
family gives a `Converter` in its registration (`registry.register_family`, which also names the
model card and the CLI options):
  - `build_config(fields, options)`: the family's config from the common `fields` (mirrored from the
    dense config by `source_fields`) and the options;
  - `map_tensor(name, tensor, config)`: the (name, tensor) pairs a source tensor becomes (the
    default keeps it as is: Llama-style names are ours);
  - `new_tensors(config)`: parameters the source lacks; by default every mixer's own
    `reset_mixer_parameters` output for the parameters whose names `from_source` does not match;
  - `card_notes(config)`: values for the family's model card template, and `summary`, the settings
    in one line (what `subquadratic demo` prints).
The softmax layers a family keeps compute what the source's layers computed: a layer the source ran
over a sliding window (Mistral, Qwen2 / Qwen3 `use_sliding_window`, per-layer `layer_types`) stays
a "sliding_attention" layer with that window (`source_layer_types`, `keep_source_attention`).
`convert()` checks the source, writes everything into a temporary folder next to OUT and renames
it at the end, so a failure leaves nothing behind and SRC is never touched. A GGUF source is first
de-quantised into a scratch folder (`conversion/gguf.py`). The model card is the family's template
(`Family.card`) filled with what holds for the folder written: the source (its Hub id where known,
`card_source`), its license, the dtype, the package version and the command that made it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..cards import card_metadata, read_card_metadata
from ..checks import (
    TOKENIZER_FILES,
    layer_choice_spec,
    looks_like_hub_id,
    output_problem,
    source_problem,
    tokenizer_problem,
)
from ..data import DTYPE_CHOICES, torch_dtype
from .gguf import check_gguf, dequantize_gguf, gguf_file, gguf_hub_id
from .sources import SUPPORTED_SOURCES, ConversionError

COPIED_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class ChosenLayout:
    """A layout chosen by measurement (`softmax_layers="METHOD:K"`, `checks.layer_choice_spec`): the
    softmax layers, the model card's line for them, and the JSON records written beside the
    checkpoint, by file name."""

    layers: list[int]
    note: str
    files: dict[str, dict]


#: What resolves a measured layout for `convert`: (the source checkpoint folder, the target, the
#: options, (method, K), progress) -> `ChosenLayout` (`layer_choice.layout_chooser`).
LayoutChooser = Callable[[Path, str, dict, tuple[str, int], bool], ChosenLayout]


class ConversionWarning(UserWarning):
    """A conversion that is written but not ready for every use (the command line prints it as one line)."""


#: Parameters of a mixer that a dense source provides (`AttentionBase`'s names); the rest are new.
SOURCE_PARAMS = re.compile(r"^(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.")
#: The same, plus a state mixer's window branch (`swa.*`, copies of the source attention: `modeling.window`).
SOURCE_AND_WINDOW_PARAMS = re.compile(r"^(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm|swa)\.")
_MIXER_TENSOR = re.compile(r"^(model\.layers\.(\d+)\.self_attn\.)(.+)$")


def mixer_tensor(name: str) -> tuple[str, int, str] | None:
    """(prefix "model.layers.{i}.self_attn.", i, the rest) of a layer's mixer tensor name, else None."""
    m = _MIXER_TENSOR.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


@dataclass
class Converter:
    """How a dense checkpoint becomes a family's checkpoint (see the module docstring)."""

    build_config: Callable[[dict, dict], object]
    map_tensor: Callable[[str, torch.Tensor, object], Iterable[tuple[str, torch.Tensor]]] = (
        lambda name, t, config: [(name, t)]
    )
    new_tensors: Callable[[object], dict[str, torch.Tensor]] | None = None
    from_source: re.Pattern = SOURCE_PARAMS
    card_notes: Callable[[object], dict[str, str]] = lambda config: {}
    seed: int = 0

    def fresh_tensors(self, config) -> dict[str, torch.Tensor]:
        if self.new_tensors is not None:
            return self.new_tensors(config)
        return fresh_mixer_tensors(config, self.from_source, self.seed)


def resolve_target(to: str, options: dict):
    """(family, options) of `convert --to to`: a convert preset's options under the given ones; an
    option the family does not declare is refused."""
    from ..registry import convert_target

    try:
        fam, preset = convert_target(to)
    except KeyError as e:
        raise ConversionError(e.args[0]) from None
    unknown = sorted(set(options) - fam.option_names())
    if unknown:
        raise ConversionError(f"unknown option(s) {', '.join(unknown)} for --to {to}; the {fam.name} options are: "
                              f"{', '.join(sorted(fam.option_names())) or 'none'}")
    given = {k: v for k, v in options.items() if v is not None}
    if any(k in given for k in LAYOUT_OPTIONS):  # a layout given replaces the preset's
        preset = {k: v for k, v in preset.items() if k not in LAYOUT_OPTIONS}
    return fam, {**preset, **given}


# --- helpers for families -------------------------------------------------------------------

#: The options that choose the layers a hybrid keeps softmax attention in, one or the other (a
#: family that declares them builds its config with `hybrid_config`).
LAYOUT_OPTIONS = ("softmax_every", "softmax_layers")


def hybrid_config(config_class: type, fields: dict, options: dict, mixer: str, prefix: str):
    """The config of a hybrid conversion: softmax attention where the options `softmax_every` /
    `softmax_layers` (spelled `--{prefix}-softmax-every`, ...) say (`hybrid_mixer_types`; neither:
    no softmax layer), `mixer` in every other layer; every other option is a `config_class` field."""
    from ..configuration.base import hybrid_mixer_types

    mixers = hybrid_mixer_types(
        fields["num_hidden_layers"], mixer, options.get("softmax_every"), options.get("softmax_layers"),
        every_name=f"--{prefix}-softmax-every", layers_name=f"--{prefix}-softmax-layers",
    )
    return config_class(**fields, mixer_types=mixers, **{k: v for k, v in options.items() if k not in LAYOUT_OPTIONS})


def fresh_mixer_tensors(config, from_source: re.Pattern = SOURCE_PARAMS, seed: int = 0) -> dict[str, torch.Tensor]:
    """New parameters of every non-softmax layer, initialised by its mixer's own
    `reset_mixer_parameters` (one source of truth) on CPU under a fixed seed. Each layer is built on
    the meta device and materialised uninitialised; parameters whose names match `from_source` come
    from the dense checkpoint and are skipped."""
    from ..configuration.base import SOFTMAX_MIXERS
    from ..registry import mixer

    out: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i, kind in enumerate(config.mixer_types):
            if kind in SOFTMAX_MIXERS:
                continue
            with torch.device("meta"):
                layer = mixer(kind)(config, i)
            layer.to_empty(device="cpu")
            layer.reset_mixer_parameters()
            for n, p in layer.named_parameters():
                if not from_source.match(n):
                    out[f"model.layers.{i}.self_attn.{n}"] = p.detach()
            del layer
    return out


# --- reading the source -----------------------------------------------------------------------


def resolve_source(src: str) -> Path:
    """A local folder or .gguf file, or a Hub id resolved through huggingface_hub (its cache; offline if
    so set)."""
    if (problem := source_problem(src)) is not None:
        raise ConversionError(problem)
    p = Path(src).expanduser()
    if p.exists():
        return p.resolve()
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            src, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.md"]
        )
    except Exception as e:  # network, auth, missing repo: one line for the user
        raise ConversionError(_hub_problem(src, e)) from None
    return Path(path)


def _hub_problem(src: str, e: Exception) -> str:
    """One line for a failed Hub download: what went wrong and what to do."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    kind = type(e).__name__
    if isinstance(e, GatedRepoError):  # a subclass of RepositoryNotFoundError
        return f"Hub repo {src} is gated: accept its terms on huggingface.co and log in (hf auth login)"
    if isinstance(e, (RepositoryNotFoundError, RevisionNotFoundError)):
        return (f"Hub repo {src} not found: check the id (org/name), log in (hf auth login) if it is private, "
                "or give a local folder")
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "no details")[:160]
    return (f"could not fetch {src} from the Hub ({kind}: {first}); check the id and the network, "
            "or download the checkpoint and give its local folder")


def read_source_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise ConversionError(f"{src} has no config.json; is it a Transformers checkpoint folder?")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from None
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_SOURCES:
        raise ConversionError(f"source model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_SOURCES)}")
    return cfg


def source_shards(src: Path) -> list[Path]:
    """The safetensors files of the checkpoint, checked to exist and be readable."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ConversionError(f"{index} is corrupt ({e}); re-download the checkpoint") from None
        shards = [src / n for n in names]
    elif (src / "model.safetensors").is_file():
        shards = [src / "model.safetensors"]
    elif any(src.glob("*.bin")) or any(src.glob("*.pt")):
        raise ConversionError(f"{src} has only PyTorch .bin weights; re-save it with safetensors "
                              "(model.save_pretrained(dir)) and convert that")
    else:
        raise ConversionError(f"{src} has no model.safetensors or model.safetensors.index.json")
    for s in shards:
        if not s.is_file():
            raise ConversionError(f"shard {s.name} listed in the index is missing from {src}; re-download it")
        try:
            with safe_open(s, framework="pt") as f:
                f.keys()
        except Exception as e:
            raise ConversionError(f"shard {s.name} is not a readable safetensors file ({e}); re-download it") from None
    return shards


def source_fields(cfg: dict) -> dict:
    """Our common config fields from a dense Llama / Mistral / Qwen2 / Qwen3 config.json."""
    mt = cfg["model_type"]
    hq = cfg["num_attention_heads"]
    h = cfg.get("num_key_value_heads") or hq
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    if hq % h:
        raise ConversionError(f"num_attention_heads ({hq}) is not a multiple of num_key_value_heads ({h}); "
                              "the source config is inconsistent")
    attention_bias = bool(cfg.get("attention_bias", False))
    fields = {
        k: cfg[k]
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "hidden_act",
                  "max_position_embeddings", "initializer_range", "rms_norm_eps", "bos_token_id",
                  "eos_token_id", "pad_token_id", "tie_word_embeddings", "mlp_bias")
        if k in cfg
    }
    fields.update(num_attention_heads=hq, num_key_value_heads=h, head_dim=d, source_model_type=mt)
    rope = cfg.get("rope_parameters")
    if rope is None:
        rope = dict(cfg.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = cfg.get("rope_theta", 10000.0)
    fields["rope_parameters"] = rope
    fields["qkv_bias"] = True if mt == "qwen2" else (attention_bias if mt in ("llama", "qwen3") else False)
    fields["o_bias"] = attention_bias if mt in ("llama", "qwen3") else False
    fields["qk_norm"] = mt == "qwen3"
    if "sliding_attention" in source_layer_types(cfg):
        fields["sliding_window"] = cfg["sliding_window"]
    return fields


def source_layer_types(cfg: dict) -> list[str]:
    """Each source layer's attention, "full_attention" or "sliding_attention", as the source computes
    it: an explicit per-layer `layer_types` (Qwen2 / Qwen3 in Transformers 5, Gemma-style
    alternation); else Qwen2 / Qwen3's `use_sliding_window` from layer `max_window_layers` on;
    else Mistral's `sliding_window` on every layer; else full attention everywhere."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if cfg.get("model_type") in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None  # Qwen's sliding_window is inert unless use_sliding_window is set
    if not window:
        return ["full_attention"] * n
    kinds = cfg.get("layer_types")
    if kinds is not None:
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if len(kinds) != n or unknown:
            raise ConversionError(f"source layer_types {kinds} must give full_attention or sliding_attention for "
                                  f"each of the {n} layers; the source config is inconsistent")
        return list(kinds)
    if cfg.get("model_type") in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", 28)  # Transformers' default for Qwen2 / Qwen3
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return ["sliding_attention"] * n


def keep_source_attention(config, layer_types: list[str]):
    """The softmax layers a family keeps compute what the source's layers computed: a kept layer whose
    source attended over a sliding window becomes a "sliding_attention" layer with that window."""
    config.mixer_types = [
        src if kind == "full_attention" else kind for kind, src in zip(config.mixer_types, layer_types, strict=True)
    ]
    config.check()
    return config


def softmax_layer_notes(config) -> str:
    """The kept softmax layers for a model card: "5, 11 (sliding window 4096)", or "none"."""
    from ..configuration.base import SOFTMAX_MIXERS

    kept = [(i, kind) for i, kind in enumerate(config.mixer_types) if kind in SOFTMAX_MIXERS]
    return ", ".join(f"{i} (sliding window {config.sliding_window})" if kind == "sliding_attention" else str(i)
                     for i, kind in kept)


def check_shapes(shards: list[Path], fields: dict) -> None:
    """Layer 0's q/k/v shapes must match heads x head_dim, or the config and weights disagree."""
    want = {
        "model.layers.0.self_attn.q_proj.weight": fields["num_attention_heads"] * fields["head_dim"],
        "model.layers.0.self_attn.k_proj.weight": fields["num_key_value_heads"] * fields["head_dim"],
        "model.layers.0.self_attn.v_proj.weight": fields["num_key_value_heads"] * fields["head_dim"],
    }
    seen = {}
    for s in shards:
        with safe_open(s, framework="pt") as f:
            for name in want:
                if name in f.keys():
                    seen[name] = f.get_slice(name).get_shape()
    for name, rows in want.items():
        if name not in seen:
            raise ConversionError(f"weight {name} is missing; the checkpoint is incomplete or not a decoder LM")
        if seen[name][0] != rows or seen[name][1] != fields["hidden_size"]:
            raise ConversionError(
                f"{name} has shape {tuple(seen[name])} but the config implies ({rows}, {fields['hidden_size']}); "
                "head_dim / num_key_value_heads (GQA) in config.json do not match the weights"
            )


# --- writing ----------------------------------------------------------------------------------


def render_card(template: str | Path, values: dict) -> str:
    """The card template (a file, `Family.card`) with its {{key}} fields filled in."""
    text = Path(template).read_text()
    for k, v in values.items():
        text = text.replace("{{" + k + "}}", str(v))
    return text


def hub_id_of(src: str, src_path: Path, cfg: dict) -> str | None:
    """The Hub id of the source where it is known: SRC itself when it was a Hub id, the repo of a
    huggingface_hub cache folder (`models--org--name/snapshots/...`), or the config's `_name_or_path`
    when that is a Hub id (older Transformers saved it)."""
    if not Path(src).expanduser().exists() and looks_like_hub_id(src):
        return src
    m = re.search(r"models--([^/]+?)--([^/]+)/snapshots/", src_path.as_posix() + "/")
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    named = str(cfg.get("_name_or_path") or "")
    if looks_like_hub_id(named) and not Path(named).expanduser().exists():
        return named
    return None


def card_source(src: str, src_path: Path, cfg: dict, gguf_meta: dict | None = None) -> dict[str, str | None]:
    """What the card says of the source: {"hub_id", "name", "license", "license_name", "license_link",
    "license_from"}. The Hub id is the source's own where known (`hub_id_of`, or the GGUF file's
    source repo), else the `base_model` its card names (a local copy, a fine-tune or a de-quantised
    GGUF file says there what it was made from: `gguf.source_card`); the name for the title is the
    source's own Hub id, else the folder or file name. The license comes from the GGUF file's
    metadata, the source's card (README.md front matter) or its config, where one of them names it."""
    gguf_meta = gguf_meta or {}
    card = read_card_metadata(src_path / "README.md")
    own = hub_id_of(src, src_path, cfg) or gguf_hub_id(gguf_meta)
    named = card.get("base_model")
    named = named[0] if isinstance(named, list) and len(named) == 1 else named
    hub_id = own or (named if isinstance(named, str) and looks_like_hub_id(named) else None)
    info = {"hub_id": hub_id, "name": own or Path(src.rstrip("/")).name, "license": None,
            "license_name": None, "license_link": None, "license_from": None}
    for where, meta in (("its GGUF metadata", {k.replace(".", "_"): v for k, v in gguf_meta.items()}),
                        ("its model card", card), ("its config", cfg)):
        if meta.get("license"):
            info.update(license=str(meta["license"]), license_from=where,
                        license_name=meta.get("license_name"), license_link=meta.get("license_link"))
            break
    return info


def portable_path(path: str) -> str:
    """A path as the card records it: relative to the working folder when inside it, `~/...` when
    inside the home folder, else as given (a shell reads each as the same path on this machine)."""
    p = Path(path)
    if not p.is_absolute():
        return shlex.quote(path)
    for base, shown in ((Path.cwd(), None), (Path.home(), "~")):
        try:
            rest = p.relative_to(base)
        except ValueError:
            continue
        if shown is None:
            return shlex.quote(str(rest) if rest.parts else ".")
        return "~" + ("/" + shlex.quote(str(rest)) if rest.parts else "")
    return shlex.quote(path)


def portable_command(command: str, src: str, hub_id: str | None) -> str:
    """The command line the card records, without this machine's absolute paths where a shorter
    spelling says the same: SRC as its Hub id when SRC is a Hub cache snapshot of it, every other
    absolute path relative to the working folder or the home folder (`portable_path`)."""
    try:
        words = shlex.split(command)
    except ValueError:  # not a shell line: kept as given
        return command
    cached = hub_id is not None and re.search(r"models--[^/]+--[^/]+/snapshots/", src) is not None
    return " ".join(hub_id if cached and w == src else portable_path(w) for w in words)


def license_note(info: dict) -> str:
    """The card's sentence on the license."""
    if info["license"]:
        return (f"License: `{info['license']}`, the source's (read from {info['license_from']}); the converted "
                "weights are a derivative of the source's and stay under its terms.")
    return ("License: the source's card and config name none, so this card says `other`; the converted weights "
            "are a derivative of the source's and stay under its terms: check them before sharing this folder.")


def loading_note(model_type: str) -> str:
    """The card's "How to load": the snippet that loads the folder where the package is not installed
    (a test runs it as the card prints it), and how the package's own classes load it."""
    return (
        "Without the package, Transformers runs the model code this folder carries "
        f"(`configuration_{model_type}.py`, `modeling_{model_type}.py` and the package's modules they use, merged "
        "into `subquadratic_support.py` and, for the Triton kernels, `subquadratic_triton.py`): pass "
        "`trust_remote_code=True`, to the tokenizer too (Transformers reads the model's config to "
        "choose the tokenizer, and would otherwise ask whether to run the code):\n\n"
        "```python\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        'tok = AutoTokenizer.from_pretrained("<this folder or repo>", trust_remote_code=True)\n'
        'model = AutoModelForCausalLM.from_pretrained("<this folder or repo>", trust_remote_code=True)\n'
        'out = model.generate(**tok("Once upon a time", return_tensors="pt"), max_new_tokens=32)\n'
        "print(tok.decode(out[0], skip_special_tokens=True))\n"
        "```\n\n"
        "With the subquadratic package installed, `import subquadratic` first registers the model type: the same "
        "calls then build the package's classes and need no `trust_remote_code`."
    )


def source_attention_note(config) -> str:
    """What a converted layer keeps of the source's attention beyond q/k/v/o (the qk-norm, the
    biases), as a clause for the cards, or "" when the source has neither."""
    kept = []
    if getattr(config, "qk_norm", False):
        kept.append("qk-norm")
    biases = [name for name, on in (("q/k/v", getattr(config, "qkv_bias", False)),
                                    ("o", getattr(config, "o_bias", False))) if on]
    if biases:
        kept.append(" and ".join(biases) + " biases")
    return f"; the source's {' and '.join(kept)} kept and applied" if kept else ""


def convert_command(src: str, out: str, to: str, options: dict, dtype: str = "auto") -> str:
    """The `subquadratic convert` command line that makes this conversion (what the card records when
    `convert` is called from Python)."""
    from ..registry import convert_target

    fam, _ = convert_target(to)
    argv = ["subquadratic", "convert", str(src), str(out), "--to", to]
    for flag, kw in fam.cli_options().items():  # in the family's order of declaration
        if options.get(kw["dest"]) is None:
            continue
        value = options[kw["dest"]]
        if kw.get("action") == "store_const":
            if value == kw.get("const"):
                argv.append(flag)
            continue
        argv += [flag, str(value)]
    if dtype != "auto":
        argv += ["--dtype", dtype]
    return shlex.join(argv)


def convert(
    src: str,
    out: str,
    to: str,
    options: dict | None = None,
    dtype: str = "auto",
    overwrite: bool = False,
    progress: bool = True,
    before_finish: Callable[[Path, Path], None] | None = None,
    command: str | None = None,
    choose_layout: LayoutChooser | None = None,
) -> Path:
    """Convert the dense checkpoint `src` (a folder, a .gguf file or a Hub id) at `out` into `to` (a
    family, or one of its convert presets: `registry.convert_target`), with the family's `options`;
    returns the output folder.

    `before_finish(folder, src_folder)` runs on the complete temporary folder before it is renamed to
    `out` (the CLI evaluates it there and writes the card's evaluation); if it raises, nothing is left.
    A measured layout (`softmax_layers="auto:K"`: `checks.layer_choice_spec`) is resolved by
    `choose_layout` on the source folder before anything is written (`layer_choice.convert` passes
    the one that prices the layers); without one such a layout is refused.
    `command` is the command line the card records (default: the `subquadratic convert` command
    equivalent to this call, `convert_command`)."""
    src, out = str(src), str(out)  # a Path is as good as a string
    given = dict(options or {})
    fam, options = resolve_target(to, given)
    if dtype not in DTYPE_CHOICES:
        raise ConversionError(f"unknown dtype {dtype!r}; use {', '.join(DTYPE_CHOICES)}")
    src_path = resolve_source(src)
    out_path = Path(out).expanduser()
    if (problem := output_problem(out_path, overwrite, src_path)) is not None:
        raise ConversionError(problem)
    from ..demo.assets import gguf_base_model

    cast = None if dtype == "auto" else torch_dtype(dtype)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as scratch:
        gguf, gguf_meta = gguf_file(src_path), None
        if gguf is not None:  # de-quantised into a scratch folder beside OUT, removed at the end
            gguf_meta = check_gguf(gguf)
            folder = scratch.enter_context(tempfile.TemporaryDirectory(prefix=f".{out_path.name}.gguf-",
                                                                       dir=out_path.parent))
            src_path = dequantize_gguf(gguf, Path(folder) / gguf.stem, cast or torch.float32, progress,
                                       base_model=gguf_base_model(gguf))
        return _convert(src, src_path, out_path, to, fam, options, cast, progress, before_finish,
                        command or convert_command(src, out, to, given, dtype), gguf_meta, choose_layout)


def _convert(src: str, src_path: Path, out_path: Path, to: str, fam, options: dict, cast, progress: bool,
             before_finish, command: str, gguf_meta: dict | None, choose_layout: LayoutChooser | None) -> Path:
    """`convert` from a checkpoint folder `src_path` (`src` as the user gave it)."""
    conv = fam.converter
    src_cfg = read_source_config(src_path)
    shards = source_shards(src_path)
    fields = source_fields(src_cfg)
    check_shapes(shards, fields)
    measured = _measured_layout(src_path, to, options, fields["num_hidden_layers"], choose_layout, progress)
    if measured is not None:
        options = {**options, "softmax_layers": ",".join(map(str, measured.layers))}
    try:
        config = keep_source_attention(conv.build_config(fields, options), source_layer_types(src_cfg))
    except ValueError as e:
        raise ConversionError(f"invalid settings: {e}") from None
    drop = {"lm_head.weight"} if fields.get("tie_word_embeddings") else set()

    tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.tmp-", dir=out_path.parent))
    try:
        extra = dict(conv.fresh_tensors(config))
        n_out = len(shards) + (1 if extra else 0)
        weight_map: dict[str, str] = {}
        total = 0
        first_dtype = None
        for i, shard in enumerate(tqdm(shards, desc=f"converting to {to}", unit="shard", disable=not progress)):
            tensors = {}
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    if name in drop or name.endswith("rotary_emb.inv_freq"):
                        continue
                    for new_name, t in conv.map_tensor(name, f.get_tensor(name), config):
                        if cast is not None and t.is_floating_point():
                            t = t.to(cast)
                        first_dtype = first_dtype or t.dtype
                        tensors[new_name] = t.contiguous()
            fname = f"model-{i + 1:05d}-of-{n_out:05d}.safetensors"
            save_file(tensors, tmp / fname, metadata={"format": "pt"})
            for k, t in tensors.items():
                weight_map[k] = fname
                total += t.numel() * t.element_size()
            del tensors
        if extra:
            fname = f"model-{n_out:05d}-of-{n_out:05d}.safetensors"
            ex_dtype = cast or first_dtype or torch.float32
            extra = {k: v.to(ex_dtype).contiguous() for k, v in extra.items()}
            save_file(extra, tmp / fname, metadata={"format": "pt"})
            for k, t in extra.items():
                weight_map[k] = fname
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

        config.dtype = cast or first_dtype or torch.float32
        config.architectures = [fam.causal_lm_class.__name__]
        config.save_pretrained(tmp)
        from ..modeling.remote_code import write_remote_code

        write_remote_code(tmp, config.model_type)
        for name in COPIED_FILES:
            if (src_path / name).is_file():
                shutil.copy2(src_path / name, tmp / name)
        if tokenizer_problem(tmp) is not None:
            warnings.warn(ConversionWarning(
                f"{src} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); {out_path} holds the weights only, and "
                "serve, eval, adapt and AutoTokenizer refuse it until the source model's tokenizer files (with "
                "tokenizer_config.json) are copied into it"), stacklevel=3)
        shown = {**options, **({"softmax_layers": measured.note} if measured else {})}
        (tmp / "README.md").write_text(render_card(fam.card, card_values(
            src, src_path, src_cfg, config, to, shown, command, gguf_meta, conv.card_notes(config))))
        for name, record in (measured.files if measured else {}).items():
            (tmp / name).write_text(json.dumps(record, indent=1) + "\n")
        if before_finish is not None:
            before_finish(tmp, src_path)
        _finish(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_path


def _measured_layout(src: Path, to: str, options: dict, layers: int, choose_layout: LayoutChooser | None,
                     progress: bool) -> ChosenLayout | None:
    """The layout of a measured `softmax_layers` ("auto:K") chosen by `choose_layout` on the source
    folder `src` of `layers` layers; None for any other layout."""
    try:
        spec = layer_choice_spec(options.get("softmax_layers"), layers)
    except ValueError as e:
        raise ConversionError(f"invalid settings: {e}") from None
    if spec is None:
        return None
    method, k = spec
    value = str(options["softmax_layers"]).strip()
    share = "/" in value  # "METHOD:1/N": as many layers as every N-th (the convert presets' form)
    if share and k == 0:
        return ChosenLayout([], f"none ({value} of {layers} layers)", {})
    if not 0 < k < layers:
        raise ConversionError(f"invalid settings: softmax_layers {method}:{k} asks for {k} softmax layers of "
                              f"{layers}; choose K in 1..{layers - 1}")
    if choose_layout is None:
        if share:  # a preset's measured layout, without the measurement: the fixed layout it stands for
            chosen = evenly_spaced(layers, k)
            warnings.warn(f"softmax layers at {','.join(map(str, chosen))} (evenly spaced): conversion.convert does "
                          f"not measure {value}; subquadratic.layer_choice.convert and `subquadratic convert` do",
                          stacklevel=3)
            return ChosenLayout(chosen, f"{','.join(map(str, chosen))} (evenly spaced; {value} not measured)", {})
        raise ConversionError(f"softmax_layers {method}:{k} is chosen by measurement; convert with "
                              "subquadratic.layer_choice.convert (or `subquadratic convert`), which measures it")
    return choose_layout(src, to, options, spec, progress)


def evenly_spaced(layers: int, k: int) -> list[int]:
    """k layers of `layers`, evenly spaced and ending at the last: every (layers // k)-th layer, the layout
    of `softmax_every` = layers // k (every 6th of 30 layers: 5, 11, 17, 23, 29)."""
    step = layers // k
    return [(j + 1) * step - 1 for j in range(k)]


def card_values(src: str, src_path: Path, src_cfg: dict, config, to: str, options: dict, command: str,
                gguf_meta: dict | None, notes: dict[str, str]) -> dict[str, str]:
    """The fields of a family's card template: the shared ones (the source, its license, the
    metadata block, the settings, the dtype, the version and command that made the folder) and the
    family's `card_notes`."""
    from .. import __version__

    info = card_source(src, src_path, src_cfg, gguf_meta)
    command = portable_command(command, src, info["hub_id"])
    made = f"Converted by subquadratic {__version__} with:\n\n```bash\n{command}\n```\n\n"
    if gguf_meta is not None:
        made += (f"The source is a GGUF file: Transformers' GGUF loader de-quantised its weights to "
                 f"{str(config.dtype).removeprefix('torch.')} before the conversion (the quantisation's error "
                 "stays in them), and the tokenizer is the one the file carries.\n\n")
    made += license_note(info)
    return {
        "metadata": card_metadata(info["hub_id"], info["license"] or "other", info["license_name"],
                                  info["license_link"]),
        "source": info["name"],
        "base_model": info["name"],  # the older name of `source`, which outside families' templates may use
        "source_model_type": src_cfg["model_type"],
        "target": to,
        "model_type": config.model_type,
        "settings": "\n".join(f"- `{k}`: {v}" for k, v in sorted(options.items())) or "- defaults",
        "dtype": str(config.dtype).removeprefix("torch."),
        "source_attention": source_attention_note(config),
        "provenance": made,
        "loading": loading_note(config.model_type),
        **notes,
    }


def _finish(tmp: Path, out: Path) -> None:
    """Move the finished temporary folder into place (replacing an old OUT only now)."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def push_to_hub(folder: Path, repo_id: str, private: bool = False) -> str:
    """Upload the finished folder with huggingface_hub; returns the repo URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="Upload converted checkpoint")
    return str(url)
