"""Pure-PyTorch reference of SPLA attention (DESIGN.md "SPLA"); runs anywhere, is the oracle of the
Triton kernels and the path the model takes off CUDA.

Layout: queries q [B, HQ, Tq, D] are the new tokens, keys/values k, v [B, H, S, D] are every cached
token plus the new ones (post-RoPE keys). Logical positions say where a token sits in its own
sequence: q_pos [B, Tq], k_pos [B, S], -1 at padding. Blocks are cut on logical positions, so a
left-padded row of a batch sees exactly the blocks it would see alone.

Block statistics are running sums (`BlockStats`), updated with new keys only; the residual linear
state Sbar [B, H, D, D] (fp32) is carried the same way. This reference reads every cached key for the
masked sparse branch and the correction term; the Triton decode kernel reads only selected blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NEG = -1e30  # finite "minus infinity": a fully masked row gives a finite softmax, zeroed later


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp64 for fp64 inputs (tests), fp32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = softmax over the head dimension, in fp32 or fp64 (the parameter-free exponential map)."""
    return torch.softmax(x.to(acc_dtype(x)), dim=-1)


@dataclass
class BlockStats:
    """Running per-block sums of post-RoPE keys: sum_k, sum_k2 [B, H, NB, D] fp32, count [B, NB] fp32."""

    sum_k: torch.Tensor
    sum_k2: torch.Tensor
    count: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, dim: int, device, dtype=torch.float32, num_blocks: int = 0) -> BlockStats:
        z = torch.zeros(batch, heads, num_blocks, dim, device=device, dtype=dtype)
        return cls(z, z.clone(), torch.zeros(batch, num_blocks, device=device, dtype=dtype))

    @property
    def num_blocks(self) -> int:
        return self.count.shape[1]

    def add(self, k: torch.Tensor, pos: torch.Tensor, block_size: int, num_blocks: int | None = None) -> BlockStats:
        """Return the stats with keys k [B, H, T, D] at logical positions pos [B, T] added (pads skipped);
        self is left unchanged. The result has max(self.num_blocks, num_blocks) blocks; `num_blocks`
        must be an upper bound of the blocks of pos (ceil(slots / block_size) is one). Without it the
        blocks needed are read from pos (a host synchronisation)."""
        B, H, T, D = k.shape
        if num_blocks is None:
            valid = pos >= 0
            num_blocks = int(pos.max().item()) // block_size + 1 if bool(valid.any()) else 0
        grow = max(0, num_blocks - self.num_blocks)
        out = BlockStats(
            torch.cat([self.sum_k, self.sum_k.new_zeros(B, H, grow, D)], dim=2),
            torch.cat([self.sum_k2, self.sum_k2.new_zeros(B, H, grow, D)], dim=2),
            torch.cat([self.count, self.count.new_zeros(B, grow)], dim=1),
        )
        return out.add_(k, pos, block_size)

    def add_(self, k: torch.Tensor, pos: torch.Tensor, block_size: int) -> BlockStats:
        """Add keys k [B, H, T, D] at logical positions pos [B, T] in place (pads skipped), with no host
        synchronisation; every block of pos must be < self.num_blocks. The sums never join an autograd
        graph (k is detached: selection does not propagate gradients). Returns self."""
        B, H, T, D = k.shape
        if T == 0 or self.num_blocks == 0:
            return self
        valid = pos >= 0
        blk = torch.where(valid, pos // block_size, 0)  # [B, T]
        w = valid.to(self.sum_k.dtype)
        kf = k.detach().to(self.sum_k.dtype) * w[:, None, :, None]
        idx = blk[:, None, :, None].expand(B, H, T, D)
        self.sum_k.scatter_add_(2, idx, kf)
        self.sum_k2.scatter_add_(2, idx, kf * kf)
        self.count.scatter_add_(1, blk, w)
        return self


def select_blocks(
    q: torch.Tensor,
    stats: BlockStats,
    q_pos: torch.Tensor,
    *,
    block_size: int,
    top_k_blocks: int,
    num_sink_blocks: int,
    num_local_blocks: int,
    selection: str = "taylor",
) -> torch.Tensor:
    """Selected blocks per query, shared by each GQA group: bool [B, H, Tq, NB].

    Forced: the first `num_sink_blocks` and the `num_local_blocks` most recent blocks (the query's own
    partial block included). The rest of the budget goes to the complete past blocks with the highest
    group score sum_{h in group} softmax_b(score_h(b)), score = qs.mu + log(1 + qs^2.s2 / 2) ("taylor")
    or qs.mu ("mean"), qs = q / sqrt(D).
    """
    B, HQ, Tq, D = q.shape
    H = stats.sum_k.shape[1]
    G = HQ // H
    NB = stats.num_blocks
    dev = q.device
    b = torch.arange(NB, device=dev)
    cur = torch.where(q_pos >= 0, q_pos // block_size, -1)[:, :, None]  # [B, Tq, 1]
    exists = b <= cur
    forced = exists & ((b < num_sink_blocks) | (b > cur - num_local_blocks))
    cand = exists & ~forced  # complete past blocks (b < cur) that are not forced
    free = top_k_blocks - forced.sum(-1)  # [B, Tq]
    with torch.no_grad():
        cnt = stats.count.clamp(min=1.0)[:, None, :, None]
        mu = stats.sum_k / cnt  # [B, H, NB, D]
        qs = q.detach().to(mu.dtype).view(B, H, G, Tq, D) / math.sqrt(D)
        score = torch.einsum("bhgtd,bhnd->bhgtn", qs, mu)
        if selection == "taylor":
            s2 = (stats.sum_k2 / cnt - mu * mu).clamp(min=0.0)
            score = score + torch.log1p(0.5 * torch.einsum("bhgtd,bhnd->bhgtn", qs * qs, s2))
        score = score.masked_fill(~cand[:, None, None], NEG)
        prob = torch.softmax(score, dim=-1).sum(2)  # [B, H, Tq, NB] group score
        prob = prob.masked_fill(~cand[:, None], -1.0)
        kmax = max(0, min(NB, int(free.max().item()) if free.numel() else 0))
        sel = forced[:, None].expand(B, H, Tq, NB).clone()
        if kmax > 0:
            top = prob.topk(kmax, dim=-1).indices  # [B, H, Tq, kmax]
            rank_ok = (torch.arange(kmax, device=dev) < free[:, None, :, None]).expand_as(top)
            picked = torch.zeros_like(sel).scatter(-1, top, rank_ok)
            sel |= picked & cand[:, None]
    return sel


def spla_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    stats: BlockStats,
    sbar: torch.Tensor,
    *,
    block_size: int,
    top_k_blocks: int,
    num_sink_blocks: int,
    num_local_blocks: int,
    selection: str = "taylor",
    use_rla: bool = True,
    query_chunk: int | None = None,
    k_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """SPLA for the new tokens. Returns (o_sp [B, HQ, Tq, D], o_rla [B, HQ, Tq, D] or None, new Sbar).

    q: [B, HQ, Tq, D] post-RoPE queries of the new tokens, which are the last Tq entries of
    k, v: [B, H, S, D]. `stats` must already include the new keys; `sbar` [B, H, D, D] covers the
    S - Tq cached tokens only. Padded queries (q_pos < 0) return zeros. `k_offsets` is used by the
    Triton path only (accepted here so both share one signature).
    """
    B, HQ, Tq, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = HQ // H
    P = S - Tq
    scale = 1.0 / math.sqrt(D)
    sel_blocks = select_blocks(
        q, stats, q_pos, block_size=block_size, top_k_blocks=top_k_blocks,
        num_sink_blocks=num_sink_blocks, num_local_blocks=num_local_blocks, selection=selection,
    )  # [B, H, Tq, NB]
    k_valid = k_pos >= 0
    k_blk = torch.where(k_valid, k_pos // block_size, 0)  # [B, S]
    if query_chunk is None:
        query_chunk = min(1024, max(128, (1 << 23) // max(1, B * HQ * S)))  # ~32 MB score tiles
    acc = acc_dtype(q)
    kf = k.to(acc)
    vf = v.to(acc)
    sbar = sbar.to(acc)
    phik = feature_map(k) * k_valid[:, None, :, None]  # [B, H, S, D]; pads contribute nothing
    o_sp = q.new_zeros(B, HQ, Tq, D, dtype=acc)
    o_rla = torch.zeros_like(o_sp) if use_rla else None
    for c0 in range(0, Tq, query_chunk):
        c1 = min(Tq, c0 + query_chunk)
        C, Sc = c1 - c0, P + c1  # keys after the chunk's last slot are never causal for it
        qp = q_pos[:, c0:c1]  # [B, C]
        kp = k_pos[:, :Sc]
        causal = (kp >= 0)[:, None, :] & (kp[:, None, :] <= qp[:, :, None])  # [B, C, Sc]
        blk_sel = sel_blocks[:, :, c0:c1].gather(
            -1, k_blk[:, None, None, :Sc].expand(B, H, C, Sc)
        )  # [B, H, C, Sc]
        mask = blk_sel & causal[:, None]  # selected causal keys
        qc = q[:, :, c0:c1].to(acc).view(B, H, G, C, D)
        logits = torch.einsum("bhgcd,bhsd->bhgcs", qc, kf[:, :, :Sc]) * scale
        logits = logits.masked_fill(~mask[:, :, None], NEG)
        attn = torch.softmax(logits, dim=-1)
        o_sp[:, :, c0:c1] = torch.einsum("bhgcs,bhsd->bhgcd", attn, vf[:, :, :Sc]).reshape(B, HQ, C, D)
        if use_rla:
            phiq = feature_map(qc)  # [B, H, G, C, D]
            # global causal linear term phi(q)^T Sbar_t: cached part through Sbar, new part exactly
            new = slice(P + c0, P + c1)
            intra_mask = causal[:, :, P + c0:]  # [B, C, C]
            a_intra = torch.einsum("bhgcd,bhsd->bhgcs", phiq, phik[:, :, new]) * intra_mask[:, None, None]
            full = torch.einsum("bhgcd,bhde->bhgce", phiq, sbar) + torch.einsum(
                "bhgcs,bhsd->bhgcd", a_intra, vf[:, :, new]
            )
            # correction otilde over the selected tokens (the tiles the sparse branch loads)
            a_sel = torch.einsum("bhgcd,bhsd->bhgcs", phiq, phik[:, :, :Sc]) * mask[:, :, None]
            rla = full - torch.einsum("bhgcs,bhsd->bhgcd", a_sel, vf[:, :, :Sc])
            all_selected = mask.sum(-1) == causal.sum(-1)[:, None]  # [B, H, C]
            rla = rla.masked_fill(all_selected[:, :, None, :, None], 0.0)
            o_rla[:, :, c0:c1] = rla.reshape(B, HQ, C, D)
            sbar = sbar + torch.einsum("bhsd,bhse->bhde", phik[:, :, new], vf[:, :, new])
    q_ok = (q_pos >= 0)[:, None, :, None]
    o_sp = (o_sp * q_ok).to(q.dtype)
    if use_rla:
        o_rla = (o_rla * q_ok).to(q.dtype)
    elif Tq:
        sbar = sbar + torch.einsum("bhsd,bhse->bhde", phik[:, :, P:], vf[:, :, P:])
    return o_sp, o_rla, sbar
