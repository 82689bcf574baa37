"""Next-token losses from a causal LM's final hidden states and its LM head weight, chunked over
tokens so that full-vocabulary logits of the whole batch never exist, forward or backward.

`chunked_nll` (cross entropy) and `chunked_kl` (KL(teacher || student) of the next-token
distributions, the teacher's logits from its own final hidden states and head) give one value per
token, differentiable in the student's hidden states, head weight and bias. Both run
`ChunkedHeadLoss`: the forward computes each chunk's logits (`CHUNK_BYTES` of fp32 logits at most),
keeps the per-token log-sum-exp and drops the logits; the backward recomputes them chunk by chunk
(a recompute costs one head matmul per chunk; the teacher's too) and accumulates the input, weight
and bias gradients, under the forward's autocast state. The means over predicted tokens that
`adapt` trains on are `mean_chunked_nll` and `mean_chunked_kl`, which on CUDA take
liger-kernel's fused linear cross entropy and its fused linear JSD at beta 0 (KL(teacher ||
student)) where the package is installed (`pip install 'subquadratic[liger]'`): the same losses
(same reduction, direction, ignore index), computed by its kernels.

Shapes: hidden [N, H] (flattened tokens), weight [V, H], targets [N] int64 (`ignore_index` where no
token is predicted); the mean helpers take [B, T, H] and labels [B, T] and shift by one (position
t predicts labels[:, t + 1]), as Transformers' causal LM loss does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

#: Bytes of fp32 logits one chunk holds at most (its tokens: CHUNK_BYTES // (4 V), at least 1).
CHUNK_BYTES = 1 << 28

#: Loss implementations: "auto" (liger-kernel on CUDA where installed, else "torch"), "torch" (the
#: chunked PyTorch function) or "liger".
IMPLS = ("auto", "torch", "liger")


def chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that a chunk's fp32 logits [tokens, vocab_size] fit in `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * max(1, vocab_size)))


def _acc(x: Tensor) -> torch.dtype:
    """The dtype losses and gradients accumulate in: fp32, or fp64 for fp64 tensors (tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Logits of one chunk as `nn.Linear` computes them (in autocast's dtype under autocast), then
    in the accumulation dtype (fp32; fp64 for fp64 inputs)."""
    out = F.linear(h, weight, bias)
    return out.to(torch.promote_types(out.dtype, torch.float32))


class ChunkedHeadLoss(torch.autograd.Function):
    """Per-token loss [N] (fp32; fp64 for fp64 inputs) from hidden [N, H] through the head (weight
    [V, H], bias [V] or None), chunk by chunk. kind "nll": -log softmax(logits)[target] (0 where
    target == ignore_index); kind "kl": KL(teacher || student) with the teacher's logits from
    t_hidden [N, Ht] and t_weight [V, Ht] (t_bias), 0 where target == ignore_index. Gradients:
    hidden, weight, bias (the teacher and the targets get none)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, t_hidden, t_weight, t_bias, kind, ignore_index, chunk):
        N = hidden.shape[0]
        loss = hidden.new_zeros(N, dtype=_acc(hidden))
        lse = hidden.new_zeros(N, dtype=_acc(hidden))
        valid = targets != ignore_index
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            logits = _logits(hidden[s:e], weight, bias)  # [C, V]
            lse[s:e] = torch.logsumexp(logits, -1)
            if kind == "nll":
                picked = logits.gather(1, targets[s:e].clamp(min=0)[:, None])[:, 0]
                loss[s:e] = (lse[s:e] - picked) * valid[s:e]
            else:
                t_logp = torch.log_softmax(_logits(t_hidden[s:e], t_weight, t_bias), -1)
                s_logp = logits - lse[s:e, None]
                loss[s:e] = (t_logp.exp() * (t_logp - s_logp)).sum(-1) * valid[s:e]
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, t_hidden, t_weight, t_bias, lse)
        ctx.kind, ctx.ignore_index, ctx.chunk = kind, ignore_index, chunk
        dev = hidden.device.type
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, targets, t_hidden, t_weight, t_bias, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dev, enabled, dtype = ctx.autocast
        N = hidden.shape[0]
        dh = torch.zeros_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=_acc(weight), device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=_acc(bias), device=bias.device) if need_b and bias is not None else None
        g_tok = grad_loss.to(lse.dtype) * (targets != ctx.ignore_index)  # [N]
        with torch.autocast(dev, dtype=dtype, enabled=enabled):
            for s in range(0, N, ctx.chunk):
                e = min(N, s + ctx.chunk)
                h = hidden[s:e]
                g = torch.exp(_logits(h, weight, bias) - lse[s:e, None])  # student softmax [C, V]
                if ctx.kind == "nll":
                    g.scatter_add_(1, targets[s:e].clamp(min=0)[:, None], -torch.ones_like(g[:, :1]))
                else:
                    g -= torch.softmax(_logits(t_hidden[s:e], t_weight, t_bias), -1)
                g.mul_(g_tok[s:e, None])  # d loss / d logits [C, V]
                # the products in the operands' dtype, as the plain head's backward (under autocast: its dtype)
                if dh is not None:
                    dh[s:e] = g.to(weight.dtype) @ weight
                if dw is not None:
                    dw += g.t().to(h.dtype) @ h
                if db is not None:
                    db += g.sum(0)
                del g
        return (dh, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype),
                None, None, None, None, None, None, None)


