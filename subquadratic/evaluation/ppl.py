"""Perplexity on held-out text at several context lengths, for any causal LM (dense or ours).

At length L the token stream is cut into non-overlapping windows of L tokens (`data.windows`); each
window is one forward pass from an empty state, and every token but the first is predicted from the
tokens before it in its window. NLL = the mean of -log p(x_t | x_<t) over the n (L - 1) predicted
tokens; perplexity = exp(NLL).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..data import windows

#: Positions whose log-softmax is taken at once (bounds the fp32 copy of large-vocabulary logits).
CHUNK = 1024


def model_device(model) -> torch.device:
    return next(model.parameters()).device


@contextmanager
def progress_meter(progress, total: int, desc: str) -> Iterator:
    """What a task advances as it works, in tokens forwarded: `progress` False (nothing shown), True (a
    bar of this call's own, of `total` tokens), or a bar shared by a whole run (anything with
    `update(n)`, such as a tqdm the caller made and closes)."""
    if progress is True or progress is False:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=not progress, leave=False)
        try:
            yield bar
        finally:
            bar.close()
    else:
        yield progress


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, L, V] logits of a forward over `ids` [B, L] without a cache, on the model's device."""
    return model(input_ids=ids.to(model_device(model)), use_cache=False).logits


@torch.no_grad()
def token_nll(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, L - 1] fp32: -log p(ids[:, t] | ids[:, :t]) for t = 1 .. L - 1, from one forward pass."""
    logits = logits_of(model, ids)[:, :-1]  # position t predicts token t + 1
    target = ids[:, 1:].to(logits.device)
    out = []
    for s in range(0, target.shape[1], CHUNK):
        lg = logits[:, s:s + CHUNK].float()
        t = target[:, s:s + CHUNK]
        out.append(F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="none").view_as(t))
    return torch.cat(out, dim=1)


def window_means(
    per_token, ids: torch.Tensor, seq_lens: Iterable[int], *, max_windows: int | None, batch_size: int,
    progress, desc: str, forwards: int = 1,
) -> dict[int, dict]:
    """{L: {"mean", "windows", "tokens"}}: the mean of `per_token(batch)` (a [B, *] tensor per batch of
    windows) over every window of each length (`data.windows`). `progress` (see `progress_meter`)
    advances by `forwards` x the batch's tokens per batch (`forwards`: models run on each window)."""
    seq_lens = list(seq_lens)
    rows_of = {L: windows(ids, L, max_windows) for L in seq_lens}
    out = {}
    with progress_meter(progress, forwards * sum(r.numel() for r in rows_of.values()), desc) as meter:
        for L, rows in rows_of.items():
            total, count = 0.0, 0
            for batch in rows.split(batch_size):
                values = per_token(batch)
                total += values.double().sum().item()
                count += values.numel()
                meter.update(forwards * batch.numel())
            out[L] = {"mean": total / count, "windows": rows.shape[0], "tokens": count}
    return out


def perplexity(
    model,
    ids: torch.Tensor,
    seq_lens: Iterable[int],
    *,
    max_windows: int | None = None,
    batch_size: int = 1,
    progress=False,
) -> dict[int, dict]:
    """Perplexity of `model` on the token stream `ids` [N] at each length in `seq_lens`.

    Returns {L: {"ppl", "nll", "windows", "tokens"}} (see the module doc); `max_windows` caps the
    number of windows per length (the first ones of the stream); `progress`: see `progress_meter`."""
    was_training = model.training
    model.eval()
    means = window_means(lambda b: token_nll(model, b), ids, seq_lens, max_windows=max_windows,
                         batch_size=batch_size, progress=progress, desc="ppl")
    model.train(was_training)
    return {L: {"ppl": math.exp(m["mean"]), "nll": m["mean"], "windows": m["windows"], "tokens": m["tokens"]}
            for L, m in means.items()}
