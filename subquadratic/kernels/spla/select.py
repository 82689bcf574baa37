"""SPLA block selection in PyTorch: second-order Taylor (or mean) block scores from the block
statistics, group softmax sum, forced sink and local blocks, top-k of the rest."""

from __future__ import annotations

import math

import torch

from .plan import SPLAParams
from .stats import BlockStats

NEG = -1e30  # finite "minus infinity": a fully masked row gives a finite softmax, zeroed later


def group_scores(
    q: torch.Tensor,
    stats: BlockStats,
    q_pos: torch.Tensor,
    *,
    block_size: int,
    num_sink_blocks: int,
    num_local_blocks: int,
    selection: str = "taylor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group score of every candidate block, prob [B, H, Tq, NB] (-1 where b is not a candidate),
    and the forced blocks, forced [B, Tq, NB] bool, in the dtype of the statistics (the selection
    math of `select_blocks`)."""
    B, Tq, HQ, D = q.shape
    H = stats.sum_k.shape[1]
    G = HQ // H
    NB = stats.num_blocks
    b = torch.arange(NB, device=q.device)
    cur = torch.where(q_pos >= 0, q_pos // block_size, -1)[:, :, None]  # [B, Tq, 1]
    exists = b <= cur
    forced = exists & ((b < num_sink_blocks) | (b > cur - num_local_blocks))
    cand = exists & ~forced  # complete past blocks (b < cur) that are not forced
    with torch.no_grad():
        cnt = stats.count.clamp(min=1.0)[:, None, :, None]
        mu = stats.sum_k / cnt  # [B, H, NB, D]
        qs = q.detach().to(mu.dtype).transpose(1, 2).reshape(B, H, G, Tq, D) / math.sqrt(D)
        score = torch.einsum("bhgtd,bhnd->bhgtn", qs, mu)
        if selection == "taylor":
            s2 = (stats.sum_k2 / cnt - mu * mu).clamp(min=0.0)
            score = score + torch.log1p(0.5 * torch.einsum("bhgtd,bhnd->bhgtn", qs * qs, s2))
        score = score.masked_fill(~cand[:, None, None], NEG)
        prob = torch.softmax(score, dim=-1).sum(2)  # [B, H, Tq, NB] group score
        prob = prob.masked_fill(~cand[:, None], -1.0)
    return prob, forced


def select_blocks(
    q: torch.Tensor,
    stats: BlockStats,
    q_pos: torch.Tensor,
    params: SPLAParams,
) -> torch.Tensor:
    """Selected blocks of the queries q [B, Tq, HQ, D], shared by each GQA group: bool [B, H, Tq, NB].

    Forced (`params`): the first `num_sink_blocks` and the `num_local_blocks` most recent blocks (the query's own
    partial block included). The rest of the budget goes to the complete past blocks with the highest
    group score sum_{h in group} softmax_b(score_h(b)), score = qs.mu + log(1 + qs^2.s2 / 2) ("taylor")
    or qs.mu ("mean"), qs = q / sqrt(D) (`group_scores`).
    """
    prob, forced = group_scores(q, stats, q_pos, block_size=params.block_size,
                                num_sink_blocks=params.num_sink_blocks, num_local_blocks=params.num_local_blocks,
                                selection=params.selection)
    return top_blocks(prob, forced, params.top_k_blocks)


def top_blocks(prob: torch.Tensor, forced: torch.Tensor, top_k_blocks: int) -> torch.Tensor:
    """The selection bool [B, H, Tq, NB] from the group scores prob [B, H, Tq, NB] (-1 = not a
    candidate) and the forced blocks [B, Tq, NB]: the forced ones and the best candidates of the
    free budget top_k_blocks - forced."""
    B, H, Tq, NB = prob.shape
    cand = prob[:, 0] >= 0  # [B, Tq, NB]: the same candidates for every KV head
    free = top_k_blocks - forced.sum(-1)  # [B, Tq]
    kmax = min(NB, top_k_blocks)  # a bound of every row's free budget, known from shapes (no host sync)
    sel = forced[:, None].expand(B, H, Tq, NB).clone()
    if kmax > 0:
        top = prob.topk(kmax, dim=-1).indices  # [B, H, Tq, kmax]
        rank_ok = (torch.arange(kmax, device=prob.device) < free[:, None, :, None]).expand_as(top)
        picked = torch.zeros_like(sel).scatter(-1, top, rank_ok)
        sel |= picked & cand[:, None]
    return sel
