"""`subquadratic adapt`: train a converted model so that it matches (and then serves as) its dense
source. Two stages, one optimizer step counter:

1. attention transfer (the first `stage1_steps` steps, on rows of `stage1_seq_len` tokens when set;
   needs the teacher): every converted layer gets the frozen dense layer's own input and learns to
   reproduce the dense layer's attention output (MSE over real tokens, averaged over layers). The
   student's residual stream is the teacher's (each converted layer passes the dense output on), so
   the layers learn side by side and only mixer parameters receive gradients.
2. fine-tuning (the remaining steps): next-token loss (`lm`), or KL divergence to the teacher's
   next-token distribution (`kl`), plus the mixers' auxiliary loss (SSE's router balance). Both
   losses take the final hidden states and the LM head weights and run chunked over tokens
   (`modeling.losses`; liger-kernel's fused losses on CUDA where installed): no full-vocabulary
   logits of the batch, student's or teacher's, exist, forward or backward (under FSDP, which
   gathers the head's weight only inside its own forward, the losses take the full logits).

What trains (`train`): `full` (every parameter in stage 2; stage 1 reaches only the mixers), `mixer`
(the parameters of the converted layers' mixers), `new` (only the parameters a dense checkpoint lacks,
such as SPLA's residual gain), or `lora` (PEFT LoRA adapters on the converted layers' projections plus
the new parameters; the saved folders hold the merged weights).

Runs under accelerate: `accelerate launch -m subquadratic adapt ...` with a multi-GPU (DDP / FSDP)
configuration is the same command; on one process it runs as is, on CPU too. OUT is a loadable
Hugging Face folder at the end; on the way, `OUT/checkpoints/step-N/` are loadable folders too, with
the optimizer, scheduler and random states under `state/` for `resume`. The loss of every step goes
to `OUT/adapt_log.jsonl`. The data (reading, packing, batches) is `subquadratic.data`'s.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cards import adapted_card, replace_section
from ..checks import STATE_FILE, InputError, adapt_problem, latest_checkpoint
from ..data import IGNORE_INDEX, batches, load_texts, tokenize_and_pack, torch_dtype, with_recall_rows
from ..families import converted_model_types

LOG_FILE = "adapt_log.jsonl"
#: rows of this many tokens by default (or the model's context if shorter), DEFAULT_STEP_TOKENS tokens a
#: micro-batch: on SmolLM2-135M the hybrids adapted on rows of 8192 match those adapted on 8 x 2048 at
#: 2048 and are 10% of dense perplexity at 8192 against 17% (docs/results.md, two seeds each)
DEFAULT_ROW = 8192
DEFAULT_STEP_TOKENS = 16384
TRAIN_CHOICES = ("full", "mixer", "new", "lora")
LOSS_CHOICES = ("lm", "kl")
#: the compute dtype (a `data.DTYPE_NAMES` name) of each --mixed-precision choice
COMPUTE_DTYPES = {"no": "float32", "bf16": "bfloat16", "fp16": "float16"}
PRECISION_CHOICES = tuple(COMPUTE_DTYPES)


class AdaptError(InputError):
    """A problem with the user's input to `adapt`: one line naming the problem and the fix."""


