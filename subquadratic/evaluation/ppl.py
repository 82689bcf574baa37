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
from ..modeling.losses import chunked_nll, final_hidden_and_head

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
    """[B, L - 1] fp32: -log p(ids[:, t] | ids[:, :t]) for t = 1 .. L - 1, from one forward pass: the
    final hidden states, the LM head applied chunk by chunk (`losses.chunked_nll`: no [B, L, V]
    logits); models whose logits are not head(hidden) take their logits, CHUNK positions at a time."""
    ids = ids.to(model_device(model))
    B, L = ids.shape
    target = ids[:, 1:]
    try:
        hidden, weight, bias = final_hidden_and_head(model, input_ids=ids, use_cache=False)
    except ValueError:  # logits soft-capped or scaled
        logits = logits_of(model, ids)[:, :-1]  # position t predicts token t + 1
        out = []
        for s in range(0, target.shape[1], CHUNK):
            lg, t = logits[:, s:s + CHUNK].float(), target[:, s:s + CHUNK]
            out.append(F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="none").view_as(t))
        return torch.cat(out, dim=1)
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # position t predicts token t + 1
    return chunked_nll(h, weight, target.reshape(-1), bias=bias).float().view(B, L - 1)


def position_bounds(L: int) -> tuple[int, ...]:
    """The position ranges a window of L tokens is also scored by: [0, L/4), [L/4, L/2), [L/2, L). At
    4x a model's adaptation length they are the positions within it, at 1-2x and at 2-4x it: whether a
    model degrades past the length it learnt at, or only gains less from the longer context."""
    return (0, L // 4, L // 2, L)


def window_means(
    per_token, ids: torch.Tensor, seq_lens: Iterable[int], *, max_windows: int | None, batch_size: int,
    progress, desc: str, forwards: int = 1,
) -> dict[int, dict]:
    """{L: {"mean", "windows", "tokens", "by_position"}}: the mean of `per_token(batch)` (a [B, n] tensor
    per batch of windows, column i scored at position i of the window, from i + 1 tokens) over every
    window of each length (`data.windows`), and over the columns of each `position_bounds` range
    ("by_position": [{"start", "end", "mean", "tokens"}]). `progress` (see `progress_meter`) advances by
    `forwards` x the batch's tokens per batch (`forwards`: models run on each window)."""
    seq_lens = list(seq_lens)
    rows_of = {L: windows(ids, L, max_windows) for L in seq_lens}
    out = {}
    with progress_meter(progress, forwards * sum(r.numel() for r in rows_of.values()), desc) as meter:
        for L, rows in rows_of.items():
            bounds = position_bounds(L)
            spans = [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
            sums = [0.0] * (1 + len(spans))  # the whole window, then each range
            counts = [0] * (1 + len(spans))
            for batch in rows.split(batch_size):
                values = per_token(batch).double()
                cuts = [values] + [values[:, a:b] for a, b in spans]
                for i, got in enumerate(torch.stack([c.sum() for c in cuts]).tolist()):  # one read per batch
                    sums[i] += got
                    counts[i] += cuts[i].numel()
                meter.update(forwards * batch.numel())
            out[L] = {"mean": sums[0] / counts[0], "windows": rows.shape[0], "tokens": counts[0],
                      "by_position": [{"start": a, "end": b, "mean": t / n, "tokens": n}
                                      for (a, b), t, n in zip(spans, sums[1:], counts[1:], strict=True) if n]}
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

    Returns {L: {"ppl", "nll", "windows", "tokens", "by_position"}} (see the module doc; "by_position":
    the same over the `position_bounds` ranges of the window, [{"start", "end", "ppl", "nll", "tokens"}],
    position t scoring token t + 1); `max_windows` caps the
    number of windows per length (the first ones of the stream); `progress`: see `progress_meter`."""
    was_training = model.training
    model.eval()
    means = window_means(lambda b: token_nll(model, b), ids, seq_lens, max_windows=max_windows,
                         batch_size=batch_size, progress=progress, desc="ppl")
    model.train(was_training)
    return {L: {"ppl": math.exp(m["mean"]), "nll": m["mean"], "windows": m["windows"], "tokens": m["tokens"],
                "by_position": [{"start": p["start"], "end": p["end"], "ppl": math.exp(p["mean"]), "nll": p["mean"],
                                 "tokens": p["tokens"]} for p in m["by_position"]]}
            for L, m in means.items()}
