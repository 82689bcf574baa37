"""Configuration shared by every subquadratic family.

`SubquadraticConfig` mirrors the fields of the dense Llama / Mistral / Qwen2 / Qwen3 configs so that
converting a checkpoint is a rename, and adds `mixer_types`: one entry per layer naming the token
mixer of that layer. A hybrid model is just a list with several kinds. Transformers validates and
interprets `config.layer_types` itself, so our per-layer list lives in a field of its own.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import PreTrainedConfig

from ..kernels.utils import BACKENDS as KERNEL_BACKENDS
from ..kernels.utils import KERNEL_PRECISIONS
from ..registry import mixers

#: Values of the per-family backend fields of older configs (`<family>_backend`), as kernel_backend.
_LEGACY_BACKENDS = {"reference": "torch", "varlen": "torch", "masked": "torch", "recurrent": "naive"}

#: Softmax-attention mixers of the shared decoder; families register theirs (`registry.register_family`).
SOFTMAX_MIXERS = ("full_attention", "sliding_attention")


_compiling = torch.compiler.is_compiling

#: Per config class: the names a read must resolve through the class (data descriptors such as properties,
#: `attribute_map`'s aliases), filled on a class's first read (`SubquadraticConfig.__getattribute__`).
_CLASS_NAMES: dict[type, frozenset[str]] = {}


def _class_names(cls: type) -> frozenset[str]:
    names = set(getattr(cls, "attribute_map", None) or ())
    for klass in cls.__mro__:
        for n, v in vars(klass).items():
            if hasattr(type(v), "__set__") or hasattr(type(v), "__delete__"):
                names.add(n)
    _CLASS_NAMES[cls] = frozen = frozenset(names)
    return frozen


def known_mixers() -> tuple[str, ...]:
    """Every mixer name `mixer_types` may use: the softmax ones and those of registered families."""
    return tuple(dict.fromkeys((*SOFTMAX_MIXERS, *sorted(mixers()))))


def hybrid_mixer_types(
    num_layers: int, mixer: str, every: int | None = None, layers: str | list[int] | None = None,
    *, every_name: str = "softmax_every", layers_name: str = "softmax_layers",
) -> list[str]:
    """Per-layer mixers of a hybrid: "full_attention" at every `every`-th layer ((i + 1) % every == 0;
    0 or None: none) or at the listed `layers` (indices, or a comma list like "5,11,17"), `mixer`
    elsewhere. Raises ValueError naming `every_name` / `layers_name` (a CLI flag or a keyword)."""
    if every is not None and layers is not None:
        raise ValueError(f"give either {every_name} or {layers_name}, not both")
    if layers is not None:
        try:
            keep = {int(x) for x in str(layers).split(",") if x.strip()} if isinstance(layers, str) else set(layers)
        except ValueError:
            msg = f"{layers_name} must be a comma list of layer indices like 5,11,17; got {layers!r}"
            raise ValueError(msg) from None
        bad = sorted(i for i in keep if not 0 <= i < num_layers)
        if bad:
            raise ValueError(f"{layers_name} {bad} out of range: the model has layers 0..{num_layers - 1}")
    else:
        if every is not None and every < 0:
            raise ValueError(f"{every_name} must be >= 0, got {every}")
        keep = {i for i in range(num_layers) if every and (i + 1) % every == 0}
    return ["full_attention" if i in keep else mixer for i in range(num_layers)]


class SubquadraticConfig(PreTrainedConfig):
    """Fields common to all families (decoder shape, attention projections, rotary, norms).

    Attention projections: `qkv_bias` adds a bias to q/k/v (Qwen2, Llama with attention_bias),
    `o_bias` to the output projection (Llama with attention_bias), `qk_norm` applies a per-head
    RMSNorm to q and k before rotary (Qwen3). `mixer_types[i]` names layer i's token mixer.
    """

    model_type = "subquadratic"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    #: Mixer used when `mixer_types` is not given; set by each family.
    default_mixer: ClassVar[str] = "full_attention"

    vocab_size: int = 32000
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    sliding_window: int | None = None
    mixer_types: list[str] | None = None
    #: Weight of the mixers' auxiliary loss (e.g. SSE's router load balance) added to the LM loss in
    #: training; 0 for families whose mixers return none.
    aux_loss_weight: float = 0.0
    #: model_type of the dense checkpoint this model was converted from (informational).
    source_model_type: str | None = None
    #: Kernels of every mixer: "auto" (Triton on CUDA where an op has kernels that take the inputs,
    #: else PyTorch), "torch" (the PyTorch forms), "triton" (the Triton kernels, CUDA only) or
    #: "naive" (the serial definition, where the op has one; for checks).
    kernel_backend: str = "auto"
    #: Dot precision of the Triton kernels for fp32 operands: "auto" (TF32 on CUDA, exact fp32 in
    #: the CPU interpreter), "tf32" or "ieee" (exact fp32: what tests comparing fp32 results to an
    #: oracle ask for). bf16 / fp16 operands (autocast, bf16 weights) always run on the tensor cores
    #: with fp32 accumulation.
    kernel_precision: str = "auto"
    #: Without gradients, run each mixer's input projections (q, k, v and the family's own) as one
    #: matmul over a packed weight that the members' parameters become views of
    #: (`modeling.projections`); False keeps one matmul per projection.
    fuse_projections: bool = True

    def __getattribute__(self, key: str):
        """A field's value read from the instance's dict directly. Transformers' own read (an alias lookup,
        and in later versions a per-layer check, each a Python-level `__getattribute__`) costs about a
        microsecond, and a forward reads the config some hundreds of times. Names the class resolves itself
        (properties, aliases), configs with per-layer values and reads inside a torch.compile trace take
        Transformers' path; a read returns what that path would."""
        if not _compiling():  # (a trace takes Transformers' path, which torch.compile knows how to follow)
            d = object.__getattribute__(self, "__dict__")
            if key in d and "_heterogeneity_spec" not in d:
                names = _CLASS_NAMES.get(type(self))
                if key not in (_class_names(type(self)) if names is None else names):
                    return d[key]
        return super().__getattribute__(key)

    def __post_init__(self, **kwargs):
        for name in [n for n in kwargs if n.endswith("_backend") and n != "kernel_backend"]:
            if name[: -len("_backend")] in (self.model_type, *known_mixers()):  # an older config's spla_backend, ...
                old = kwargs.pop(name)
                if self.kernel_backend == "auto":
                    self.kernel_backend = _LEGACY_BACKENDS.get(old, old)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.mixer_types is None:
            self.mixer_types = [self.default_mixer] * self.num_hidden_layers
        else:
            self.mixer_types = list(self.mixer_types)
        if self.rope_parameters is None and "rope_theta" not in kwargs and "rope_scaling" not in kwargs:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        super().__post_init__(**kwargs)
        self.check()

    def check(self) -> None:
        """Raise ValueError with one clear line when the configuration cannot work."""
        if len(self.mixer_types) != self.num_hidden_layers:
            raise ValueError(
                f"mixer_types has {len(self.mixer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}; give one mixer name per layer"
            )
        known = known_mixers()
        unknown = sorted(set(self.mixer_types) - set(known))
        if unknown:
            raise ValueError(
                f"unknown mixer type(s) {unknown}; registered: {', '.join(known)} (a family registers its "
                "mixers with subquadratic.registry.register_family)"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.aux_loss_weight < 0:
            raise ValueError(f"aux_loss_weight must be >= 0, got {self.aux_loss_weight}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {', '.join(KERNEL_BACKENDS)}; got {self.kernel_backend!r}")
        if self.kernel_precision not in KERNEL_PRECISIONS:
            raise ValueError(f"kernel_precision must be one of {', '.join(KERNEL_PRECISIONS)}; "
                             f"got {self.kernel_precision!r}")
        if "sliding_attention" in self.mixer_types and not self.sliding_window:
            raise ValueError("a 'sliding_attention' layer needs sliding_window > 0 in the config")

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads
