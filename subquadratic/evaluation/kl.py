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

from .errors import EvaluationError
from .ppl import CHUNK, logits_of, window_means


@torch.no_grad()
def token_kl(model, reference, ids: torch.Tensor) -> torch.Tensor:
    """[B, L] fp32: KL(reference || model) of the next-token distributions at every position of `ids`."""
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

    Returns {L: {"kl", "windows", "tokens"}} (see the module doc); `progress`: see `ppl.progress_meter`
    (both models' tokens count)."""
    modes = model.training, reference.training
    model.eval()
    reference.eval()
    means = window_means(lambda b: token_kl(model, reference, b), ids, seq_lens, max_windows=max_windows,
                         batch_size=batch_size, progress=progress, desc="kl", forwards=2)
    model.train(modes[0])
    reference.train(modes[1])
    return {L: {"kl": m["mean"], "windows": m["windows"], "tokens": m["tokens"]} for L, m in means.items()}
