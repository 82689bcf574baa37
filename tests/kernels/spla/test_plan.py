"""The plan of an SPLA call (`plan_spla`, `plan_append`): the path and kernels picked for
representative inputs, the CUDA ones planned with the device type as data (no GPU needed; Triton
counted as installed), explicit fields that replace the plan's choices and reach the kernels, and
the typed hyper-parameters built from a config."""

from __future__ import annotations

import pytest
import torch

from subquadratic import SPLAConfig
from subquadratic.kernels import utils
from subquadratic.kernels.spla import Launch, SPLAParams, SPLAPlan, plan, plan_append, plan_spla

P = SPLAParams(block_size=16, top_k_blocks=3, num_sink_blocks=1, num_local_blocks=1)  # budget 48 keys
WIDE = SPLAParams(block_size=64, top_k_blocks=16, num_sink_blocks=1, num_local_blocks=2)  # 19 index slots


def triton_installed(monkeypatch, installed: bool) -> None:
    """Plan as on a machine with (or without) Triton: `resolve_backend` and `plan_append` ask."""
    monkeypatch.setattr(utils, "triton_available", lambda: installed)
    monkeypatch.setattr(plan, "triton_available", lambda: installed)


@pytest.fixture
def with_triton(monkeypatch):
    triton_installed(monkeypatch, True)


@pytest.fixture
def without_triton(monkeypatch):
    triton_installed(monkeypatch, False)


def planned(Tq, S, device="cuda", *, B=2, HQ=8, H=2, D=64, dtype=torch.bfloat16, params=P, **kw):
    return plan_spla((B, Tq, HQ, D), (B, S, H, D), dtype, device, params, **kw)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("Tq,S", [(48, 48), (1, 48), (5, 30)])
def test_inside_the_budget_is_dense(device, backend, Tq, S, with_triton):
    assert planned(Tq, S, device, backend=backend, grad=Tq > 1).path == "dense"
    assert planned(Tq, 49, device, backend=backend).path != "dense"


def test_triton_backend_takes_the_kernels_inside_the_budget_too(with_triton):
    assert planned(48, 48, backend="triton").path == "triton"
    assert planned(1, 48, backend="triton").path == "triton_decode"


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cpu_beyond_the_budget_takes_the_pytorch_forms(backend, with_triton):
    assert planned(1, 100, "cpu", backend=backend).path == "torch_decode"  # decode without gradients
    assert planned(1, 100, "cpu", backend=backend, grad=True).path == "torch"
    assert planned(1, 100, "cpu", backend=backend, consecutive=False).path == "torch"
    assert planned(40, 100, "cpu", backend=backend).path == "torch"
    assert planned(1, 100, "cuda", backend="torch").path == "torch_decode"


def test_cuda_beyond_the_budget_takes_the_kernels(with_triton):
    decode = planned(1, 100)
    assert decode.path == "triton_decode" and not decode.grad and decode.select == "kernel"
    assert planned(1, 100, dtype=torch.float64).path == "triton"  # fp64 (tests): prefill kernels in fp32
    train_token = planned(1, 100, grad=True)
    assert (train_token.path, train_token.form, train_token.grad, train_token.splits) == ("triton", "token", True, 1)
    short = planned(15, 100)
    assert (short.path, short.form, short.select, short.precompute_phik) == ("triton", "token", "kernel", False)
    prefill = planned(16, 100)  # bf16: the streamed selection in bf16
    assert (prefill.form, prefill.select, prefill.tile_rows, prefill.select_prec) == ("tile", "stream", 128, "bf16")
    prefill32 = planned(16, 100, dtype=torch.float32)  # fp32: the tile selection, exact up to fp32 rounding
    assert (prefill32.form, prefill32.select, prefill32.select_prec) == ("tile", "tile", "tf32x3")
    assert planned(16, 100, dtype=torch.float16).select_prec == "fp16"
    train = planned(16, 100, grad=True)  # training: the block-major kernels, forward and backward
    assert (train.form, train.select, train.tile_rows, train.grad) == ("blocks", "stream", 64, True)
    assert planned(4096, 4096, grad=True).form == "blocks"
    # a long prefill over many blocks: block-major with the residual term, without it tile or block-major by
    # the measured union; shorter ones the tile form
    no_rla = SPLAParams(block_size=16, top_k_blocks=3, num_sink_blocks=1, num_local_blocks=1, use_rla=False)
    assert planned(4096, 4096).form == "blocks" and planned(4095, 8192).form == "tile"
    assert planned(4096, 4096, params=no_rla).form == "union" and planned(4095, 8192, params=no_rla).form == "tile"
    assert planned(15, 100, grad=True).form == "token"
    assert not planned(64, 100).precompute_phik and planned(65, 100).precompute_phik
    assert not planned(65, 100, params=no_rla).precompute_phik
    assert planned(16, 100, "cpu", backend="auto").path == "torch"


def test_precision_tf32_for_fp32_on_cuda_unless_exact_is_asked(with_triton):
    """fp32 operands: TF32 dots on CUDA by default ("auto"), exact ("ieee") where asked and on the CPU;
    fp64 inputs (tests) always exact; every path carries the field."""
    for Tq, grad in ((1, False), (16, False), (16, True), (1, True)):
        assert planned(Tq, 100, dtype=torch.float32, grad=grad).precision == "tf32"
        assert planned(Tq, 100, dtype=torch.float32, grad=grad, precision="ieee").precision == "ieee"
        assert planned(Tq, 100, dtype=torch.float64, grad=grad, precision="tf32").precision == "ieee"
    assert planned(16, 100, "cpu", backend="auto").precision == "ieee"
    assert planned(16, 100, "cpu", backend="auto", precision="tf32").precision == "tf32"
    assert planned(16, 40).path == "dense" and planned(16, 40, precision="ieee").precision == "ieee"
    with pytest.raises(ValueError, match="kernel_precision"):
        planned(16, 100, precision="fp32")
    with pytest.raises(ValueError, match="precision"):
        SPLAPlan("triton", precision="auto")  # a plan holds what was resolved


def test_streamed_selection_for_16_bit_inputs_on_cuda(with_triton):
    """bf16 / fp16 calls from TILE_MIN_TQ tokens on CUDA select with the streamed selection in their
    dtype; fp32 ones, short calls and the CPU keep the others; asking for a selection without its
    precision gets that selection's default for the inputs."""
    assert all(planned(T, 4096, grad=g).select == "stream" for T in (16, 4096) for g in (False, True))
    assert all(planned(T, 4096, dtype=torch.float32, grad=g).select == "tile" for T in (16, 4096) for g in (0, 1))
    assert planned(1, 4096).select == "kernel" and planned(15, 4096).select == "kernel"
    tile = planned(4096, 4096, select="tile")
    assert (tile.select, tile.select_prec) == ("tile", "tf32x3")
    got = planned(4096, 4096, dtype=torch.float32, select="stream")
    assert (got.select, got.select_prec) == ("stream", "tf32x3")  # fp32 operands unless asked
    got = planned(4096, 4096, dtype=torch.float32, select="stream", select_prec="bf16")
    assert (got.select, got.select_prec) == ("stream", "bf16")
    with pytest.raises(ValueError, match="streamed selection"):
        planned(4096, 4096, select="tile", select_prec="bf16")  # a 16-bit selection is the streamed one's


def test_split_k_for_a_few_tokens_without_gradients(with_triton):
    """About 264 programs: B x H x Tq programs per split, at most one split per selected block."""
    assert planned(2, 100, B=1, H=8).splits == 5  # 5 selected-block slots (local 1 + sink 1 + top-k 3)
    assert planned(2, 4096, B=1, H=8, params=WIDE).splits == 16  # 264 // 16
    assert planned(8, 4096, B=4, H=8, params=WIDE).splits == 1
    assert planned(9, 4096, B=1, H=1, params=WIDE).splits == 1  # beyond 8 tokens: none
    assert planned(2, 4096, B=1, H=8, grad=True, params=WIDE).splits == 1


def test_what_the_kernels_cannot_take(with_triton):
    assert planned(16, 100, D=24).path == "torch"  # head dim
    assert planned(1, 100, D=24).path == "torch_decode"
    assert planned(16, 100, params=SPLAParams(8, 3, 1, 1)).path == "torch"  # block size
    assert planned(16, 100, consecutive=False).path == "torch"  # padding in the middle of a row
    for bad, match in ((dict(D=24), "head_dim"), (dict(consecutive=False), "middle")):
        with pytest.raises(ValueError, match=match):
            planned(16, 100, backend="triton", **bad)
    with pytest.raises(ValueError, match="CUDA"):
        planned(16, 100, "cpu", backend="triton")
    with pytest.raises(ValueError, match="naive"):
        planned(16, 100, backend="naive")
    with pytest.raises(ValueError, match="kernel_backend"):
        planned(16, 100, backend="fast")


