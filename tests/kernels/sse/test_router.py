"""SSE's router kernel (`router_topk(backend="triton")`): probabilities and their gradient against the
PyTorch form (fp64 oracle), the same top-K selection where probabilities differ, the lowest partitions
among equal ones, padding left unselected; refused inputs."""

from __future__ import annotations

import pytest
import torch

from subquadratic.kernels.sse.router import router_topk, router_unsupported

pytest.importorskip("triton")


def dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("N,k", [(4, 1), (4, 2), (5, 3), (16, 4), (8, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_valid", [False, True])
def test_values_selection_and_gradient_match_the_pytorch_form(N, k, dtype, with_valid):
    g = torch.Generator().manual_seed(N * 10 + k)
    B, T = 2, 37
    logits = (torch.randn(B, T, N, generator=g) * 2).to(dtype).to(dev())
    valid = (torch.rand(B, T, generator=g) > 0.2).to(dev()) if with_valid else None
    dp = torch.randn(B, T, N, generator=g).to(dev())
    a = logits.clone().requires_grad_(True)
    probs, sel = router_topk(a, k, valid, backend="triton")
    (probs * dp).sum().backward()
    r = logits.double().clone().requires_grad_(True)
    want_p, want_sel = router_topk(r, k, valid)
    (want_p * dp.double()).sum().backward()
    assert probs.dtype == torch.float32 and sel.dtype == torch.bool and a.grad.dtype == dtype
    torch.testing.assert_close(probs.double(), want_p, atol=1e-6, rtol=1e-6)
    assert torch.equal(sel, want_sel)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(a.grad.double(), r.grad, atol=tol, rtol=tol)
    if valid is not None:
        assert not sel[~valid].any() and (sel[valid].sum(-1) == k).all()


@pytest.mark.parametrize("B,T", [(2, 37), (1, 5), (3, 1)])
def test_logits_read_where_a_packed_projection_wrote_them(B, T):
    """Logits that are columns of one packed projection output (tokens one stride apart) are read in place
    (no copy) with the values of their contiguous copy; a 2-D [rows, N] input too."""
    from ..fused_models import CopyCounter

    g = torch.Generator().manual_seed(B * 100 + T)
    packed = torch.randn(B, T, 37, generator=g).to(dev())
    logits = packed[..., 11:16]
    with torch.no_grad(), CopyCounter() as copies:
        probs, sel, loss = router_topk(logits, 2, None, backend="triton", aux=True)
    assert copies.n == 0
    want = router_topk(logits.contiguous(), 2, None, backend="triton", aux=True)
    assert torch.equal(probs, want[0]) and torch.equal(sel, want[1]) and torch.equal(loss, want[2])
    flat = router_topk(logits.reshape(-1, 5), 2, None, backend="triton")
    assert torch.equal(flat[0], probs.reshape(-1, 5)) and torch.equal(flat[1], sel.reshape(-1, 5))


def test_equal_probabilities_select_the_lowest_partitions():
    logits = torch.zeros(1, 3, 6, device=dev())
    logits[0, 1, 4] = 1.0  # one clear winner, then ties
    _, sel = router_topk(logits, 2, backend="triton")
    assert sel[0, 0].tolist() == [True, True, False, False, False, False]
    assert sel[0, 1].tolist() == [True, False, False, False, True, False]


def test_refused_inputs():
    x = torch.zeros(1, 2, 4)
    assert router_unsupported(x.double()) is not None
    assert router_unsupported(torch.zeros(1, 2, 300)) is not None
    assert router_unsupported(x, torch.ones(1, 2)) is not None  # not bool
    assert router_unsupported(x, torch.ones(1, 2, dtype=torch.bool)) is None
    with pytest.raises(ValueError, match="router kernel does not take"):
        router_topk(x.double(), 1, backend="triton")
    p, s = router_topk(x.double(), 1, backend="auto")  # fp64 stays on the PyTorch form
    assert p.dtype == torch.float64 and s.sum() == 2


def test_a_model_through_the_router_kernel_keeps_its_logits_and_gradients(monkeypatch):
    """An SSE-H model's router through the kernel (as on CUDA; here set through the SSE plan), in training
    (its load-balancing loss in the loss): the logits and every parameter's gradient of the PyTorch ops
    (random logits: no equal probabilities)."""
    from subquadratic.kernels.sse import triton_router

    from ...models.sse.test_modeling_sse import model as sse_model
    from ..fused_models import forced_kernel_matches

    model = sse_model("tiny-h", 0).train()  # with the load-balancing loss in the loss
    assert model.config.aux_loss_weight
    gates = [lambda on: model.set_plan("sse", router="kernel" if on else "torch")]
    assert forced_kernel_matches(model, monkeypatch, gates, triton_router.Router, "apply") > 0
    model.set_plan("sse")


@pytest.mark.parametrize("N,k", [(4, 1), (5, 2), (16, 4)])
@pytest.mark.parametrize("valid_kind", ["none", "some", "none-valid"])
def test_the_load_balancing_loss_and_its_gradient_match_the_pytorch_form(N, k, valid_kind):
    """With aux: the loss of `sse_aux_loss` over the valid tokens (all without a mask; none valid: 0), and
    the logits' gradient through probs and the loss together, against the fp64 PyTorch form; B T past one
    program of rows."""
    g = torch.Generator().manual_seed(N + k)
    B, T = 2, 70
    logits = (torch.randn(B, T, N, generator=g) * 2).to(dev())
    valid = None if valid_kind == "none" else (torch.rand(B, T, generator=g) > (0.3 if valid_kind == "some" else 2))
    valid = valid.to(dev()) if valid is not None else None
    dp = torch.randn(B, T, N, generator=g).to(dev())
    a = logits.clone().requires_grad_(True)
    probs, sel, loss = router_topk(a, k, valid, backend="triton", aux=True)
    ((probs * dp).sum() + 3.0 * loss).backward()
    r = logits.double().clone().requires_grad_(True)
    want_p, want_sel, want_loss = router_topk(r, k, valid, aux=True)
    ((want_p * dp.double()).sum() + 3.0 * want_loss).backward()
    assert loss.shape == () and loss.dtype == torch.float32 and torch.equal(sel, want_sel)
    torch.testing.assert_close(loss.double(), want_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.grad.double(), r.grad, atol=1e-6, rtol=1e-6)
    if valid_kind == "none-valid":
        assert loss.item() == 0.0
    # the loss alone (probs unused): its gradient only
    b = logits.clone().requires_grad_(True)
    router_topk(b, k, valid, backend="triton", aux=True)[2].backward()
    s = logits.double().clone().requires_grad_(True)
    router_topk(s, k, valid, aux=True)[2].backward()
    torch.testing.assert_close(b.grad.double(), s.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("valid_kind", ["none", "some"])
def test_under_gradient_checkpointing(valid_kind):
    """Recomputed under non-reentrant checkpointing (adapt --gradient-checkpointing): the loss and the logits'
    gradient of the plain call (a backward that reads its saved tensors twice fails there)."""
    from torch.utils.checkpoint import checkpoint

    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(2, 70, 8, generator=g) * 2).to(dev())
    valid = (torch.rand(2, 70, generator=g) > 0.3).to(dev()) if valid_kind == "some" else None
    dp = torch.randn(2, 70, 8, generator=g).to(dev())

    def step(x):
        probs, _, loss = router_topk(x, 2, valid, backend="triton", aux=True)
        return (probs * dp).sum() + 3.0 * loss

    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    want = step(a)
    want.backward()
    got = checkpoint(step, b, use_reentrant=False)
    got.backward()
    assert torch.equal(got, want) and torch.equal(b.grad, a.grad)
