"""Which layers of a hybrid keep softmax attention, chosen by measurement (`--<family>-softmax-layers
auto:K`: the K layers whose replacement costs the most; `retrieval:K`: the K layers holding the dense
source's strongest retrieval heads, `retrieval_head_layout`, the convert presets' default as
`retrieval:1/6`). This module sits above conversion and adaptation: `convert` is
`conversion.convert` with such a layout resolved first (`layout_chooser`), and the auto:K
measurement is a short run of `adapt`.

`layer_costs(src, to, options, calibration)` converts the dense checkpoint `src` with every layer
replaced (the family `to` with `options`, their layout dropped) and runs a short attention transfer
(stage 1 of `adapt`, the same training loop, followed from inside by `LayerPricing`): each replaced
layer gets the dense layer's input and learns to reproduce the dense layer's output, and the residual
stream passed on is the dense one, so the layers learn side by side, independently, and one run
measures them all. Per layer, summed over the last half of the `calibration.steps` steps and over
real tokens:

    cost           = sum |o - o_dense|^2 / sum |h|^2      (h: the residual stream entering the layer)
    relative_error = sum |o - o_dense|^2 / sum |o_dense|^2   (None where the dense layer outputs zeros)

`cost` is the error the replacement adds to the residual stream, relative to that stream's size:
what the next layer's RMSNorm passes on. `choose_softmax_layers(costs, k)` keeps the k costliest.

Why this measure: one short run prices every layer at once, with the loss stage 1 minimises anyway;
the KL of replacing one layer at a time needs a transferred model first and a forward pass per
layer and window. Whether it picks better layers than a fixed layout is for the ablation rows of
the real-model protocol (`scripts/studies/real_quality.py`) to show.

The value "METHOD:K" is read by `checks.layer_choice_spec` (the methods: `checks.LAYER_CHOICE_METHODS`);
`METHODS` maps each method to the function that chooses its layers here.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .adaptation.train import Transfer, Watch
from .conversion.core import LAYOUT_OPTIONS, ChosenLayout, ConversionError, evenly_spaced


@dataclass
class Calibration:
    """The short attention transfer that prices the layers. `data`: text files (`data.load_texts`);
    None: the English documentation topics that ship with CPython (`pydoc_data.topics`). `device`:
    "cpu", or "auto" / "cuda" (the GPU accelerate gives a single process, where there is one)."""

    data: list[str] | None = None
    steps: int = 40
    seq_len: int = 1024
    batch_size: int = 4
    lr: float = 1e-3
    device: str = "auto"
    seed: int = 0

    def check(self) -> None:
        """ValueError naming a setting out of range."""
        for name in ("steps", "seq_len", "batch_size"):
            if getattr(self, name) < (2 if name != "batch_size" else 1):
                raise ValueError(f"calibration {name} must be at least {2 if name != 'batch_size' else 1}, "
                                 f"got {getattr(self, name)}")


def choose_softmax_layers(costs: list[dict], k: int) -> list[int]:
    """The k layers of highest `cost` (ties: the lower index), in layer order."""
    if not 0 < k < len(costs):
        raise ValueError(f"auto:{k} asks for {k} softmax layers of {len(costs)}; choose K in 1..{len(costs) - 1}")
    ranked = sorted(costs, key=lambda c: (-c["cost"], c["layer"]))
    return sorted(c["layer"] for c in ranked[:k])


def _english_file(folder: Path) -> str:
    from .demo.assets import english_text

    path = folder / "calibration.txt"
    path.write_text(english_text(min_chars=10 ** 9))
    return str(path)


def layer_costs(src: str | Path, to: str, options: dict, calibration: Calibration | None = None,
                progress: bool = False) -> dict:
    """{"layers": [{"layer", "cost", "relative_error", "mse"}], "settings": ...} for every layer of
    `src` (a checkpoint folder) converted to `to` (see the module doc); nothing is left on disk."""
    from accelerate.state import AcceleratorState, PartialState

    from .adaptation.train import AdaptConfig, adapt
    from .conversion.core import convert as convert_checkpoint

    cal = calibration or Calibration()
    cal.check()
    cuda = cal.device != "cpu" and torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix="layer-costs-"))
    fresh_state = PartialState._shared_state == {}  # accelerate's process-wide state, set by adapt's Accelerator
    try:
        every = {k: v for k, v in options.items() if k not in LAYOUT_OPTIONS}
        folder = convert_checkpoint(str(src), str(work / "every-layer"), to, options={**every, "softmax_layers": ""},
                                    progress=False)
        data = cal.data or [_english_file(work)]
        pricing = LayerPricing(cal.steps)
        # stage 1 only, on the replaced mixers; stop_after: no final model, only the measurement is kept
        adapt(AdaptConfig(student=str(folder), output_dir=str(work / "transfer"), data=data,
                          teacher=str(src), max_steps=cal.steps, stage1_steps=cal.steps, train="mixer",
                          seq_len=cal.seq_len, batch_size=cal.batch_size, stage1_lr=cal.lr, lr=cal.lr,
                          warmup_ratio=0.05, max_grad_norm=1.0, mixed_precision="bf16" if cuda else "no",
                          cpu=not cuda, seed=cal.seed, save_every=cal.steps, progress=progress, stop_after=cal.steps),
              watch=pricing)
        settings = {**asdict(cal), "data": cal.data or "pydoc_data.topics (CPython's documentation topics)",
                    "device": "cuda" if cuda else "cpu", "to": to, "options": every}
        return {"layers": pricing.costs(), "settings": settings}
    finally:
        if fresh_state:  # leave no precision or device behind for the process's next Accelerator
            AcceleratorState._reset_state(reset_partial_state=True)
        shutil.rmtree(work, ignore_errors=True)


class LayerPricing(Watch):
    """Follows the attention transfer of `layer_costs` from inside `adapt`: per converted layer the
    squared error, |h|^2, |o_dense|^2 and the entries counted, summed over the steps after the first
    half of `steps`."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.layers: list[int] = []
        self.sums: dict[int, torch.Tensor] = {}
        self.step_sums: dict[int, torch.Tensor] = {}
        self.handles: list = []

    def attach(self, student, transfer: Transfer | None, layers: list[int]) -> None:
        device = next(student.parameters()).device
        self.layers = layers
        self.sums = {i: torch.zeros(4, dtype=torch.float64, device=device) for i in layers}
        for i in layers:  # after the transfer's own hooks: the mixer's output is then the dense one
            self.handles.append(student.model.layers[i].register_forward_pre_hook(_residual(i, self.step_sums),
                                                                                  with_kwargs=True))
            self.handles.append(student.model.layers[i].self_attn.register_forward_hook(
                _error(i, self.step_sums, transfer), with_kwargs=True))

    def step_done(self, step: int, stage: int) -> None:
        if step > self.steps // 2:
            for i in self.layers:
                self.sums[i] += self.step_sums[i]
        self.step_sums.clear()
        if step == self.steps:
            for h in self.handles:
                h.remove()
            self.handles = []

    def costs(self) -> list[dict]:
        out = []
        for i in self.layers:
            err, resid, dense, count = self.sums[i].tolist()
            out.append({"layer": i, "cost": err / resid, "relative_error": err / dense if dense else None,
                        "mse": err / count})
        return out


