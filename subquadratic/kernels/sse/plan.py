"""The one decision of an SSE layer's call: `SSEPlan` (the path of the state recurrence and the kernels
around it, frozen) and `plan_sse`, which makes it from shapes, dtype, device, whether gradients are
needed, the layer's settings and the backend (no tensor is read, so no host synchronisation).

The mixer (`families/sse/modeling.py`: once per forward) and `sse_attention` execute a plan and decide
nothing. A caller, a test or a benchmark sets a field by passing it to `plan_sse` (`path="masked"`,
`fused=False`, ...), or plans as on another device (`device="cuda"` plans the CUDA paths on any
machine: the kernels then run under Triton's interpreter on the CPU); on a model, with the same
keywords, `model.set_plan("sse", ...)`. This module imports neither
Triton nor a kernel (only the PyTorch modules' limits of the fused ops).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..norm_gate import MAX_DIM as NORM_GATE_MAX_DIM
from ..triton_utils import TRITON_DTYPES
from ..utils import check_plan, check_plan_fields, fused_backend, resolve_backend, resolve_precision, triton_available
from .features import MAX_DIM as FEATURES_MAX_DIM
from .router import MAX_PARTITIONS

#: Paths of the state recurrence: "triton" (`triton_sse.sse_triton`: the chunked kernels, the decode
#: kernel for one token without gradients), "torch" (the sorted variable-length form, the recurrent
#: step for one token), "naive" (the serial recurrence at every length) and "masked" (the (N+1)-heads
#: form, a second reference that only a caller asks for).
PATHS = ("triton", "torch", "naive", "masked")
#: Where the GLA base's feature maps and decays run: "kernel" (`features.sse_gla_features`, one Triton
#: launch; inside the SSE kernels where `fused`) or "torch" (the PyTorch ops of the mixer).
FEATURES = ("kernel", "torch")
#: What the feature kernel reads as q2 / k2 (`features.Q2_MODES`).
Q2_MODES = ("full", "offset", "same")
#: Where the router's softmax and top-K run: "kernel" (`triton_router`) or "torch".
ROUTERS = ("kernel", "torch")
#: Where the output norm and gate run: "combine" (inside the SSE kernel that combines each token's rows;
#: `fused` without gradients), "kernel" (`norm_gate`, one Triton launch) or "torch".
NORM_GATES = ("combine", "kernel", "torch")

#: The largest head dims of the SSE kernels (keys, values).
SSE_MAX_DIMS = (128, 256)
#: Chunk sizes the SSE kernels take.
TRITON_CHUNKS = (16, 32, 64)


@dataclass(frozen=True)
class SSEPlan:
    """The path of one SSE call. `path`: the state recurrence (`PATHS`); `features`: the GLA base's
    feature maps and decays (`FEATURES`; always "torch" for GDN), reading q2 / k2 as `q2_mode` says
    (the raw projections: "same" without low-rank offsets, "offset" with them; "full" after qk-norm);
    `fused`: the features computed inside the SSE kernels from the projections
    (`sse_from_projections`, a chunk of tokens on the "triton" path); `router`; `norm_gate`;
    `precision`: the dot precision of the Triton chunked kernels for fp32 operands ("tf32" or
    "ieee"); `inplace`: the one-token forms write the new states into the cache's tensors (a cache
    without gradients); `packed`: the mixer's input is a packed batch's layout, which it unpacks to one
    document per row around the op; `recompute`: a `fused` call with gradients keeps the projections only
    and its backward writes the merged rows (features, (1 + K) rows a token) again, instead of keeping
    them (`triton_sse.RecomputedRows`: a training step's activations, one elementwise launch more)."""

    path: str
    features: str = "torch"
    q2_mode: str = "full"
    fused: bool = False
    router: str = "torch"
    norm_gate: str = "torch"
    precision: str = "ieee"
    inplace: bool = False
    packed: bool = False
    recompute: bool = True

    def __post_init__(self) -> None:
        check_plan(self, (("path", PATHS), ("features", FEATURES), ("q2_mode", Q2_MODES), ("router", ROUTERS),
                          ("norm_gate", NORM_GATES), ("precision", ("ieee", "tf32"))))
        if self.fused and (self.path != "triton" or self.features != "kernel"):
            raise ValueError("SSEPlan.fused needs path='triton' and features='kernel' (the features computed "
                             "inside the SSE kernels)")
        if self.norm_gate == "combine" and not self.fused:
            raise ValueError("SSEPlan.norm_gate='combine' runs inside the fused kernels; set fused=True")


def triton_unsupported(dtype: torch.dtype, base: str, chunk_size: int, head_dim: int, value_dim: int) -> str | None:
    """Why the SSE Triton kernels cannot take these inputs, or None."""
    if base != "gla":
        return f"base {base!r} (the kernels implement the GLA base)"
    if dtype not in TRITON_DTYPES:
        return f"dtype {dtype}"
    if chunk_size not in TRITON_CHUNKS:
        return f"chunk_size {chunk_size} (16, 32 or 64)"
    if head_dim > SSE_MAX_DIMS[0] or value_dim > SSE_MAX_DIMS[1]:
        return f"head dims {head_dim} / {value_dim} (at most {SSE_MAX_DIMS[0]} / {SSE_MAX_DIMS[1]})"
    return None


def _fused_op(backend: str, device: torch.device, dtype: torch.dtype, fits: bool) -> bool:
    """Whether a fused elementwise op (feature maps, router, norm-gate) runs its kernel under a model's
    `backend`: "auto" or "triton", CUDA, Triton installed, a dtype and shapes (`fits`) it takes."""
    return (fused_backend(backend) == "auto" and device.type == "cuda" and triton_available()
            and dtype in TRITON_DTYPES and fits)


def plan_sse(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    num_partitions: int,
    base: str = "gla",
    chunk_size: int = 64,
    backend: str = "auto",
    precision: str = "auto",
    grad: bool = False,
    cached: bool = False,
    packed: bool = False,
    key_topk: int | None = None,
    qk_norm: bool = False,
    lora: bool = False,
    value_dim: int | None = None,
    **fields_set,
) -> SSEPlan:
    """The plan of an SSE layer's call on new tokens of shape [B, T, H, D] (the query heads; K / V
    as many or fewer) whose operands are `dtype` on `device` (a device type is enough: "cuda" plans
    the CUDA paths on any machine), with `num_partitions` partitions, `base` "gla" or "gdn",
    `chunk_size`, the model's `backend` and `precision` (`utils.KERNEL_PRECISIONS`), `grad`: whether
    the call needs gradients, `cached`: whether it reads and writes a cache, `packed`: whether the
    mixer's input is a packed batch's layout, and the layer's `key_topk` (`sse_key_topk`: keys'
    softmax over their top entries only), `qk_norm` and `lora` (low-rank offsets of q2 / k2);
    `value_dim`: the values' head dim where it is not D.
    `fields_set` sets other fields of the plan (`SSEPlan`), e.g. path="masked"; the fields planned after
    them follow from them (`fused` from `path` and `features`, `norm_gate` from `fused`).

    The recurrence takes `utils.resolve_backend`'s path ("triton": CUDA, the GLA base, fp32 / bf16 /
    fp16, chunk_size 16, 32 or 64, head dims up to 128 / 256; an explicit "triton" raises where the
    kernels refuse the inputs). The GLA base's features run in their kernel on CUDA under "auto" or
    "triton" for operands it takes, without `key_topk` truncation, and inside the SSE kernels
    (`fused`) for a chunk of tokens on the "triton" path; the router and the output norm and gate
    take their kernels likewise, the norm and gate inside the combining kernel where `fused` and
    neither gradients nor a packed layout."""
    check_plan_fields(SSEPlan, fields_set, "plan_sse")
    device = torch.device(device)
    B, T, H, D = shape
    pick = fields_set.get  # a field the caller set, else the one planned (and what follows from it)
    path = pick("path") or resolve_backend(backend, device, op="SSE", has_triton=True, has_naive=True,
                                           unsupported=triton_unsupported(dtype, base, chunk_size, D, value_dim or D))
    features = pick("features") or ("kernel" if base == "gla" and not (key_topk and key_topk < D)
                                    and _fused_op(backend, device, dtype, D <= FEATURES_MAX_DIM) else "torch")
    fused = pick("fused", features == "kernel" and path == "triton" and T > 1)
    return SSEPlan(
        path, features=features,
        q2_mode=pick("q2_mode") or ("full" if qk_norm or features == "torch" else "offset" if lora else "same"),
        fused=fused,
        router=pick("router") or ("kernel" if _fused_op(backend, device, dtype, num_partitions <= MAX_PARTITIONS)
                                  else "torch"),
        norm_gate=pick("norm_gate") or ("combine" if fused and not packed and not grad else "kernel"
                                        if _fused_op(backend, device, dtype, D <= NORM_GATE_MAX_DIM) else "torch"),
        precision=resolve_precision(precision, device, dtype), inplace=pick("inplace", cached and not grad),
        packed=packed,
    )