def test_without_triton_auto_takes_the_pytorch_forms(without_triton):
    assert planned(16, 100).path == "torch" and planned(1, 100).path == "torch_decode"
    with pytest.raises(ValueError, match="pip install triton"):
        planned(16, 100, backend="triton")


def test_fields_given_replace_the_plans_choices(with_triton):
    assert planned(4096, 4096, form="token").form == "token"
    got = planned(1, 100, path="triton", splits=2, launch=Launch(score_dot=True))
    assert (got.path, got.splits, got.launch.score_dot, got.launch.topk_warps) == ("triton", 2, True, 4)
    with pytest.raises(ValueError, match="form"):
        planned(4096, 4096, form="tiles")
    with pytest.raises(ValueError, match="splits"):
        SPLAPlan("triton", splits=0)
    with pytest.raises(TypeError):
        planned(16, 100, num_splits=2)  # not a field of the plan
    with pytest.raises(AttributeError):  # frozen
        planned(16, 100).form = "token"


@pytest.mark.parametrize("device,T,sums,unit,backend,want", [
    ("cuda", 1, torch.float32, True, "auto", "triton"),
    ("cuda", 1, torch.float32, True, "triton", "triton"),
    ("cuda", 1, torch.float32, True, "torch", "torch"),
    ("cuda", 2, torch.float32, True, "auto", "torch"),  # a static cache's prefill
    ("cuda", 1, torch.float64, True, "auto", "torch"),
    ("cuda", 1, torch.float32, False, "auto", "torch"),
    ("cpu", 1, torch.float32, True, "triton", "torch"),
])
def test_append_path(device, T, sums, unit, backend, want, with_triton):
    assert plan_append((2, 2, T, 64), device, sums, unit_stride=unit, backend=backend) == want
    assert plan_append((2, 2, T, 24), device, sums, unit_stride=unit, backend=backend) == "torch"  # head dim


def test_params_from_the_config():
    cfg = SPLAConfig(block_size=32, top_k_blocks=8, num_sink_blocks=2, num_local_blocks=3, selection="mean",
                     use_rla=False)
    got = SPLAParams.from_config(cfg)
    assert got == SPLAParams(32, 8, 2, 3, "mean", False)
    assert got.budget_tokens == cfg.budget_tokens == 256 and got.num_selected == 13
    assert SPLAParams.from_config(SPLAConfig()) == WIDE  # the config's defaults


def test_spla_attention_refuses_a_plan_made_for_other_gradients():
    from subquadratic.kernels.spla import BlockStats, spla_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 60, n, 16, generator=g) for n in (2, 1, 1))
    pos = torch.arange(60)[None]
    stats = BlockStats.empty(1, 1, 16, "cpu").add(k, pos, 16)
    sbar = torch.zeros(1, 1, 16, 16)
    wrong = plan_spla(q.shape, k.shape, q.dtype, "cpu", P, grad=True)
    with pytest.raises(ValueError, match="grad=True"):
        spla_attention(q, k, v, pos, pos, stats, sbar, P, plan=wrong)
    got = spla_attention(q, k, v, pos, pos, stats, sbar, P, plan=plan_spla(q.shape, k.shape, q.dtype, "cpu", P))
    want = spla_attention(q, k, v, pos, pos, stats, sbar, P)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_fields_given_reach_the_kernels(monkeypatch):
    """The launch settings of a decode plan reach its selection, the splits of a prefill plan its
    sparse kernel (the Triton forms, in the interpreter on CPU)."""
    pytest.importorskip("triton")
    from subquadratic.kernels.spla import triton_decode, triton_parallel

    from .test_triton import make, spla_triton

    seen = []
    real_select, real_sparse = triton_decode.select_indices, triton_parallel.sparse_forward

    def select_indices(*a, **kw):
        seen.append(("launch", kw["launch"]))
        return real_select(*a, **kw)

    def sparse_forward(*a, **kw):
        seen.append(("splits", a[8]))
        return real_sparse(*a, **kw)

    monkeypatch.setattr(triton_decode, "select_indices", select_indices)
    monkeypatch.setattr(triton_parallel, "sparse_forward", sparse_forward)
    q, k, v, pos, stats, sbar = make(1, 4, 2, 70, 16, 16, seed=9)
    launch = Launch(score_dot=True, decode_blocks_per_split=1)
    for out in (spla_triton(q[:, -1:], k, v, pos[:, -1:], pos, stats, sbar, P, launch=launch),
                spla_triton(q[:, -2:], k, v, pos[:, -2:], pos, stats, sbar, P, splits=3)):
        assert all(torch.isfinite(x).all() for x in out)
    assert seen == [("launch", launch), ("splits", 3)]