def transfer_cost_layout(src: Path, to: str, options: dict, k: int, calibration: Calibration,
                         progress: bool) -> ChosenLayout:
    """auto:K: the K layers of highest `layer_costs` cost; the measurement goes to layer_costs.json."""
    try:
        calibration.check()
    except ValueError as e:
        raise ConversionError(f"invalid settings: {e}") from None
    costs = layer_costs(src, to, options, calibration, progress=progress)
    chosen = choose_softmax_layers(costs["layers"], k)
    note = (f"{','.join(map(str, chosen))} (auto:{k}: the {k} layers whose replacement costs the most after a "
            "short attention transfer; layer_costs.json)")
    return ChosenLayout(chosen, note, {"layer_costs.json": {**costs, "chosen": chosen}})


#: the needle prompts' length when scoring retrieval heads (capped at the source's context)
RETRIEVAL_SCORE_LENGTH = 2048


def retrieval_head_layout(src: Path, to: str, options: dict, k: int, calibration: Calibration,
                          progress: bool) -> ChosenLayout:
    """retrieval:K: the K layers whose strongest head attends most to a needle while its value is read
    back (`evaluation.retrieval_heads`), scored on the dense source (in its own dtype, on
    `calibration.device`, with its seed) at RETRIEVAL_SCORE_LENGTH tokens; the scores go to
    retrieval_heads.json."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .evaluation.errors import EvaluationError
    from .evaluation.retrieval_heads import choose_retrieval_layers, layer_scores, retrieval_head_scores
    from .evaluation.suite import resolve_device

    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except Exception:  # no tokenizer files: the needle prompts cannot be written
        chosen = evenly_spaced(AutoConfig.from_pretrained(src).num_hidden_layers, k)
        warnings.warn(f"retrieval:{k} scores the source on needle prompts and {src} has no tokenizer; softmax layers "
                      f"at {','.join(map(str, chosen))} (evenly spaced) instead: add the tokenizer files to choose "
                      "them by retrieval", stacklevel=2)
        return ChosenLayout(chosen, f"{','.join(map(str, chosen))} (evenly spaced: the source has no tokenizer for "
                                    f"retrieval:{k})", {})
    try:
        device = resolve_device(calibration.device)
    except EvaluationError as e:
        raise ConversionError(str(e)) from None
    length = min(RETRIEVAL_SCORE_LENGTH, getattr(AutoConfig.from_pretrained(src), "max_position_embeddings", None)
                 or RETRIEVAL_SCORE_LENGTH)
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto").to(device)
    try:
        heads = retrieval_head_scores(model, tokenizer, length=length, seed=calibration.seed, progress=progress)
    except EvaluationError as e:
        raise ConversionError(f"retrieval:{k}: {e}") from None
    finally:
        del model
    scores = layer_scores(heads)
    chosen = choose_retrieval_layers(scores, k)
    note = (f"{','.join(map(str, chosen))} (retrieval:{k}: the {k} layers whose strongest head attends most to a "
            f"needle while its value is read back, scored on the dense source at {length} tokens; "
            "retrieval_heads.json)")
    record = {"length": length, "layers": scores, "heads": heads.tolist(), "chosen": chosen}
    return ChosenLayout(chosen, note, {"retrieval_heads.json": record})


#: method of a "METHOD:K" layout (`checks.LAYER_CHOICE_METHODS`) -> the function that chooses its K layers:
#: (source folder, target, options, K, calibration, progress) -> `conversion.core.ChosenLayout`
METHODS = {"auto": transfer_cost_layout, "retrieval": retrieval_head_layout}


def layout_chooser(calibration: Calibration | None = None):
    """The `conversion.core.LayoutChooser` that resolves a measured layout with `METHODS`, measuring
    with `calibration` (default: `Calibration()`)."""

    def choose(src: Path, to: str, options: dict, spec: tuple[str, int], progress: bool) -> ChosenLayout:
        method, k = spec
        return METHODS[method](src, to, options, k, calibration or Calibration(), progress)

    return choose


def convert(src: str | Path, out: str | Path, to: str, options: dict | None = None,
            calibration: Calibration | None = None, **kwargs: Any) -> Path:
    """`conversion.convert(src, out, to, options, **kwargs)` where a `softmax_layers` of "auto:K" is
    chosen by measurement first (with `calibration`); the measurement is written to
    OUT/layer_costs.json and the choice into the card."""
    from .conversion.core import convert as convert_checkpoint

    return convert_checkpoint(src, out, to, options, choose_layout=layout_chooser(calibration), **kwargs)


def _valid(seq, like: torch.Tensor) -> torch.Tensor:
    """[B, T, 1] float mask of the real tokens of `like` (a packed batch's own layout or one document per
    row: `SequenceInfo.valid_like`)."""
    return seq.valid_like(like)[..., None].to(torch.float64 if like.dtype == torch.float64 else torch.float32)


def _residual(i: int, sums: dict):
    """Pre-hook of student layer i: sum over real tokens of |h|^2, h the residual stream entering it
    (the dense model's: every replaced layer passes the dense output on)."""

    def hook(module, args, kwargs):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        pending = kwargs["pending"] if "pending" in kwargs else args[1] if len(args) > 1 else None
        if pending is not None:  # the previous layer's MLP output, which this layer's norm adds
            h = h + pending
        seq = kwargs["seq"] if "seq" in kwargs else args[3]
        energy = (h.detach().float() ** 2 * _valid(seq, h)).sum().double()
        zero = torch.zeros_like(energy)
        sums[i] = torch.stack([zero, energy, zero, zero])

    return hook


def _error(i: int, sums: dict, transfer):
    """Forward hook of student mixer i, after the transfer's: sum over real tokens of the squared error
    (the transfer's mean times its count) and of |o_dense|^2 (the output the transfer passed on)."""

    def hook(module, args, kwargs, output):
        want = output[0].detach().float()
        valid = _valid(args[2], want)
        count = (valid.sum() * want.shape[-1]).double()
        err = transfer.losses[-1].detach().double() * count
        sums[i] = sums[i] + torch.stack([err, torch.zeros_like(err), (want ** 2 * valid).sum().double(), count])

    return hook
