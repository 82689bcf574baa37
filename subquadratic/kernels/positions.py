"""Position bookkeeping shared by the kernels: where each row's logical position 0 sits in the
cache slots."""

from __future__ import annotations

import torch


def left_pad_offsets(k_pos: torch.Tensor) -> torch.Tensor | None:
    """Slot of logical position 0 per row ([B] int32) when every row of k_pos [B, S] is left padded
    only (padding slots first, then positions 0, 1, 2, ...), else None. One host sync."""
    S = k_pos.shape[1]
    off = (k_pos < 0).sum(-1)
    expect = torch.arange(S, device=k_pos.device)[None, :] - off[:, None]
    expect = torch.where(expect >= 0, expect, torch.full_like(expect, -1))
    if not torch.equal(expect, k_pos):
        return None
    return off.to(torch.int32)
