"""How close a block selection is to the exact one (`selection_recall`): the exact selection and its
group scores in fp64 by `select.group_scores` / `select.top_blocks`, against the int32 block indices
a kernel returns. For tests and benchmarks of the fast selections; PyTorch only."""

from __future__ import annotations

import torch

from .plan import SPLAParams
from .select import group_scores, top_blocks
from .stats import BlockStats


def indices_to_mask(idx: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected blocks idx [B, Tq, H, K] (-1 = none) as a mask bool [B, H, Tq, NB], and whether each
    row [B, H, Tq] names every block once and only blocks in [0, NB)."""
    idx = idx.long()
    ok = ((idx >= -1) & (idx < num_blocks)).all(-1)
    slot = torch.where((idx >= 0) & (idx < num_blocks), idx, num_blocks)
    hits = torch.zeros(*idx.shape[:3], num_blocks + 1, device=idx.device, dtype=torch.int32)
    hits.scatter_add_(-1, slot, torch.ones_like(slot, dtype=torch.int32))
    ok &= (hits[..., :num_blocks] <= 1).all(-1)
    return (hits[..., :num_blocks] > 0).permute(0, 2, 1, 3), ok.permute(0, 2, 1)


def selection_recall(
    q: torch.Tensor,
    stats: BlockStats,
    q_pos: torch.Tensor,
    idx: torch.Tensor,
    params: SPLAParams,
) -> dict[str, float | bool | int]:
    """Recall of the selection idx [B, Tq, H, K] of the queries q [B, Tq, HQ, D] at q_pos [B, Tq]
    against the exact selection (fp64 `select.select_blocks` math), over the free budget (the forced
    blocks are checked apart). Any subset of queries may be passed (the selection of a query depends
    on nothing else). Returns:
      blocks: fraction of the exact selection's free blocks that idx also selects;
      mass: the exact group-score mass of idx's free blocks over that of the exact free blocks;
      forced_exact: every row holds every one of its forced blocks;
      valid: every row names each block at most once, only candidates or forced blocks, and no
        more free blocks than its budget;
      rows: the (token, KV head) rows compared."""
    top_k_blocks = params.top_k_blocks
    stats64 = BlockStats(*(x.double() for x in (stats.sum_k, stats.sum_k2, stats.count)))
    prob, forced = group_scores(q.double(), stats64, q_pos, block_size=params.block_size,
                                num_sink_blocks=params.num_sink_blocks, num_local_blocks=params.num_local_blocks,
                                selection=params.selection)  # [B, H, Tq, NB], [B, Tq, NB]
    exact = top_blocks(prob, forced, top_k_blocks)
    got, named_once = indices_to_mask(idx, stats.num_blocks)
    cand = prob >= 0  # [B, H, Tq, NB]
    forced_h = forced[:, None].expand_as(got)
    free_got, free_exact = got & cand, exact & cand
    budget = top_k_blocks - forced.sum(-1)[:, None]  # [B, 1, Tq]
    valid = named_once & ~(got & ~cand & ~forced_h).any(-1) & (free_got.sum(-1) <= budget.clamp(min=0))
    n_exact = free_exact.sum().item()
    mass_exact = torch.where(free_exact, prob, 0.0).sum().item()
    return dict(
        blocks=(free_got & free_exact).sum().item() / n_exact if n_exact else 1.0,
        mass=torch.where(free_got, prob, 0.0).sum().item() / mass_exact if mass_exact > 0 else 1.0,
        forced_exact=bool(((got & forced_h) == forced_h).all()),
        valid=bool(valid.all()),
        rows=int(got.shape[0] * got.shape[1] * got.shape[2]),
    )