@dataclass
class AdaptConfig:
    """The settings of one adaptation run (the CLI flags of `subquadratic adapt`)."""

    student: str
    output_dir: str
    data: list[str]
    teacher: str | None = None
    max_steps: int = 1000
    #: attention-transfer steps at the start (default: a quarter of max_steps, rounded up, with a teacher; else 0)
    stage1_steps: int | None = None
    #: the stage-2 loss (default: kl with a teacher, else lm)
    loss: str | None = None
    train: str = "full"
    #: tokens per packed row (default `default_rows`: 8192, or the model's context if shorter)
    seq_len: int | None = None
    #: rows per micro-batch and process (default: DEFAULT_STEP_TOKENS // seq_len, at least 1)
    batch_size: int | None = None
    #: tokens per packed row in attention transfer (default: seq_len), with batch_size * seq_len //
    #: stage1_seq_len rows per micro-batch, so that a stage-1 step holds as many tokens as a stage-2 one
    stage1_seq_len: int | None = None
    grad_accum: int = 1
    lr: float = 1e-4
    stage1_lr: float = 1e-3
    #: the learning rates of the parameters the dense model lacks (`new_parameter_names`: SPLA's
    #: residual gain, the state mixers' router, gates and decays) are this many times the others'
    new_lr_scale: float = 1.0
    #: share of the rows made recall rows (`data.recall_row`: passages of the row copied further on, as
    #: one document), in both stages
    recall_share: float = 0.0
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"
    gradient_checkpointing: bool = False
    save_every: int = 500
    save_total_limit: int = 2
    keep_checkpoints: bool = False
    resume: bool = False
    overwrite: bool = False
    seed: int = 0
    lora_rank: int = 16
    lora_alpha: float = 32.0
    text_field: str = "text"
    text_unit: str = "document"
    #: processes that tokenise the data (default: one)
    num_proc: int | None = None
    progress: bool = True
    #: stop (as an interruption would) after this many steps, leaving the last checkpoint and no final
    #: model: for tests, and for the layer pricing of `layer_choice`, which keeps only its measurement
    stop_after: int | None = None
    #: run on the CPU even where a GPU is (accelerate's `cpu`)
    cpu: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.loss is None:
            self.loss = "kl" if self.teacher is not None else "lm"

    def default_rows(self, max_positions: int | None) -> None:
        """Fill in the row layout left unset: rows of min(DEFAULT_ROW, `max_positions`) tokens and
        DEFAULT_STEP_TOKENS // seq_len rows (at least one) per micro-batch."""
        if self.seq_len is None:
            self.seq_len = min(DEFAULT_ROW, max_positions) if max_positions else DEFAULT_ROW
        if self.batch_size is None:
            self.batch_size = max(1, DEFAULT_STEP_TOKENS // self.seq_len)

    def check(self) -> None:
        if self.train not in TRAIN_CHOICES:
            raise AdaptError(f"unknown --train {self.train!r}; use {', '.join(TRAIN_CHOICES)}")
        if self.loss not in LOSS_CHOICES:
            raise AdaptError(f"unknown --loss {self.loss!r}; use {', '.join(LOSS_CHOICES)}")
        if self.mixed_precision not in PRECISION_CHOICES:
            raise AdaptError(f"unknown --mixed-precision {self.mixed_precision!r}; use {', '.join(PRECISION_CHOICES)}")
        # what the command line checks before importing torch
        if (problem := adapt_problem(self, converted_model_types())) is not None:
            raise AdaptError(problem)


# --- the pieces ---------------------------------------------------------------------------------


def _max_positions(path: str) -> int | None:
    """The context length (`max_position_embeddings`) in a model folder's config.json, or None."""
    config = Path(path).expanduser() / "config.json"
    try:
        value = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 1 else None


def _load_student(path: str):
    from transformers import AutoModelForCausalLM

    from ..modeling.base import SubquadraticPreTrainedModel

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if not isinstance(model, SubquadraticPreTrainedModel):
        raise AdaptError(f"{path} is a {model.config.model_type} model, not a converted one; convert it first "
                         "(subquadratic convert SRC OUT --to spla|hla|sse-h)")
    return model


def _load_teacher(path: str, student, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if not (Path(path).expanduser() / "config.json").is_file():
        raise AdaptError(f"teacher {path} has no config.json; give the dense checkpoint the student came from")
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().requires_grad_(False)
    s, t = student.config, teacher.config
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if getattr(s, key) != getattr(t, key):
            raise AdaptError(f"teacher {path} does not match the student: {key} {getattr(t, key)} vs "
                             f"{getattr(s, key)}; give the dense checkpoint the student was converted from")
    return teacher


def converted_layers(config) -> list[int]:
    """Indices of the layers whose mixer is not the dense model's softmax attention."""
    from ..configuration.base import SOFTMAX_MIXERS

    return [i for i, kind in enumerate(config.mixer_types) if kind not in SOFTMAX_MIXERS]


def new_parameter_names(config) -> set[str]:
    """Names of the parameters a dense checkpoint lacks (the family converter's fresh tensors)."""
    from ..registry import family_of_model_type

    fam = family_of_model_type(config.model_type)
    if fam.converter is None:
        return set()
    return set(fam.converter.fresh_tensors(config))


def mixer_parameters(model: torch.nn.Module, layers: list[int]) -> set[int]:
    """ids of the parameters of the mixers of `layers` in `model` (any wrapper: Trainee, DDP, PEFT)."""
    pattern = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.self_attn\.")
    return {id(p) for name, p in model.named_parameters() if (m := pattern.search(name)) and int(m[1]) in layers}


def enable_checkpointing(model) -> None:
    """Non-reentrant gradient checkpointing on every decoder layer of a Transformers model (ours or a dense
    one): each layer's activations recomputed in the backward instead of kept. Transformers >= 5.24 names
    it activation checkpointing."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _lora(model, layers: list[int], rank: int, alpha: float):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise AdaptError("--train lora needs PEFT: pip install 'subquadratic[peft]'") from None
    targets = r"model\.layers\.(" + "|".join(map(str, layers)) + r")\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0))


def _plain_name(name: str) -> str:
    """A parameter's name as the unwrapped model has it (PEFT's wrapper prefix and base layers removed)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _select_trainable(model, mode: str, layers: list[int], new: set[str]) -> int:
    """Set requires_grad for `mode`; returns the number of trainable parameters."""
    mixer_prefixes = tuple(f"model.layers.{i}.self_attn." for i in layers)
    for name, p in model.named_parameters():
        plain = _plain_name(name)
        if mode == "full":
            p.requires_grad_(True)
        elif mode == "mixer":
            p.requires_grad_(plain.startswith(mixer_prefixes))
        elif mode == "new":
            p.requires_grad_(plain in new)
        else:  # lora: the adapters (already trainable) and the new parameters
            p.requires_grad_("lora_" in name or plain in new)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class Transfer:
    """Stage 1 hooks: the teacher's layers record their attention input and output; the student's
    converted mixers take that input, add their MSE to `losses` and pass the teacher's output on."""

    def __init__(self, teacher, student_base, layers: list[int]) -> None:
        self.captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.losses: list[torch.Tensor] = []
        self.handles = []
        for i in layers:
            self.handles.append(teacher.model.layers[i].self_attn.register_forward_hook(
                self._capture(i), with_kwargs=True))
            mixer = student_base.model.layers[i].self_attn
            self.handles.append(mixer.register_forward_pre_hook(self._feed(i), with_kwargs=True))
            self.handles.append(mixer.register_forward_hook(self._compare(i), with_kwargs=True))

    def _capture(self, i):
        def hook(module, args, kwargs, output):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self.captured[i] = (x.detach(), output[0].detach())
        return hook

    def _feed(self, i):
        def hook(module, args, kwargs):
            x = self.captured[i][0]  # the teacher's attention input, one document per row on packed rows
            seq = args[2]  # SequenceInfo
            if seq.is_packed(args[0]):  # a mixer that takes a packed batch packed (`takes_packed`)
                x = seq.documents.pack(x)
            if x.shape != args[0].shape:
                raise RuntimeError(f"layer {i}: teacher input {tuple(x.shape)} vs student {tuple(args[0].shape)}")
            # the student's own input stays in the graph through an exact zero (its norm gets a gradient)
            return (x.to(args[0].dtype) + 0.0 * args[0], *args[1:]), kwargs
        return hook

    def _compare(self, i):
        def hook(module, args, kwargs, output):
            want = self.captured[i][1]
            got = output[0]
            seq = args[2]  # SequenceInfo: real tokens only
            if seq.is_packed(got):
                want = seq.documents.pack(want)
            valid = seq.valid_like(got)[..., None].to(got.dtype)
            err = ((got.float() - want.float()) ** 2 * valid).sum() / (valid.sum() * got.shape[-1]).clamp(min=1)
            self.losses.append(err)
            return (want.to(got.dtype), *output[1:])
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class Watch:
    """What a caller in the same process follows of an `adapt` run (the layer pricing of
    `layer_choice` reads each converted layer's transfer error this way): `attach` once, when the
    stage-1 hooks are in place (the unwrapped student, its `Transfer` or None without stage 1, the
    converted layers), before the first step; `step_done(step, stage)` after each optimizer step
    (step counted from 1). The base class does nothing."""

    def attach(self, student, transfer: Transfer | None, layers: list[int]) -> None:
        pass

    def step_done(self, step: int, stage: int) -> None:
        pass


#: Decoder layers of the sources `convert` takes whose forward is the pre-norm residual block
#: h + attn(norm1(h)), then h + mlp(norm2(h)) (`_documents_per_layer` runs it layer by layer)
PRE_NORM_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")


def _layerwise(decoder, longest: int) -> bool:
    """Whether `_documents_per_layer` computes this decoder's own forward: pre-norm layers of the
    known sources, SDPA (causal without a mask), every layer full attention (or a sliding window no
    shorter than the longest document)."""
    cfg = decoder.config
    layers = getattr(decoder, "layers", None)
    if (not layers or getattr(decoder, "rotary_emb", None) is None or cfg._attn_implementation != "sdpa"
            or any(type(layer).__name__ not in PRE_NORM_LAYERS for layer in layers)):
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False
    window = getattr(cfg, "sliding_window", None)
    return window is None or not getattr(cfg, "use_sliding_window", True) or longest <= window


def _documents_per_layer(decoder, docs, ids, pos):
    """The decoder's forward on a packed batch with only the attention run one document per right-padded
    row (causal, no mask: the padding after a document is never read); the embeddings, norms and MLPs
    run on the packed tokens. Returns the final hidden states [B, T, H], packed."""
    h = decoder.embed_tokens(ids)
    cos, sin = decoder.rotary_emb(h, pos)
    rope = (docs.unpack(cos.expand(*ids.shape, -1)), docs.unpack(sin.expand(*ids.shape, -1)))
    for layer in decoder.layers:
        out = layer.self_attn(hidden_states=docs.unpack(layer.input_layernorm(h)), position_embeddings=rope,
                              attention_mask=None)[0]
        h = h + docs.pack(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return decoder.norm(h)


def _teacher_hidden(teacher, batch):
    """The dense model's decoder on the batch, each packed document attending only to itself (as the
    student runs it): returns its final hidden states [B, T, H] in the packed layout (the head is
    applied chunk by chunk by the loss). The attention runs one document per right-padded row (which
    needs no mask for the real tokens' outputs); for the known pre-norm sources only the attention
    does (`_documents_per_layer`), for others the whole decoder."""
    from ..modeling.losses import decoder_and_head
    from ..modeling.packing import find_documents

    decoder, _ = decoder_and_head(teacher)
    ids, pos = batch["input_ids"], batch["position_ids"]
    docs = find_documents(pos, torch.ones_like(ids, dtype=torch.bool))
    if docs is None:
        return decoder(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    if _layerwise(decoder, docs.max_len):
        return _documents_per_layer(decoder, docs, ids, pos)
    hidden = decoder(input_ids=docs.unpack(ids), attention_mask=docs.valid.long(),
                     position_ids=docs.unpack(pos), use_cache=False).last_hidden_state
    return docs.pack(hidden)


def kl_to_teacher(student_logits, teacher_logits, labels) -> torch.Tensor:
    """Mean over predicted tokens of KL(teacher || student) between next-token distributions, on full
    logits [B, T, V] (the definition; `adapt` computes it chunked, `losses.mean_chunked_kl`)."""
    keep = labels[:, 1:] != IGNORE_INDEX
    s = student_logits[:, :-1][keep].float().log_softmax(-1)
    t = teacher_logits[:, :-1][keep].float().log_softmax(-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def _optimizer(student, new: set[str], cfg: AdaptConfig, stage1: int):
    """AdamW over the trainable parameters (weight decay on matrices only) and its schedule
    (`_lr_lambda`); with `cfg.new_lr_scale` != 1, the parameters named in `new` (the ones the dense
    model lacks) in groups of their own whose rates are that many times the others'."""
    scaled = cfg.new_lr_scale != 1.0
    groups: dict[tuple[bool, bool], list] = {}  # (weight decay, new) -> parameters
    for n, p in student.named_parameters():
        if p.requires_grad:
            groups.setdefault((p.dim() >= 2, scaled and _plain_name(n) in new), []).append(p)
    keys = [k for k in ((True, False), (False, False), (True, True), (False, True)) if k in groups]
    optimizer = torch.optim.AdamW([{"params": groups[k], "weight_decay": cfg.weight_decay if k[0] else 0.0}
                                   for k in keys], lr=1.0, betas=(0.9, 0.95))
    base = _lr_lambda(stage1, cfg.max_steps, cfg.warmup_ratio, cfg.stage1_lr, cfg.lr)
    lambdas = [(lambda step, f=cfg.new_lr_scale: f * base(step)) if k[1] else base for k in keys]
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def _lr_lambda(stage1: int, total: int, warmup_ratio: float, stage1_lr: float, lr: float):
    """Absolute learning rate per step: warmup then cosine to 10%, separately in each stage."""

    def rate(step: int) -> float:
        start, length, peak = (0, stage1, stage1_lr) if step < stage1 else (stage1, total - stage1, lr)
        t = step - start
        warm = max(1, math.ceil(warmup_ratio * length))
        if t < warm:
            return peak * (t + 1) / warm
        frac = (t - warm) / max(1, length - warm)
        return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    return rate


def _prepare_output(cfg: AdaptConfig) -> tuple[Path, Path | None]:
    """(OUT, the checkpoint to resume from or None); `cfg.check` has refused an OUT in the way."""
    out = Path(cfg.output_dir).expanduser()
    return out, latest_checkpoint(out) if cfg.resume and out.is_dir() else None


# --- the run ------------------------------------------------------------------------------------


def _fsdp_plugin(mixed_precision: str):
    """Under an FSDP2 launch with mixed precision, the plugin accelerate would build from the launch
    configuration, except that gradients are averaged across processes in float32 and outputs keep
    their dtype (accelerate's default casts both to the compute dtype, which rounds every gradient
    before the average, and the loss, to bf16). None otherwise."""
    if not _fsdp_launch() or os.environ.get("FSDP_VERSION") != "2" or mixed_precision == "no":
        return None
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return FullyShardedDataParallelPlugin(mixed_precision_policy=MixedPrecisionPolicy(
        param_dtype=torch_dtype(COMPUTE_DTYPES[mixed_precision]), reduce_dtype=torch.float32))


def _fsdp_launch() -> bool:
    """Whether `accelerate launch` was given an FSDP configuration (it sets ACCELERATE_USE_FSDP)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"


def adapt(cfg: AdaptConfig, after_training: Callable[[Path, torch.device], None] | None = None,
          watch: Watch | None = None) -> Path:
    """Run the adaptation `cfg` describes; returns the output folder (a loadable model folder).

    `after_training(out, device)` runs on the main process once `out` holds the final model and its
    card, before the checkpoints are removed (`subquadratic adapt --eval-data` evaluates the model
    there and writes the card's Evaluation section). `watch` follows the run from inside (`Watch`)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, set_seed
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    cfg.default_rows(_max_positions(cfg.student))
    cfg.check()
    out, resume_from = _prepare_output(cfg)
    # every trainable parameter gets a gradient on every step (`Trainee`), so DDP needs no unused-parameter search
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, cpu=cfg.cpu,
                              fsdp_plugin=_fsdp_plugin(cfg.mixed_precision))
    main = accelerator.is_main_process
    sharded = accelerator.distributed_type == DistributedType.FSDP
    if main and _fsdp_launch() and not sharded:
        warnings.warn(f"an FSDP configuration is set, but accelerate shards only on GPUs; this run is "
                      f"{accelerator.distributed_type.value} on {accelerator.device.type}", stacklevel=2)
    if main and out.exists() and resume_from is None and cfg.overwrite:
        shutil.rmtree(out)
    accelerator.wait_for_everyone()
    set_seed(cfg.seed)

    tokenizer = AutoTokenizer.from_pretrained(cfg.student)
    with accelerator.main_process_first():  # the data first: its problems show before any model loads
        rows = with_recall_rows(tokenize_and_pack(load_texts(cfg.data, cfg.text_field, cfg.text_unit), tokenizer,
                                                  cfg.seq_len, num_proc=cfg.num_proc), cfg.recall_share, cfg.seed)
    step = json.loads((resume_from / STATE_FILE).read_text())["step"] if resume_from is not None else 0
    stream = batches(rows, cfg.batch_size, cfg.seed, step * cfg.grad_accum,
                     accelerator.process_index, accelerator.num_processes)
    student = _load_student(cfg.student)
    compute = torch_dtype(COMPUTE_DTYPES[cfg.mixed_precision])
    teacher = _load_teacher(cfg.teacher, student, compute).to(accelerator.device) if cfg.teacher else None
    layers = converted_layers(student.config)
    stage1 = cfg.stage1_steps if cfg.stage1_steps is not None else (-(-cfg.max_steps // 4) if teacher and layers else 0)
    if stage1 and not layers:
        raise AdaptError("the student has no converted layers to transfer attention to; set --stage1-steps 0")
    stream1, tokens_per_row1 = stream, cfg.seq_len
    if stage1 and step < stage1 and cfg.stage1_seq_len not in (None, cfg.seq_len):
        with accelerator.main_process_first():  # attention transfer on rows of its own length
            rows1 = with_recall_rows(tokenize_and_pack(load_texts(cfg.data, cfg.text_field, cfg.text_unit), tokenizer,
                                                       cfg.stage1_seq_len, num_proc=cfg.num_proc),
                                     cfg.recall_share, cfg.seed)
        tokens_per_row1 = cfg.stage1_seq_len
        stream1 = batches(rows1, cfg.batch_size * cfg.seq_len // cfg.stage1_seq_len, cfg.seed, step * cfg.grad_accum,
                          accelerator.process_index, accelerator.num_processes)
        # stage 2 reads the batches it would have read after stage 1 on rows of seq_len
        stream = batches(rows, cfg.batch_size, cfg.seed, stage1 * cfg.grad_accum,
                         accelerator.process_index, accelerator.num_processes)


    new = new_parameter_names(student.config)
    if cfg.train == "lora":
        student = _lora(student, layers, cfg.lora_rank, cfg.lora_alpha)
    if cfg.gradient_checkpointing:
        enable_checkpointing(student)
    n_train = _select_trainable(student, cfg.train, layers, new)
    if n_train == 0:
        raise AdaptError(f"--train {cfg.train} leaves nothing to train in this model; choose another --train")
    optimizer, scheduler = _optimizer(student, new, cfg, stage1)
    model, optimizer = accelerator.prepare(Trainee(student, teacher, cfg.loss), optimizer)
    accelerator.register_for_checkpointing(scheduler)
    accelerator.register_save_state_pre_hook(_drop_tied_copies)
    trainee = accelerator.unwrap_model(model)
    trainee.sharded = sharded
    params = [p for p in model.parameters() if p.requires_grad]  # FSDP replaces the parameters with shards
    # stage 1 trains the converted mixers; the other parameters' gradients are exact zeros, dropped before the step
    transferred = mixer_parameters(model, layers)
    outside_transfer = [p for p in params if id(p) not in transferred]
    student_lm = trainee.student.get_base_model() if cfg.train == "lora" else trainee.student

    if resume_from is not None:
        accelerator.load_state(str(resume_from / "state"))
    log_path = out / LOG_FILE
    if main:
        out.mkdir(parents=True, exist_ok=True)
        kept = [line for line in (log_path.read_text().splitlines() if log_path.exists() else [])
                if json.loads(line)["step"] <= step]
        log_path.write_text("".join(line + "\n" for line in kept))

    if stage1 and step < stage1:
        trainee.transfer = Transfer(teacher, student_lm, layers)
    if watch is not None:
        watch.attach(student_lm, trainee.transfer, layers)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * accelerator.num_processes
    tokens_per_step1 = ((cfg.batch_size * cfg.seq_len // tokens_per_row1) * tokens_per_row1 * cfg.grad_accum
                        * accelerator.num_processes)

    def tokens_after(n: int) -> int:
        return min(n, stage1) * tokens_per_step1 + max(0, n - stage1) * tokens_per_step
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not (main and cfg.progress), desc="adapt", unit="step")
    started = time.perf_counter()
    last = {}
    while step < cfg.max_steps:
        stage = 1 if step < stage1 else 2
        if stage == 2 and trainee.transfer is not None:
            trainee.transfer.remove()
            trainee.transfer = None
        model.train()
        total = torch.zeros((), device=accelerator.device)
        for micro in range(cfg.grad_accum):
            batch = {k: v.to(accelerator.device) for k, v in next(stream1 if stage == 1 else stream).items()}
            sync = nullcontext() if micro == cfg.grad_accum - 1 else accelerator.no_sync(model)
            with sync, accelerator.autocast():
                loss = model(batch, stage)
                accelerator.backward(loss / cfg.grad_accum)
            total += loss.detach() / cfg.grad_accum
        if stage == 1:
            for p in outside_transfer:
                p.grad = None
        grad_norm = accelerator.clip_grad_norm_(params, cfg.max_grad_norm) if cfg.max_grad_norm > 0 else None
        optimizer.step()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if watch is not None:
            watch.step_done(step, stage)
        loss_value = accelerator.reduce(total, "mean").item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"the loss is {loss_value} at step {step}; lower --lr / --stage1-lr "
                                     "or use --mixed-precision bf16 instead of fp16")
        column = "loss_transfer" if stage == 1 else f"loss_{cfg.loss}"  # stage 1: MSE; stage 2: kl or lm
        last = {"step": step, "stage": stage, "loss": loss_value, column: loss_value, "lr": lr,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens": tokens_after(step), "seconds": round(time.perf_counter() - started, 3)}
        if accelerator.device.type == "cuda":  # peak memory of each process's GPU so far
            peak = torch.tensor([torch.cuda.max_memory_allocated(accelerator.device) / 2**30],
                                device=accelerator.device)
            last["peak_memory_gib"] = [round(v, 3) for v in accelerator.gather(peak).tolist()]
        if main:
            with log_path.open("a") as f:
                f.write(json.dumps(last) + "\n")
        bar.set_postfix({column: f"{loss_value:.4f}"})
        bar.update(1)
        stopping = cfg.stop_after is not None and step >= cfg.stop_after
        if step % cfg.save_every == 0 or stopping or step == stage1:
            _checkpoint(accelerator, model, tokenizer, cfg, out, step)
        if stopping:
            bar.close()
            return out
    bar.close()
    if trainee.transfer is not None:
        trainee.transfer.remove()
    save_model(accelerator, model, tokenizer, out, lora=cfg.train == "lora")
    if main:
        _write_card(out, cfg, stage1, tokens_after(step), last)
        if after_training is not None:
            after_training(out, accelerator.device)
        if not cfg.keep_checkpoints:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
    accelerator.wait_for_everyone()
    return out


class Trainee(torch.nn.Module):
    """The student with its training objective: `forward(batch, stage)` returns the step's loss, so
    that data-parallel wrappers (DDP, FSDP) wrap the whole loss, computed inside the wrapped forward.
    The teacher and the stage-1 hooks are held outside the module's parameters."""

    def __init__(self, student, teacher, loss: str) -> None:
        super().__init__()
        self.student = student
        self.loss_kind = loss
        self._outside = {"teacher": teacher, "transfer": None}
        #: under FSDP stage 2 takes the full-logit losses through the student's own forward
        #: (FSDP gathers the head's weight inside the head's forward only)
        self.sharded = False
        # what FSDP's auto-wrap reads: one shard unit per decoder layer, the embeddings carved apart
        base = student.get_base_model() if hasattr(student, "get_base_model") else student
        self._no_split_modules = list(getattr(base, "_no_split_modules", None) or [])

    def get_input_embeddings(self):
        return self.student.get_input_embeddings()

    def get_output_embeddings(self):
        return self.student.get_output_embeddings()

    @property
    def transfer(self) -> Transfer | None:
        return self._outside["transfer"]

    @transfer.setter
    def transfer(self, value: Transfer | None) -> None:
        self._outside["transfer"] = value

    def forward(self, batch: dict, stage: int) -> torch.Tensor:
        from ..modeling.losses import decoder_and_head, mean_chunked_kl, mean_chunked_nll

        teacher = self._outside["teacher"]
        ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
        if stage == 1:
            self.transfer.losses.clear()
            with torch.no_grad():
                _teacher_hidden(teacher, batch)
            out = self.student(input_ids=ids, position_ids=pos, logits_to_keep=1)
            # plus an exact zero through the logits: every parameter joins the graph (DDP without an
            # unused-parameter search; FSDP gathers a layer's weights when a gradient reaches its output)
            return torch.stack(self.transfer.losses).mean() + 0.0 * out.logits.sum()
        if self.sharded:  # FSDP gathers the head's weight inside the head's own forward only: full logits
            return self._sharded_loss(teacher, batch)
        # the final hidden states and the head's weights: the losses apply the head chunk by chunk
        decoder, head = decoder_and_head(self.student)
        out = decoder(input_ids=ids, position_ids=pos, use_cache=False)
        hidden, bias = out.last_hidden_state, getattr(head, "bias", None)
        if self.loss_kind == "lm":
            loss = mean_chunked_nll(hidden, head.weight, labels, bias=bias)
        else:
            with torch.no_grad():
                target = _teacher_hidden(teacher, batch)
            t_head = decoder_and_head(teacher)[1]
            loss = mean_chunked_kl(hidden, head.weight, target, t_head.weight, labels, bias=bias,
                                   teacher_bias=getattr(t_head, "bias", None))
        weight = getattr(self.student.config, "aux_loss_weight", 0.0)
        if out.aux_loss is not None and weight:
            loss = loss + weight * out.aux_loss
        return loss

    def _sharded_loss(self, teacher, batch: dict) -> torch.Tensor:
        """The stage-2 loss on full logits, through the student's own forward (under FSDP)."""
        ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
        if self.loss_kind == "lm":
            return self.student(input_ids=ids, position_ids=pos, labels=labels).loss  # with the weighted aux loss
        with torch.no_grad():
            target = teacher.get_output_embeddings()(_teacher_hidden(teacher, batch))
        out = self.student(input_ids=ids, position_ids=pos)
        loss = kl_to_teacher(out.logits, target, labels)
        weight = getattr(self.student.config, "aux_loss_weight", 0.0)
        if out.aux_loss is not None and weight:
            loss = loss + weight * out.aux_loss
        return loss


def _drop_tied_copies(models, weights, output_dir) -> None:
    """accelerate's `save_state` pre-hook: each tied parameter (the LM head of tied embeddings) once
    in the state it saves, and each other tensor on a storage of its own. A tied copy shares its storage
    with the embedding and is tied again when the state loads; left in, accelerate drops it itself with
    a warning on every checkpoint. Tensors that are other parts of one storage (the parameters of packed
    input projections, views of one packed weight: `modeling.projections`) are saved as copies: accelerate
    keeps one tensor of each storage, so it would drop the others."""
    for state in weights:
        seen, storages = set(), {}
        for name, t in list(state.items()):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            key = (ptr, t.storage_offset(), tuple(t.shape))
            if key in seen:
                del state[name]
                continue
            seen.add(key)
            storages.setdefault(ptr, []).append(name)
        for names in storages.values():
            if len(names) > 1:
                for name in names:
                    state[name] = state[name].clone()


def save_model(accelerator, model, tokenizer, folder: Path, lora: bool = False) -> None:
    """A loadable model folder at `folder` from the prepared `Trainee` (LoRA adapters merged into the
    weights)."""
    student = accelerator.unwrap_model(model).student
    if lora:
        student.merge_adapter()
    state = {k.removeprefix("student."): v for k, v in accelerator.get_state_dict(model).items()}
    target = student
    if lora:
        student.unmerge_adapter()
        target = student.get_base_model()
        state = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
                 for k, v in state.items() if "lora_" not in k}
    if accelerator.is_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        target.save_pretrained(folder, state_dict=state, is_main_process=True)
        tokenizer.save_pretrained(folder)
    accelerator.wait_for_everyone()


def _checkpoint(accelerator, model, tokenizer, cfg: AdaptConfig, out: Path, step: int) -> None:
    folder = out / "checkpoints" / f"step-{step}"
    save_model(accelerator, model, tokenizer, folder, lora=cfg.train == "lora")
    accelerator.save_state(str(folder / "state"))
    if accelerator.is_main_process:
        (folder / STATE_FILE).write_text(json.dumps({"step": step, "config": asdict(cfg)}, indent=1, default=str))
        done = sorted((p for p in (out / "checkpoints").glob("step-*") if (p / STATE_FILE).is_file()),
                      key=lambda p: int(p.name.split("-")[1]))
        for old in done[: -cfg.save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def _write_card(out: Path, cfg: AdaptConfig, stage1: int, tokens: int, last: dict) -> None:
    """The student's card plus a section on this adaptation."""
    card = out / "README.md"
    source = Path(cfg.student).expanduser() / "README.md"
    text = adapted_card(source.read_text()) if source.is_file() else f"# {out.name}\n"
    stage2 = cfg.max_steps - stage1
    rows = [
        ("student", cfg.student), ("teacher", cfg.teacher or "none"),
        ("data", ", ".join(cfg.data)),
        ("sequence length", f"{cfg.seq_len}" + (f" ({cfg.stage1_seq_len} in attention transfer)" if stage1 and
                                                cfg.stage1_seq_len not in (None, cfg.seq_len) else "")),
        ("steps", f"{cfg.max_steps} ({stage1} attention transfer, {stage2} {cfg.loss} fine-tuning)"),
        ("tokens", f"{tokens:,}" + (f" ({cfg.recall_share:.0%} of the rows recall rows)" if cfg.recall_share else "")),
        ("trained parameters", cfg.train),
        ("learning rate", f"{cfg.stage1_lr:g} (stage 1), {cfg.lr:g} (stage 2)"
         + (f"; x{cfg.new_lr_scale:g} for the parameters the dense model lacks" if cfg.new_lr_scale != 1 else "")),
        ("final loss", f"{last.get('loss', float('nan')):.4f} (stage {last.get('stage', '-')})"),
    ]
    section = ("## Adaptation\n\nThis model was adapted with `subquadratic adapt` (the sections above describe the "
               "conversion it started from):\n\n| setting | value |\n| --- | --- |\n")
    section += "".join(f"| {k} | {v} |\n" for k, v in rows)
    section += f"\nThe loss of every step is in `{LOG_FILE}`.\n"
    card.write_text(replace_section(text, "## Adaptation", section))


