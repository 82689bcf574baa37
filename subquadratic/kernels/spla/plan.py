"""The one decision of an SPLA call: `SPLAParams` (the op's hyper-parameters, one typed value),
`SPLAPlan` (the path a call takes and the kernels on it, frozen), `plan_spla`, which makes the plan
from shapes, dtype, device, whether gradients are needed and the backend (no tensor is read, so no
host synchronisation), and `plan_append`, the same decision for `append_token`.

`spla_attention` executes a plan; the forms below it read the plan's fields and decide nothing.
A caller or a benchmark sets a field by passing it to `plan_spla` (`form="token"`, `splits=2`,
`launch=Launch(topk_bn=512)`, ...) and the plan to `spla_attention(..., plan=plan)`. This module
imports neither Triton nor a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from ..utils import check_backend, resolve_backend, resolve_precision, triton_available

#: The paths of a call: "dense" (SDPA over every causal key, inside the budget), "torch" (the masked
#: PyTorch form), "torch_decode" (one token per row, reading only the selected blocks),
#: "triton" (the prefill / training kernels) and "triton_decode" (the decode kernels).
PATHS = ("dense", "torch", "torch_decode", "triton", "triton_decode")
#: The paths that read each row's slot of position 0 (`utils.slot_offsets`, one host sync).
OFFSET_PATHS = ("torch_decode", "triton", "triton_decode")

#: Head dimensions the Triton kernels take; their block size must be at least 16 (tl.dot tiles).
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
#: New tokens from which a call on the "triton" path selects in one launch per query tile and runs
#: the query-tile kernels without gradients, the block-major ones with them.
TILE_MIN_TQ = 16
#: New tokens from which phi(k) is computed once per key before the sparse kernels, instead of on
#: every tile they load.
PHIK_PRECOMPUTE_MIN_TQ = 65
#: Calls of up to SPLIT_K_MAX_TQ tokens without gradients split each token's blocks over programs
#: so that about SPLIT_K_PROGRAMS programs run (two per SM of an H200, which has 132).
SPLIT_K_MAX_TQ = 8
SPLIT_K_PROGRAMS = 264
#: Forms of the sparse kernels on the "triton" path: "blocks" (block-major, `triton_blocks`: the
#: selected (token, block) pairs grouped by block), "tile" (query tiles over the union of their
#: tokens' blocks, `triton_tile`) and "token" (one program per token, `triton_parallel`).
FORMS = ("blocks", "tile", "token", "union")
#: Form "union" (prefill without gradients past UNION_MIN_BLOCKS key blocks, from UNION_MIN_TQ new
#: tokens): the tile form when the query tiles' unions hold at most UNION_TILE_MAX blocks on average,
#: else the block-major one, whose time does not grow with the union (docs/benchmarks.md: on iid
#: selections at 32k, unions of 187 blocks, the block-major form is the faster; on real 8k selections,
#: unions of 21-24, the tile form). The mean is read on the host: one synchronisation per such call.
UNION_MIN_BLOCKS = 64
UNION_MIN_TQ = 4096
UNION_TILE_MAX = 64


class UnionHint:
    """The form "union"'s measurement handed from one SPLA layer to the next of the same forward, so
    that one host read per forward decides the form instead of one per layer. The first layer reads its
    own mean union (a synchronisation: the GPU waits for the host's next launch); each later layer
    decides by the mean union of the layer before it, copied to the host without blocking and read
    after waiting for that layer's selection only (`torch.cuda.Event`), so the queue of launched work
    never drains. A given input gives the same forms on every call."""

    def __init__(self) -> None:
        self.pending = None  # (host copy, event) of the last layer's mean union

    def decide(self, mean: torch.Tensor) -> float:
        """The mean union to decide this layer's form by; records this layer's `mean` (0-dim, on the
        device) for the next layer."""
        if self.pending is None or not mean.is_cuda:
            value = float(mean)
        else:
            host, event = self.pending
            event.synchronize()
            value = float(host)
        if mean.is_cuda:
            event = torch.cuda.Event()
            host = mean.to("cpu", non_blocking=True)
            event.record()
            self.pending = (host, event)
        return value


#: Selections on the "triton" path (see `SPLAPlan`).
SELECTIONS = ("tile", "stream", "kernel", "matmul")
#: Input dtypes whose calls from TILE_MIN_TQ tokens on CUDA take the streamed selection, with the
#: score operands it runs in (faster than the tile selection there, with a recall of 0.997 of the
#: exact fp64 selection on iid inputs: docs/benchmarks.md).
STREAM_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class SPLAParams:
    """SPLA's hyper-parameters, the six of `SPLAConfig` (which holds their defaults): per query,
    `top_k_blocks` blocks of `block_size` keys, the first `num_sink_blocks` and the
    `num_local_blocks` most recent (the current partial block included) always among them;
    `selection` "taylor" (second-order block scores) or "mean" (first order); `use_rla=False`
    drops the residual linear term."""

    block_size: int
    top_k_blocks: int
    num_sink_blocks: int
    num_local_blocks: int
    selection: str = "taylor"
    use_rla: bool = True

    @classmethod
    def from_config(cls, config) -> SPLAParams:
        """The six values of an `SPLAConfig` (or any object with these attributes)."""
        return cls(*(getattr(config, name) for name in cls.__dataclass_fields__))

    @property
    def budget_tokens(self) -> int:
        """Keys one query attends to exactly, at most."""
        return self.top_k_blocks * self.block_size

    @property
    def num_selected(self) -> int:
        """Index slots per (token, KV head) of the Triton selection: local, then sink, then top-k
        blocks (-1 where none)."""
        return self.num_local_blocks + self.num_sink_blocks + self.top_k_blocks


@dataclass(frozen=True)
class Launch:
    """Launch settings of the Triton selection and decode kernels (the defaults come from the sweeps
    in docs/benchmarks.md, decode at 128k on the H200)."""

    score_bn: int = 16                 # blocks per program of the scoring kernel
    score_dot: bool = False            # its scores as one padded dot at `score_prec`, else elementwise fp32 sums
    score_prec: str = "ieee"           # that dot's precision ("ieee", or "tf32x3": within fp32 rounding of it)
    score_warps: int = 4
    topk_warps: int = 4                # group top-k kernel up to 4096 blocks (8 warps beyond)
    topk_bn: int | None = None         # blocks per step of its softmax passes (None: 4096 scores per step)
    decode_blocks_per_split: int = 3   # selected blocks per program of the decode kernel
    decode_warps: int = 4


@dataclass(frozen=True)
class SPLAPlan:
    """The path of one SPLA call and the kernels on it. Fields past `grad` matter on the Triton paths
    only: `form` of the sparse kernels on "triton" ("blocks": the selected (token, block) pairs
    grouped by block, forward and backward, `triton_blocks`; "tile": one program per query tile over
    the union of its tokens' blocks; "token": one program per token; "union": "tile" or "blocks" by
    the measured mean union, `UNION_TILE_MAX`), `select` ("tile": one launch
    per query tile, `select_indices_fast`; "stream": the streamed selection, scores on the tensor
    cores and the group top-k in registers, `select_indices_stream`; "kernel": the scoring kernel
    then the group top-k kernel, for a few queries; "matmul": fp32 score matmuls then the top-k
    kernel, which share the block statistics across many queries), `splits` (programs per token's
    blocks, per-token kernels without gradients), `precompute_phik` (phi(k) once per key; the tile
    and token forms), `tile_rows` (rows, tokens x padded group heads, of a query tile),
    `select_prec` (dot precision of the selection: "ieee" or "tf32x3"; "stream" also takes its
    16-bit operands "bf16" and "fp16"), `precision` (dot
    precision of the attention kernels and the causal linear term for fp32 operands: "tf32" or
    "ieee"; 16-bit operands always run on the tensor cores with fp32 accumulation), `fuse_norm`
    (the block-major form without gradients, given the caller's norm: its combine subtracts the
    correction from the causal linear term and adds o_sp + RMSNorm_gamma(o_rla) itself,
    `triton_blocks.RLAEpilogue`; on by default) and `launch` (the
    launch settings; None: `Launch()`)."""

    path: str
    grad: bool = False
    form: str = "token"
    select: str = "kernel"
    splits: int = 1
    precompute_phik: bool = False
    tile_rows: int = 64
    select_prec: str = "ieee"
    precision: str = "ieee"
    fuse_norm: bool = True
    launch: Launch | None = None

    def __post_init__(self) -> None:
        for name, allowed in (("path", PATHS), ("form", FORMS), ("select", SELECTIONS),
                              ("select_prec", ("ieee", "tf32x3", "bf16", "fp16")), ("precision", ("ieee", "tf32"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"SPLAPlan.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.select_prec in ("bf16", "fp16") and self.select != "stream":
            raise ValueError(f"SPLAPlan.select_prec {self.select_prec!r} is a precision of the streamed selection; "
                             "use it with select='stream' (the other selections take 'ieee' or 'tf32x3')")
        if self.splits < 1 or self.tile_rows < 1:
            raise ValueError(f"SPLAPlan.splits and tile_rows must be >= 1, got {self.splits} and {self.tile_rows}")


def selection_precision(select: str, device: torch.device, dtype: torch.dtype) -> str:
    """The dot precision selection `select` runs at by default for `dtype` inputs on `device`: the
    streamed one in the inputs' 16-bit dtype on CUDA (`STREAM_DTYPES`), every other in tf32x3 on
    CUDA (within fp32 rounding of exact) and exact ("ieee") elsewhere."""
    if select == "stream" and device.type == "cuda" and dtype in STREAM_DTYPES:
        return STREAM_DTYPES[dtype]
    return "tf32x3" if device.type == "cuda" else "ieee"


def within_budget(num_key_slots: int, params: SPLAParams) -> bool:
    """True when every row of a cache with `num_key_slots` slots (padding included) has at most
    `top_k_blocks` blocks, i.e. every causal block of every query is selected."""
    return num_key_slots <= params.budget_tokens


def triton_unsupported(head_dim: int, block_size: int, consecutive: bool = True) -> str | None:
    """Why the Triton kernels cannot take these inputs, or None. `consecutive`: whether each row's
    real tokens sit in consecutive cache slots (`utils.slot_offsets` is not None)."""
    if head_dim not in TRITON_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {TRITON_HEAD_DIMS}"
    if block_size < 16:
        return f"block_size {block_size} < 16"
    if not consecutive:
        return "a row has padding in the middle (its tokens are not in consecutive cache slots)"
    return None


def plan_spla(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    params: SPLAParams,
    *,
    backend: str = "auto",
    grad: bool = False,
    consecutive: bool = True,
    precision: str = "auto",
    **fields_set,
) -> SPLAPlan:
    """The plan of SPLA for queries q_shape [B, Tq, HQ, D] over keys k_shape [B, S, H, D] of `dtype`
    on `device` (a device type is enough: "cuda" plans the CUDA paths on any machine), `grad`: whether
    the call needs gradients, `consecutive`: whether each row's tokens sit in consecutive slots (the
    caller knows it only after `slot_offsets`; assume it until then), `precision`: the dot precision
    of fp32 operands asked for (`utils.KERNEL_PRECISIONS`: "auto" is TF32 on CUDA, exact fp32
    elsewhere; fp64 inputs always exact), the plan's `precision`. `fields_set` replaces fields of
    the plan made (`SPLAPlan`), e.g. form="token".

    Inside the budget (S slots, padding included, <= top_k_blocks x block_size: every causal block of
    every row is selected), "auto" and "torch" take "dense". Beyond it `utils.resolve_backend` picks
    the kernels or the PyTorch forms ("triton" needs CUDA and inputs the kernels take,
    `triton_unsupported`; "naive" raises: the definition serves tests only). PyTorch: one token per
    row without gradients and consecutive rows take "torch_decode", the rest "torch". Triton: one
    token without gradients (fp64 excepted) "triton_decode"; otherwise "triton", with the query-tile
    selection from TILE_MIN_TQ tokens and there the block-major kernels with gradients (training:
    forward and backward faster than the tile and per-token forms on every input measured) and the
    tile kernels without (prefill: faster forward on real selections, whose query tiles share
    blocks), or, for prefill calls from UNION_MIN_TQ tokens over more than UNION_MIN_BLOCKS key
    blocks, the block-major kernels with the residual term (its correction costs the tile kernels
    more, and the form then needs no host read) and "union" without it (tile or block-major by the
    measured union: one host read); below TILE_MIN_TQ
    the per-token kernels. From TILE_MIN_TQ tokens, bf16 / fp16 inputs
    on CUDA select with the streamed selection (`STREAM_DTYPES`), fp32 ones with the tile selection
    in tf32x3 (exact up to fp32 rounding); select="tile" asks for the latter on any dtype."""
    check_backend(backend)
    device = torch.device(device)
    prec = resolve_precision(precision, device, dtype)
    B, Tq, _, D = q_shape
    S, H = k_shape[1], k_shape[2]
    if backend in ("auto", "torch") and within_budget(S, params):
        plan = SPLAPlan("dense", grad, precision=prec)
    elif resolve_backend(backend, device, op="SPLA", has_triton=True, has_naive=False,
                         unsupported=triton_unsupported(D, params.block_size, consecutive)) == "torch":
        plan = SPLAPlan("torch_decode" if Tq == 1 and not grad and consecutive else "torch", grad, precision=prec)
    else:
        long_call = Tq >= TILE_MIN_TQ
        # 16-bit inputs on CUDA: the streamed selection (scores on the tensor cores in the inputs'
        # dtype); fp32 inputs keep the exact tile selection
        select = ("stream" if device.type == "cuda" and dtype in STREAM_DTYPES else "tile") if long_call else "kernel"
        if not long_call:
            form = "token"
        elif grad:
            form = "blocks"
        else:  # prefill: tile, or for long calls over many blocks block-major with the residual term
            # (no host read) and without it tile / block-major by the measured union
            long_prefill = Tq >= UNION_MIN_TQ and -(-S // params.block_size) > UNION_MIN_BLOCKS
            form = ("blocks" if params.use_rla else "union") if long_prefill else "tile"
        splits = 1
        if not grad and Tq <= SPLIT_K_MAX_TQ:
            splits = max(1, min(params.num_selected, SPLIT_K_PROGRAMS // max(1, B * H * Tq)))
        plan = SPLAPlan(
            "triton_decode" if Tq == 1 and not grad and dtype != torch.float64 else "triton", grad,
            form=form, select=select,
            splits=splits, precompute_phik=params.use_rla and Tq >= PHIK_PRECOMPUTE_MIN_TQ,
            tile_rows=64 if grad else 128, select_prec=selection_precision(select, device, dtype),
            precision=prec,
        )
    if not fields_set:
        return plan
    unknown = set(fields_set) - {f.name for f in fields(SPLAPlan)}
    if unknown:
        raise TypeError(f"plan_spla got {sorted(unknown)}, which are not fields of SPLAPlan; "
                        f"its fields: {', '.join(f.name for f in fields(SPLAPlan))}")
    if "select" in fields_set and "select_prec" not in fields_set and plan.path == "triton":
        # a selection asked for without its precision: that selection's default for these inputs
        fields_set["select_prec"] = selection_precision(fields_set["select"], device, dtype)
    return replace(plan, **fields_set)


def plan_append(k_shape: tuple[int, ...], device: torch.device | str, sums_dtype: torch.dtype, *,
                unit_stride: bool, backend: str = "auto") -> str:
    """The path of `append_token` for new keys k_shape [B, H, T, D] written into a static cache on
    `device` whose block sums are `sums_dtype`; `unit_stride`: K, V and the sums have unit stride in D.
    "triton" (one launch) for one token per row on CUDA under "auto" or "triton" with Triton
    installed, a head dim the kernels take and fp32 sums; else "torch" (index_copy_ and
    `BlockStats.add_`, the same sums). Both write the same values, so inputs the kernel does not take
    go to "torch" under any backend (a static cache's prefill, the CPU)."""
    one_launch = (backend in ("auto", "triton") and torch.device(device).type == "cuda" and k_shape[2] == 1
                  and triton_available() and k_shape[-1] in TRITON_HEAD_DIMS and sums_dtype == torch.float32
                  and unit_stride)
    return "triton" if one_launch else "torch"
