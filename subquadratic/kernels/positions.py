"""Position bookkeeping shared by the kernels: where each row's logical position 0 sits in the
cache slots."""

from __future__ import annotations

import torch


def slot_offsets(k_pos: torch.Tensor) -> torch.Tensor | None:
    """Slot of logical position 0 per row ([B] int32) when each row of k_pos [B, S] holds its real
    tokens in consecutive slots (positions 0, 1, 2, ...), with padding (-1) only before them (left
    padding, as in generation), after them (right padding, as in training batches), or both; else
    None. One host sync."""
    S = k_pos.shape[1]
    valid = k_pos >= 0
    off = valid.int().argmax(-1)  # first real slot (0 for a row without real tokens)
    expect = torch.arange(S, device=k_pos.device)[None, :] - off[:, None]
    if not bool(torch.where(valid, k_pos == expect, True).all()):
        return None
    return off.to(torch.int32)
