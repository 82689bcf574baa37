"""Next-token KL divergence of a model to a reference (dense) model with the same tokenizer.

At length L, over the same non-overlapping windows as perplexity (`data.windows`), at every position
t of every window: KL_t = sum_v p_ref(v | x_<=t) (log p_ref(v | x_<=t) - log p_model(v | x_<=t)),
both distributions the softmax of the fp32 logits. Reported: the mean of KL_t over the n L
positions (nats).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from ..modeling.losses import chunked_kl, decoder_and_head
from .errors import EvaluationError
from .ppl import CHUNK, logits_of, model_device, window_means


@torch.no_grad()
def token_kl(model, reference, ids: torch.Tensor) -> torch.Tensor:
    """[B, L] fp32: KL(reference || model) of the next-token distributions at every position of `ids`:
    both models' final hidden states, their LM heads applied chunk by chunk (`losses.chunked_kl`: no
    [B, L, V] logits); models whose logits are not head(hidden) take their logits."""
    try:
        heads = [decoder_and_head(m) for m in (model, reference)]
    except ValueError:  # logits soft-capped or scaled
        heads = None
    if heads is not None:
        (decoder, head), (ref_decoder, ref_head) = heads
        if ref_head.weight.shape[0] != head.weight.shape[0]:
            raise EvaluationError(f"the reference has {ref_head.weight.shape[0]} output tokens and the model "
                                  f"{head.weight.shape[0]}; the reference must share the model's tokenizer "
                                  "(give the dense source)")
        dev = model_device(model)
        hidden = decoder(input_ids=ids.to(dev), use_cache=False).last_hidden_state
        ref = ref_decoder(input_ids=ids.to(model_device(reference)), use_cache=False).last_hidden_state
        bias = getattr(ref_head, "bias", None)
        B, L = ids.shape
        kl = chunked_kl(hidden.reshape(B * L, -1), head.weight, ref.reshape(B * L, -1).to(dev), ref_head.weight.to(dev),
                        torch.zeros(B * L, dtype=torch.long, device=dev), bias=getattr(head, "bias", None),
                        teacher_bias=None if bias is None else bias.to(dev))
        return kl.float().view(B, L)
    logits = logits_of(model, ids)
    ref = logits_of(reference, ids)
    if ref.shape[-1] != logits.shape[-1]:
        raise EvaluationError(f"the reference has {ref.shape[-1]} output tokens and the model {logits.shape[-1]}; "
                              "the reference must share the model's tokenizer (give the dense source)")
    out = []
    for s in range(0, logits.shape[1], CHUNK):
        lp = F.log_softmax(logits[:, s:s + CHUNK].float(), dim=-1)
        lr = F.log_softmax(ref[:, s:s + CHUNK].to(lp.device).float(), dim=-1)
        out.append(F.kl_div(lp, lr, log_target=True, reduction="none").sum(-1))
    return torch.cat(out, dim=1)


def next_token_kl(
    model,
    reference,
    ids: torch.Tensor,
    seq_lens: Iterable[int],
    *,
    max_windows: int | None = None,
    batch_size: int = 1,
    progress=False,
) -> dict[int, dict]:
    """Mean next-token KL(reference || model) on the token stream `ids` [N] at each length in `seq_lens`.

    Returns {L: {"kl", "windows", "tokens", "by_position"}} (see the module doc; "by_position": the
    same over the `ppl.position_bounds` ranges of the window, [{"start", "end", "kl", "tokens"}]);
    `progress`: see `ppl.progress_meter` (both models' tokens count)."""
    modes = model.training, reference.training
    model.eval()
    reference.eval()
    means = window_means(lambda b: token_kl(model, reference, b), ids, seq_lens, max_windows=max_windows,
                         batch_size=batch_size, progress=progress, desc="kl", forwards=2)
    model.train(modes[0])
    reference.train(modes[1])
    return {L: {"kl": m["mean"], "windows": m["windows"], "tokens": m["tokens"],
                "by_position": [{"start": p["start"], "end": p["end"], "kl": p["mean"], "tokens": p["tokens"]}
                                for p in m["by_position"]]} for L, m in means.items()}
