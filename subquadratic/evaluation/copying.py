"""Copying from far back: the perplexity of a passage's second occurrence against its first, by the
distance between them.

At context length L, each of `windows` windows of held-out text (`data.windows`: the same windows
perplexity reads) is turned into one sequence per distance d: the passage of `passage` (P) tokens
that starts at position s = L - P - d is written again over the window's last P positions, so the
second occurrence starts d tokens after the first and ends the sequence (the model's context at the
copy is the whole L tokens). One forward pass per sequence gives both occurrences' NLL: the first
occurrence is predicted from the text before it (no earlier copy: what the passage costs without
memory), the second from everything before it, the first occurrence included.

Per distance: `ppl_second` = exp(mean NLL over the second occurrence's tokens but its first, whose
predecessor is not part of the copy), `ppl_first` the same over the first occurrence, and `ratio` =
ppl_second / ppl_first (1 = no use of the first occurrence; a model that copies perfectly tends to
1 / ppl_first). Pooled over the distances: `ppl_second`, `ppl_first`, `ratio`. A model that copies
from d tokens back has a small ppl_second at d; one whose memory does not reach that far has
ppl_second near ppl_first.

Distances: powers of two from `min_distance` (default 64) while s >= 1, and the farthest, d = L - P - 1
(the passage starts right after the first token).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ..data import windows as data_windows
from .errors import EvaluationError
from .ppl import progress_meter, token_nll

#: tokens of the copied passage
PASSAGE = 64
#: the shortest distance measured
MIN_DISTANCE = 64


def copy_distances(L: int, passage: int = PASSAGE, min_distance: int = MIN_DISTANCE) -> list[int]:
    """The distances measured at length L (see the module doc); [] when L cannot hold two passages."""
    far = L - passage - 1
    if far < passage:
        return []
    out, d = [], max(min_distance, passage)
    while d < far:
        out.append(d)
        d *= 2
    return out + [far]


def min_copy_length(passage: int = PASSAGE) -> int:
    """The shortest L with at least one distance: the first token, two passages."""
    return 2 * passage + 1


def copy_sequences(window: torch.Tensor, distances: list[int], passage: int) -> torch.Tensor:
    """[len(distances), L]: `window` [L] with the passage d + P tokens before the end copied over
    the last P positions, one row per distance d."""
    L = window.numel()
    rows = window.repeat(len(distances), 1)
    for i, d in enumerate(distances):
        s = L - passage - d
        rows[i, L - passage:] = window[s:s + passage]
    return rows


def _pooled(nll_sum: float, count: int) -> float:
    return math.exp(nll_sum / count)


@torch.no_grad()
def copying(
    model,
    ids: torch.Tensor,
    lengths: Iterable[int],
    *,
    passage: int = PASSAGE,
    min_distance: int = MIN_DISTANCE,
    max_windows: int | None = 4,
    batch_size: int = 1,
    progress=False,
) -> dict[int, dict]:
    """The copy measure at each length: {L: {"ppl_second", "ppl_first", "ratio", "windows", "passage",
    "by_distance": {d: {"ppl_second", "ppl_first", "ratio"}}}} over the first `max_windows` windows of
    the token stream `ids` [N]. Lengths too short for a passage and a copy are left out; none left is
    an error. `batch_size` sequences per forward; `progress`: see `ppl.progress_meter`."""
    if passage < 2:
        raise EvaluationError(f"the copied passage must be at least 2 tokens, got {passage}")
    lengths = [L for L in sorted(set(lengths)) if copy_distances(L, passage, min_distance)]
    if not lengths:
        raise EvaluationError(f"every length is too short for the copy measure (at least {min_copy_length(passage)} "
                              f"tokens with a {passage}-token passage); use a longer --seq-len")
    was_training = model.training
    model.eval()
    plan = [(L, data_windows(ids, L, max_windows), copy_distances(L, passage, min_distance)) for L in lengths]
    total = sum(w.shape[0] * len(ds) * L for L, w, ds in plan)
    out = {}
    with progress_meter(progress, total, "copy") as meter:
        for L, wins, dists in plan:
            seqs = torch.cat([copy_sequences(w, dists, passage) for w in wins])  # [n * D, L], distance fastest
            parts = []
            for i in range(0, len(seqs), batch_size):
                parts.append(token_nll(model, seqs[i:i + batch_size]).cpu())
                meter.update(parts[-1].shape[0] * L)
            nll = torch.cat(parts).view(len(wins), len(dists), L - 1)  # nll[..., t - 1] predicts token t
            by_distance, sums = {}, [0.0, 0.0]
            for j, d in enumerate(dists):
                s = L - passage - d
                # tokens s + 1 .. s + P - 1 and L - P + 1 .. L - 1: each occurrence but its first token
                first = nll[:, j, s:s + passage - 1].double()
                second = nll[:, j, L - passage:].double()
                row = {"ppl_first": _pooled(first.sum().item(), first.numel()),
                       "ppl_second": _pooled(second.sum().item(), second.numel())}
                row["ratio"] = row["ppl_second"] / row["ppl_first"]
                by_distance[d] = row
                sums[0] += first.sum().item()
                sums[1] += second.sum().item()
            count = len(wins) * len(dists) * (passage - 1)
            pooled = {"ppl_first": _pooled(sums[0], count), "ppl_second": _pooled(sums[1], count)}
            out[L] = {**pooled, "ratio": pooled["ppl_second"] / pooled["ppl_first"], "windows": len(wins),
                      "passage": passage, "by_distance": by_distance}
    model.train(was_training)
    return out
