"""The token-chunked next-token losses (`modeling/losses.py`) against the plain ones on full logits:
per-token values and the gradients of the hidden states, head weight and bias equal in fp64 (chunks
of odd sizes, ignored tokens, random output weights); the means equal Transformers' causal-LM loss
and adapt's plain KL; no chunk holds more tokens than asked; autocast within bf16 rounding; the
final hidden states and head of a causal LM give its logits; liger-kernel's fused losses (run here in
the Triton interpreter where the package is installed) equal ours."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from subquadratic.adaptation.train import kl_to_teacher
from subquadratic.modeling import losses
from subquadratic.modeling.losses import (
    chunked_kl,
    chunked_nll,
    final_hidden_and_head,
    mean_chunked_kl,
    mean_chunked_nll,
)

IGNORE = -100


def inputs(N=23, H=12, V=37, Ht=9, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    h, w, b, th, tw = r(N, H), r(V, H) * 0.5, r(V), r(N, Ht), r(V, Ht) * 0.5
    t = torch.randint(0, V, (N,), generator=g)
    t[[0, 5, 6, N - 1]] = IGNORE
    return h, w, b, th, tw, t, r(N)  # the last: weights of the per-token losses (the output gradient)


def grads(fn, *tensors):
    """Values of fn(*tensors) and the gradients of sum(values * out_weights) w.r.t. each tensor."""
    *ts, out_w = tensors
    ts = [t.detach().clone().requires_grad_() for t in ts]
    values = fn(*ts)
    (values * out_w).sum().backward()
    return values.detach(), [t.grad for t in ts]


@pytest.mark.parametrize("chunk", [1, 4, 7, 100])
@pytest.mark.parametrize("with_bias", [True, False])
def test_chunked_nll_equals_cross_entropy_on_full_logits(chunk, with_bias):
    h, w, b, _, _, t, out_w = inputs()
    bias = b if with_bias else None

    def plain(h, w, *b):
        return F.cross_entropy(F.linear(h, w, *b), t, ignore_index=IGNORE, reduction="none")

    def chunked(h, w, *b):
        return chunked_nll(h, w, t, bias=b[0] if b else None, ignore_index=IGNORE, chunk=chunk)

    args = (h, w, bias) if with_bias else (h, w)
    want, want_g = grads(plain, *args, out_w)
    got, got_g = grads(chunked, *args, out_w)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[t == IGNORE], torch.zeros_like(got[t == IGNORE]))
    for a, e in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 5, 100])
def test_chunked_kl_equals_kl_div_on_full_logits(chunk):
    h, w, b, th, tw, t, out_w = inputs(seed=1)
    keep = (t != IGNORE).double()

    def plain(h, w, b):
        s = F.log_softmax(F.linear(h, w, b), -1)
        return F.kl_div(s, F.log_softmax(th @ tw.T, -1), log_target=True, reduction="none").sum(-1) * keep

    want, want_g = grads(plain, h, w, b, out_w)
    got, got_g = grads(lambda h, w, b: chunked_kl(h, w, th, tw, t, bias=b, chunk=chunk), h, w, b, out_w)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, e in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    th_req, tw_req = th.clone().requires_grad_(), tw.clone().requires_grad_()
    chunked_kl(h.clone().requires_grad_(), w, th_req, tw_req, t, chunk=chunk).sum().backward()
    assert th_req.grad is None and tw_req.grad is None  # the teacher is a target


def plain_kl(student_logits, teacher_logits, labels):
    """Mean KL(teacher || student) over predicted tokens on full logits, in their dtype."""
    keep = labels[:, 1:] != IGNORE
    s = student_logits[:, :-1][keep].log_softmax(-1)
    return F.kl_div(s, teacher_logits[:, :-1][keep].log_softmax(-1), log_target=True, reduction="batchmean")


def test_means_equal_the_causal_lm_loss_and_adapts_plain_kl():
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(2)
    B, T, H, V = 3, 11, 8, 29
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    t_hidden, t_weight = torch.randn(B, T, 6, generator=g, dtype=torch.float64), torch.randn(V, 6, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :4] = IGNORE
    labels[2, 7] = IGNORE  # a document start inside a packed row
    for name, ours, plain in (
        ("lm", lambda: mean_chunked_nll(hidden, weight, labels, impl="torch"),
         lambda: F.cross_entropy((hidden @ weight.T)[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))),
        ("kl", lambda: mean_chunked_kl(hidden, weight, t_hidden, t_weight, labels, impl="torch"),
         lambda: plain_kl(hidden @ weight.T, t_hidden @ t_weight.T, labels)),
    ):
        want = plain()
        want_g = torch.autograd.grad(want, (hidden, weight))
        got = ours()
        got_g = torch.autograd.grad(got, (hidden, weight))
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-12, atol=1e-12, msg=name)
        for a, e in zip(got_g, want_g, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)
    # the shift and the reduction are Transformers' (its loss computes in fp32)
    want = ForCausalLMLoss(hidden @ weight.T, labels, V)
    torch.testing.assert_close(mean_chunked_nll(hidden, weight, labels), want.double(), rtol=1e-6, atol=0)
    want = kl_to_teacher(hidden @ weight.T, t_hidden @ t_weight.T, labels)  # adapt's plain KL (in fp32)
    got = mean_chunked_kl(hidden, weight, t_hidden, t_weight, labels)
    torch.testing.assert_close(got, want.double(), rtol=1e-5, atol=0)


def test_no_chunk_holds_more_tokens_than_asked(monkeypatch):
    shapes = []
    real = losses._logits

    def spy(h, w, b):
        out = real(h, w, b)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(losses, "_logits", spy)
    h, w, b, th, tw, t, _ = inputs(N=50, V=40)
    h.requires_grad_()
    chunked_kl(h, w, th, tw, t, chunk=8).sum().backward()
    assert shapes and max(s[0] for s in shapes) == 8 and all(s[1] == 40 for s in shapes)
    # the default chunk follows the byte budget: fp32 logits of at most CHUNK_BYTES
    assert losses.chunk_tokens(49152) * 49152 * 4 <= losses.CHUNK_BYTES < (losses.chunk_tokens(49152) + 1) * 49152 * 4


def test_autocast_stays_within_bf16_rounding_of_the_plain_path():
    h, w, b, th, tw, t, out_w = (x.float() if x.is_floating_point() else x for x in inputs(N=40, H=32, V=64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_g = grads(lambda h, w: F.cross_entropy(F.linear(h, w).float(), t, reduction="none"), h, w, out_w)
        got, got_g = grads(lambda h, w: chunked_nll(h, w, t, chunk=16), h, w, out_w)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # the same bf16 products, the same fp32 math
    for a, e in zip(got_g, want_g, strict=True):
        assert ((a - e).norm() / e.norm()) < 1e-2


def test_final_hidden_and_head_give_the_models_logits():
    from tests.conftest import make_dense
    from tests.models.spla.tiny import tiny_spla

    ids = torch.randint(3, 128, (2, 20))
    for model in (make_dense("llama-bias-tied"), make_dense("qwen3"), tiny_spla()):
        with torch.no_grad():
            hidden, weight, bias = final_hidden_and_head(model, input_ids=ids, use_cache=False)
            torch.testing.assert_close(F.linear(hidden, weight, bias), model(ids, use_cache=False).logits)
    model = make_dense("llama")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="logits"):
        final_hidden_and_head(model, input_ids=ids)


def test_implementation_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert losses._liger_or_torch("auto", cpu, None) == "torch"
    assert losses._liger_or_torch("auto", cuda, torch.zeros(3)) == "torch"  # a biased head: ours
    with pytest.raises(ValueError, match="implementation"):
        losses._liger_or_torch("fused", cpu, None)
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        assert losses._liger_or_torch("auto", cuda, None) == "torch"
        with pytest.raises(ImportError, match="liger"):
            losses._liger_or_torch("liger", cpu, None)
    else:
        assert losses._liger_or_torch("auto", cuda, None) == "liger"


def test_liger_losses_equal_ours():
    """liger-kernel's fused losses (its Triton kernels in the interpreter on CPU) against ours, fp32."""
    pytest.importorskip("liger_kernel")
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(3)
    B, T, H, V = 2, 9, 16, 33
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    t_hidden, t_weight = torch.randn(B, T, 16, generator=g), torch.randn(V, 16, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[1, :3] = IGNORE
    for fn in (lambda impl: mean_chunked_nll(hidden, weight, labels, impl=impl),
               lambda impl: mean_chunked_kl(hidden, weight, t_hidden, t_weight, labels, impl=impl)):
        want = fn("torch")
        want_g = torch.autograd.grad(want, (hidden, weight))
        got = fn("liger")
        got_g = torch.autograd.grad(got, (hidden, weight))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, e in zip(got_g, want_g, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_evaluation_per_token_losses_equal_the_full_logits_ones():
    """`evaluation.ppl.token_nll` and `evaluation.kl.token_kl` run the chunked losses: the same values
    as on full logits (fp64 models)."""
    from subquadratic.evaluation.kl import token_kl
    from subquadratic.evaluation.ppl import token_nll
    from tests.conftest import make_dense
    from tests.models.spla.tiny import tiny_spla

    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(4))
    model, reference = tiny_spla().double(), make_dense("qwen2").double()
    with torch.no_grad():
        logits, ref = model(ids, use_cache=False).logits, reference(ids, use_cache=False).logits
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(2, 29)
    torch.testing.assert_close(token_nll(model, ids), want.float(), rtol=1e-6, atol=1e-6)
    want = F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(token_kl(model, reference, ids), want.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["torch", "auto"])
def test_gpu_means_hold_no_full_logits_and_equal_the_plain_ones(impl):
    """On CUDA (impl "auto": liger-kernel's kernels where installed) at SmolLM2's vocabulary: the mean
    losses under bf16 autocast, values and gradients, within bf16 rounding of the fp32 full-logit
    ones, and their peak memory under half the batch's fp32 logits (8 x 4096 tokens: 6.4 GB)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, V = 8, 4096, 576, 49152
    hidden = torch.randn(B, T, H, device="cuda", generator=g)
    weight = torch.randn(V, H, device="cuda", generator=g) * H ** -0.5
    t_hidden = torch.randn(B, T, H, device="cuda", generator=g)
    t_weight = torch.randn(V, H, device="cuda", generator=g) * H ** -0.5
    labels = torch.randint(0, V, (B, T), device="cuda", generator=g)
    labels[:, :7] = IGNORE
    for kind in ("lm", "kl"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if kind == "lm":
                loss = mean_chunked_nll(h, w, labels, impl=impl)
            else:
                loss = mean_chunked_kl(h, w, t_hidden, t_weight, labels, impl=impl)
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak < 0.5 * B * T * V * 4, (kind, peak / 2**30)
        h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = F.linear(h2, w2)
        if kind == "lm":
            want = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE)
        else:
            want = kl_to_teacher(logits, F.linear(t_hidden, t_weight), labels)
        want.backward()
        torch.testing.assert_close(loss.float(), want, rtol=2e-2, atol=2e-2)
        for a, b in ((h.grad, h2.grad), (w.grad, w2.grad)):
            assert (a.float() - b).norm() <= 5e-2 * b.norm(), kind
