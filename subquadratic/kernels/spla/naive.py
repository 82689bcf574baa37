"""Brute-force definition of SPLA, one query at a time with explicit masks (tests only; use fp64).

It recomputes block statistics from the raw keys for every query and sums the residual linear term
directly over the unselected causal keys, so it shares no code path with `parallel.py` beyond
the feature map.
"""

from __future__ import annotations

import math

import torch

from .plan import SPLAParams
from .stats import feature_map


def spla_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: SPLAParams,
    return_weights: bool = False,
) -> tuple[torch.Tensor, ...]:
    """q: [T, HQ, D], k, v: [T, H, D] of one unpadded sequence. Returns (o_sp, o_rla), both [T, HQ, D]
    (o_rla whatever `params.use_rla` says), and with `return_weights` the sparse branch's softmax
    weights [HQ, T, T] (zeros outside each query's selected causal keys)."""
    block_size, top_k_blocks = params.block_size, params.top_k_blocks
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [heads, T, D] below
    HQ, T, D = q.shape
    H = k.shape[0]
    G = HQ // H
    o_sp = torch.zeros_like(q)
    o_rla = torch.zeros_like(q)
    weights = q.new_zeros(HQ, T, T)
    for t in range(T):
        cur = t // block_size
        forced = {b for b in range(cur + 1) if b < params.num_sink_blocks or b > cur - params.num_local_blocks}
        cands = [b for b in range(cur) if b not in forced]
        free = top_k_blocks - len(forced)
        for h in range(H):
            qs = q[h * G:(h + 1) * G, t] / math.sqrt(D)  # [G, D]
            group = torch.zeros(len(cands), dtype=q.dtype)
            if cands:
                scores = []
                for b in cands:
                    kb = k[h, b * block_size:(b + 1) * block_size]
                    mu = kb.mean(0)
                    s = qs @ mu
                    if params.selection == "taylor":
                        s2 = ((kb * kb).mean(0) - mu * mu).clamp(min=0)
                        s = s + torch.log1p(0.5 * (qs * qs) @ s2)
                    scores.append(s)
                group = torch.softmax(torch.stack(scores, -1), dim=-1).sum(0)
            order = torch.argsort(group, descending=True).tolist()
            chosen = forced | {cands[i] for i in order[:max(free, 0)]}
            sel = torch.tensor([(j // block_size) in chosen for j in range(t + 1)])
            for g in range(G):
                hq = h * G + g
                logits = (k[h, : t + 1] @ q[hq, t]) / math.sqrt(D)
                logits = logits.masked_fill(~sel, float("-inf"))
                p = torch.softmax(logits, -1)
                weights[hq, t, : t + 1] = p
                o_sp[hq, t] = p @ v[h, : t + 1]
                w = feature_map(k[h, : t + 1]).to(q.dtype) @ feature_map(q[hq, t]).to(q.dtype)
                o_rla[hq, t] = (w * (~sel)) @ v[h, : t + 1]
    if return_weights:
        return o_sp.transpose(0, 1), o_rla.transpose(0, 1), weights
    return o_sp.transpose(0, 1), o_rla.transpose(0, 1)
