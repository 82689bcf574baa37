"""The one decision of an HLA layer's call: `HLAPlan` (the path of the recurrence and the kernels around
it, frozen) and `plan_hla`, which makes it from shapes, dtype, device, whether gradients are needed,
the layer's settings and the backend (no tensor is read, so no host synchronisation).

The mixer (`families/hla/modeling.py`: once per forward) and `hla_attention` execute a plan and decide
nothing. A caller, a test or a benchmark sets a field by passing it to `plan_hla` (`path="naive"`,
`features="torch"`, ...), or plans as on another device (`device="cuda"` plans the CUDA paths on any
machine: the kernels then run under Triton's interpreter on the CPU); on a model, with the same
keywords, `model.set_plan("hla", ...)`. This module imports neither Triton nor a kernel (only the
PyTorch modules' limits of the fused ops).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..norm_gate import MAX_DIM as NORM_GATE_MAX_DIM
from ..triton_utils import TRITON_DTYPES
from ..utils import check_plan, check_plan_fields, resolve_backend, resolve_precision, triton_available

#: Paths of the recurrence: "triton" (`hla_triton`: the chunked kernels, the fused recurrent one for
#: one token without gradients), "torch" (the chunked form, the recurrence for one token), "naive" (the
#: recurrence at every length) and "definition" (the O(T^3) definition from a zero state, without the
#: state after it: a reference that only a caller asks for).
PATHS = ("triton", "torch", "naive", "definition")
#: Where q / k's L2 normalisation, the KV heads' repeat and the log decays run: "kernel" (one Triton
#: launch, `features.hla_features_and_decay`) or "torch".
FEATURES = ("kernel", "torch")
#: Where the output norm and gate run: "kernel" (`norm_gate`, one Triton launch) or "torch".
NORM_GATES = ("kernel", "torch")
#: The backends under which the feature and norm-gate kernels run (on CUDA, for inputs they take).
KERNEL_BACKENDS = ("auto", "triton")


@dataclass(frozen=True)
class HLAPlan:
    """The path of one HLA call: `path` (`PATHS`), `features` (`FEATURES`; "torch" without
    `qk_norm_l2`), `norm_gate` (`NORM_GATES`; "torch" without both an output norm and a gate),
    `precision` (the dots of the Triton chunked kernels for fp32 operands: "tf32" or "ieee") and
    `packed` (the mixer's input is a packed batch's layout, run one document per row around the op)."""

    path: str
    features: str = "torch"
    norm_gate: str = "torch"
    precision: str = "ieee"
    packed: bool = False

    def __post_init__(self) -> None:
        check_plan(self, (("path", PATHS), ("features", FEATURES), ("norm_gate", NORM_GATES),
                          ("precision", ("ieee", "tf32"))))


def triton_unsupported(dtype: torch.dtype, chunk_size: int, decode: bool) -> str | None:
    """Why the HLA Triton kernels cannot take these inputs, or None: the dtype (fp64 stays on the
    PyTorch forms), and for the chunked kernels (`decode` False) a chunk size that is not a power of
    two >= 16."""
    if dtype not in TRITON_DTYPES:
        return f"dtype {dtype} is not one of {TRITON_DTYPES}"
    if not decode and (chunk_size < 16 or chunk_size & (chunk_size - 1)):
        return f"chunk_size {chunk_size} is not a power of two >= 16"
    return None


def plan_hla(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    chunk_size: int = 64,
    backend: str = "auto",
    precision: str = "auto",
    grad: bool = False,
    packed: bool = False,
    qk_norm_l2: bool = False,
    output_norm_gate: bool = False,
    **fields_set,
) -> HLAPlan:
    """The plan of an HLA layer's call on queries of shape [B, T, HQ, D] whose operands are `dtype` on
    `device` (a device type is enough: "cuda" plans the CUDA paths on any machine), with `chunk_size`,
    the model's `backend` and `precision` (`utils.KERNEL_PRECISIONS`), `grad`: whether the call needs
    gradients, `packed`: whether the mixer's input is a packed batch's layout, and the layer's
    `qk_norm_l2` and `output_norm_gate` (both an output norm and an output gate). `fields_set` sets other fields
    of the plan (`HLAPlan`), e.g. path="naive".

    The recurrence takes `utils.resolve_backend`'s path: "auto" the Triton kernels on CUDA with Triton
    installed for fp32 / bf16 / fp16 and, unless one token without gradients (the fused recurrent
    kernel), a chunk size that is a power of two >= 16; "triton" them or a ValueError. The feature
    maps (with the log decays) and the output norm and gate take their kernels on CUDA under "auto"
    or "triton" for operands they take."""
    check_plan_fields(HLAPlan, fields_set, "plan_hla")
    device = torch.device(device)
    T, D = shape[1], shape[-1]
    why = None
    if device.type == "cuda" and backend in KERNEL_BACKENDS:
        why = triton_unsupported(dtype, chunk_size, decode=T == 1 and not grad)
    kernels = (backend in KERNEL_BACKENDS and device.type == "cuda" and triton_available()
               and dtype in TRITON_DTYPES)  # the feature and norm-gate kernels take these operands
    norm_gate = output_norm_gate and kernels and D <= NORM_GATE_MAX_DIM
    pick = fields_set.get  # a field the caller set, else the one planned
    return HLAPlan(
        pick("path") or resolve_backend(backend, device, op="HLA", has_triton=True, has_naive=True, unsupported=why),
        features=pick("features") or ("kernel" if qk_norm_l2 and kernels else "torch"),
        norm_gate=pick("norm_gate") or ("kernel" if norm_gate else "torch"),
        precision=resolve_precision(precision, device, dtype), packed=packed,
    )
