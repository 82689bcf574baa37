"""Packed batches: several documents in one row, `position_ids` restarting at each document (as
Transformers' `DataCollatorWithFlattening` makes them, or `cu_seq_lens_q` from its flash-attention
form). Every mixer keeps documents apart the same way: the attention or state recurrence runs on one
right-padded row per document and its output is packed back; the residual stream, the norms and the
MLPs stay on the packed tokens, and so do the per-token steps of the mixers that `take_packed`
(softmax, SSE, HLA: projections, gates, output); the others get their whole input per document. A
causal mixer never reads the padding after a row's last token, so each document sees exactly itself,
whatever the mixer (softmax, SPLA, SSE, HLA). The cost is the padding of the longest document per
batch, inside the mixers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class Documents:
    """Where each real token of a packed [B, T] batch sits in the per-document [S, L] layout."""

    shape: tuple[int, int]  # (B, T) of the packed batch
    flat: torch.Tensor  # [M] flat index (b * T + t) of each real token
    doc: torch.Tensor  # [M] its document
    offset: torch.Tensor  # [M] its place in the document
    num_docs: int
    max_len: int

    @property
    def valid(self) -> torch.Tensor:
        """[S, L] True at a document's tokens, False at the padding after them."""
        out = torch.zeros(self.num_docs, self.max_len, dtype=torch.bool, device=self.flat.device)
        out[self.doc, self.offset] = True
        return out

    @cached_property
    def packed_valid(self) -> torch.Tensor:
        """[B, T] True at the packed batch's real tokens (made once; every layer's stage-1 loss reads it)."""
        B, T = self.shape
        return torch.zeros(B * T, dtype=torch.bool, device=self.flat.device).index_fill_(0, self.flat, True).view(B, T)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, *] packed -> [S, L, *] one document per row, zero at padding (differentiable)."""
        rows = x.reshape(-1, *x.shape[2:])[self.flat]
        out = x.new_zeros(self.num_docs, self.max_len, *x.shape[2:])
        return out.index_put((self.doc, self.offset), rows)

    def pack(self, y: torch.Tensor) -> torch.Tensor:
        """[S, L, *] -> [B, T, *], zero where the packed batch has padding (differentiable)."""
        B, T = self.shape
        out = y.new_zeros(B * T, *y.shape[2:])
        return out.index_put((self.flat,), y[self.doc, self.offset]).reshape(B, T, *y.shape[2:])


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[1, total] positions restarting at each boundary of `cu_seqlens` ([S + 1], starting at 0)."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return (torch.arange(total, device=cu.device) - starts)[None]


def find_documents(position_ids: torch.Tensor, valid: torch.Tensor) -> Documents | None:
    """The documents of a batch whose `position_ids` restart inside a row, or None when no row holds
    more than one (an ordinary batch, left or right padded: positions that jump across padding do
    not count). A new document starts at a real token whose position is not its real predecessor's
    plus one. Reads the tensors on the host (one synchronisation)."""
    B, T = valid.shape
    pos = position_ids.to(valid.device).expand(B, T)
    boundary = torch.zeros_like(valid)
    boundary[:, 1:] = valid[:, 1:] & valid[:, :-1] & (pos[:, 1:] != pos[:, :-1] + 1)
    if not bool(boundary.any()):
        return None
    first = valid & (valid.long().cumsum(1) == 1)  # each row's first real token
    starts = (first | boundary).reshape(-1)
    flat = valid.reshape(-1).nonzero().squeeze(1)
    doc = (starts.long().cumsum(0) - 1)[flat]
    num_docs = int(starts.sum())
    lengths = torch.bincount(doc, minlength=num_docs)
    offset = torch.arange(flat.numel(), device=flat.device) - (lengths.cumsum(0) - lengths)[doc]
    return Documents((B, T), flat, doc, offset, num_docs, int(lengths.max()))
