"""Which layers of a hybrid keep softmax attention, chosen by measurement (`--<family>-softmax-layers
auto:K`): the K layers whose replacement costs the most.

`layer_costs(src, to, options, calibration)` converts the dense checkpoint `src` with every layer
replaced (the family `to` with `options`, their layout dropped) and runs a short attention transfer
(stage 1 of `adapt`): each replaced layer gets the dense layer's input and learns to reproduce the
dense layer's output, and the residual stream passed on is the dense one, so the layers learn side
by side, independently, and one run measures them all. Per layer, summed over the last half of the
`calibration.steps` steps and over real tokens:

    cost           = sum |o - o_dense|^2 / sum |h|^2      (h: the residual stream entering the layer)
    relative_error = sum |o - o_dense|^2 / sum |o_dense|^2   (None where the dense layer outputs zeros)

`cost` is the error the replacement adds to the residual stream, relative to that stream's size:
what the next layer's RMSNorm passes on. `choose_softmax_layers(costs, k)` keeps the k costliest.

Why this measure: one short run prices every layer at once, with the loss stage 1 minimises anyway;
the KL of replacing one layer at a time needs a transferred model first and a forward pass per
layer and window. Whether it picks better layers than a fixed layout is for the ablation rows of
`scripts/real_quality.py` to show.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

#: The layout value that asks for measured softmax layers: "auto:K".
AUTO = re.compile(r"^auto:(\d+)$")


@dataclass
class Calibration:
    """The short attention transfer that prices the layers. `data`: text files (`data.load_texts`);
    None: the English documentation topics that ship with CPython (`pydoc_data.topics`)."""

    data: list[str] | None = None
    steps: int = 40
    seq_len: int = 1024
    batch_size: int = 4
    lr: float = 1e-3
    device: str = "auto"
    seed: int = 0

    def check(self) -> None:
        for name in ("steps", "seq_len", "batch_size"):
            if getattr(self, name) < (2 if name != "batch_size" else 1):
                raise ValueError(f"calibration {name} must be at least {2 if name != 'batch_size' else 1}, "
                                 f"got {getattr(self, name)}")


def auto_layer_count(value) -> int | None:
    """K of a layout value "auto:K"; None for any other value (a layer list, None)."""
    if not isinstance(value, str) or not value.startswith("auto"):
        return None
    m = AUTO.match(value.strip())
    if m is None:
        raise ValueError(f"softmax_layers {value!r}: write auto:K with K the number of softmax layers, like auto:5")
    return int(m.group(1))


def choose_softmax_layers(costs: list[dict], k: int) -> list[int]:
    """The k layers of highest `cost` (ties: the lower index), in layer order."""
    if not 0 < k < len(costs):
        raise ValueError(f"auto:{k} asks for {k} softmax layers of {len(costs)}; choose K in 1..{len(costs) - 1}")
    ranked = sorted(costs, key=lambda c: (-c["cost"], c["layer"]))
    return sorted(c["layer"] for c in ranked[:k])


def _english_file(folder: Path) -> str:
    from ..demo.assets import english_text

    path = folder / "calibration.txt"
    path.write_text(english_text(min_chars=10 ** 9))
    return str(path)


def layer_costs(src: str | Path, to: str, options: dict, calibration: Calibration | None = None,
                progress: bool = False) -> dict:
    """{"layers": [{"layer", "cost", "relative_error", "mse"}], "settings": ...} for every layer of
    `src` converted to `to` (see the module doc); nothing is left on disk."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..conversion.core import LAYOUT_OPTIONS, convert
    from ..data import batches, load_texts, tokenize_and_pack
    from .train import Trainee, Transfer, _lr_lambda, converted_layers

    cal = calibration or Calibration()
    cal.check()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cal.device == "auto" else cal.device)
    work = Path(tempfile.mkdtemp(prefix="layer-costs-"))
    try:
        every = {k: v for k, v in options.items() if k not in LAYOUT_OPTIONS}
        folder = convert(str(src), str(work / "every-layer"), to, options={**every, "softmax_layers": ""},
                         progress=False)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        data = cal.data or [_english_file(work)]
        rows = tokenize_and_pack(load_texts(data), tokenizer, cal.seq_len)
        stream = batches(rows, cal.batch_size, cal.seed)
        torch.manual_seed(cal.seed)
        student = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
        compute = torch.bfloat16 if device.type == "cuda" else torch.float32
        teacher = AutoModelForCausalLM.from_pretrained(src, dtype=compute).to(device).eval().requires_grad_(False)
        layers = converted_layers(student.config)
        prefixes = tuple(f"model.layers.{i}.self_attn." for i in layers)
        for name, p in student.named_parameters():
            p.requires_grad_(name.startswith(prefixes))
        params = [p for p in student.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1.0, betas=(0.9, 0.95), weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cal.steps, cal.steps, 0.05, cal.lr, cal.lr))
        trainee = Trainee(student, teacher, "kl")
        trainee.transfer = transfer = Transfer(teacher, student, layers)
        # per layer: squared error, |h|^2, |o_dense|^2, entries counted
        sums = {i: torch.zeros(4, dtype=torch.float64, device=device) for i in layers}
        step_sums: dict[int, torch.Tensor] = {}
        handles = []
        for i in layers:
            handles.append(student.model.layers[i].register_forward_pre_hook(_residual(i, step_sums),
                                                                             with_kwargs=True))
            handles.append(student.model.layers[i].self_attn.register_forward_hook(_error(i, step_sums, transfer),
                                                                                  with_kwargs=True))
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
        from tqdm.auto import tqdm

        student.train()
        for step in tqdm(range(cal.steps), desc="pricing layers", disable=not progress):
            batch = {k: v.to(device) for k, v in next(stream).items()}
            step_sums.clear()
            with autocast:
                loss = trainee(batch, 1)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= cal.steps // 2:
                for i in layers:
                    sums[i] += step_sums[i]
        for h in handles:
            h.remove()
        transfer.remove()
        out = []
        for i in layers:
            err, resid, dense, count = sums[i].tolist()
            out.append({"layer": i, "cost": err / resid, "relative_error": err / dense if dense else None,
                        "mse": err / count})
        settings = {**asdict(cal), "data": cal.data or "pydoc_data.topics (CPython's documentation topics)",
                    "device": str(device), "to": to, "options": every}
        return {"layers": out, "settings": settings}
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