def chunked_nll(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                   ignore_index: int = -100, chunk: int | None = None) -> Tensor:
    """-log p(targets[i] | hidden[i]) [N] fp32 (0 where targets == ignore_index) for hidden [N, H]
    and the head weight [V, H] (bias [V]), chunked over tokens (`ChunkedHeadLoss`; `chunk` tokens per
    chunk, default `chunk_tokens(V)`)."""
    chunk = chunk or chunk_tokens(weight.shape[0])
    return ChunkedHeadLoss.apply(hidden, weight, bias, targets, None, None, None, "nll", ignore_index, chunk)


def chunked_kl(hidden: Tensor, weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
                  targets: Tensor, *, bias: Tensor | None = None, teacher_bias: Tensor | None = None,
                  ignore_index: int = -100, chunk: int | None = None) -> Tensor:
    """KL(teacher || student) [N] fp32 of the distributions softmax(head(hidden[i])) (student,
    hidden [N, H], weight [V, H]) and softmax(teacher head(teacher_hidden[i])) (teacher_hidden
    [N, Ht], teacher_weight [V, Ht]); 0 where targets == ignore_index (targets only mark the tokens
    that count). Chunked over tokens (`ChunkedHeadLoss`); differentiable in the student's tensors."""
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"the teacher's head has {teacher_weight.shape[0]} outputs and the student's "
                         f"{weight.shape[0]}; distillation needs the same vocabulary")
    chunk = chunk or chunk_tokens(weight.shape[0])
    return ChunkedHeadLoss.apply(hidden, weight, bias, targets, teacher_hidden.detach(), teacher_weight.detach(),
                                 None if teacher_bias is None else teacher_bias.detach(), "kl", ignore_index, chunk)


def _liger_or_torch(impl: str, device: torch.device, bias: Tensor | None) -> str:
    """The implementation a mean loss takes: liger-kernel's under "liger", or under "auto" on CUDA
    where it is installed and the head has no bias (its fused losses take none); else "torch"."""
    if impl not in IMPLS:
        raise ValueError(f"loss implementation must be one of {', '.join(IMPLS)}; got {impl!r}")
    if impl == "torch" or (impl == "auto" and (device.type != "cuda" or bias is not None)):
        return "torch"
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        if impl == "liger":
            raise ImportError("the liger losses need liger-kernel: pip install 'subquadratic[liger]'") from None
        return "torch"
    return "liger"


def _shifted(hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """hidden [B, T, H] -> the predicting positions [B (T - 1), H] and their targets labels[:, 1:]."""
    return hidden[:, :-1].reshape(-1, hidden.shape[-1]), labels[:, 1:].reshape(-1)


def mean_chunked_nll(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                         ignore_index: int = -100, impl: str = "auto") -> Tensor:
    """Mean over predicted tokens of the next-token cross entropy: position t of hidden [B, T, H]
    predicts labels[:, t + 1] (ignored where ignore_index), the loss of Transformers' causal LMs
    (`ForCausalLMLoss` without num_items_in_batch) without their full logits."""
    h, t = _shifted(hidden, labels)
    if _liger_or_torch(impl, hidden.device, bias) == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction="mean")(weight, h, t, bias)
    loss = chunked_nll(h, weight, t, bias=bias, ignore_index=ignore_index)
    return loss.sum() / (t != ignore_index).sum()


def mean_chunked_kl(hidden: Tensor, weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
                       labels: Tensor, *, bias: Tensor | None = None, teacher_bias: Tensor | None = None,
                       ignore_index: int = -100, impl: str = "auto") -> Tensor:
    """Mean over predicted tokens (labels[:, t + 1] != ignore_index) of KL(teacher || student) between
    the next-token distributions at position t of hidden [B, T, H] (student) and teacher_hidden
    [B, T, Ht], without the full logits of either."""
    h, t = _shifted(hidden, labels)
    th = teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1])
    if teacher_bias is None and _liger_or_torch(impl, hidden.device, bias) == "liger":
        from liger_kernel.transformers import LigerFusedLinearJSD

        # beta 0: the forward KL(teacher || student), the mean over tokens whose label is not ignored
        return LigerFusedLinearJSD(jsd_beta=0.0, ignore_index=ignore_index)(h, weight, th, teacher_weight, t)
    loss = chunked_kl(h, weight, th, teacher_weight, t, bias=bias, teacher_bias=teacher_bias,
                         ignore_index=ignore_index)
    return loss.sum() / (t != ignore_index).sum()


def decoder_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder, LM head) of a causal LM (ours or Transformers'; a PEFT model's base): the decoder's
    output `last_hidden_state` [B, T, H] gives the logits head(hidden), which the losses here take
    from the head's weight and bias chunk by chunk. Models that transform their logits (soft-capping,
    scaling) raise a ValueError."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(cfg, name, None) not in (None, 1, 1.0):
            raise ValueError(f"{cfg.model_type} models transform their logits ({name}); the chunked losses take "
                             "logits = lm_head(hidden) only")
    return base.get_decoder(), base.get_output_embeddings()


def final_hidden_and_head(model, **inputs) -> tuple[Tensor, Tensor, Tensor | None]:
    """(last hidden state [B, T, H], head weight [V, H], head bias or None) of a causal LM on
    `inputs` (`decoder_and_head`): the decoder runs once, the head not at all."""
    decoder, head = decoder_and_head(model)
    return decoder(**inputs).last_hidden_state, head.weight, getattr(head, "bias", None)
