"""SPLA speed on one GPU against SDPA flash attention measured in the same run (bf16, fresh random
data, triton.testing.do_bench medians). Prints one table (peer, ours, ratio) and writes it as JSON.

  python -m scripts.benchmarks.kernels.bench_spla [--out results.json] [--quick]

Rows: P1 decode step at 128k context (B4 HQ32 H8 d128, 16 blocks of 64) with the bytes each reads;
P2 prefill forward and forward+backward at 32k (B1 HQ32 H8 d128); P3 against fla's parallel_nsa
(needs fla installed; B1 HQ64 H4 d128, G = 16); P6 time(64k)/time(32k) of the SPLA prefill. P2-P6
run the kernels the plan picks (`kernels.spla.plan_spla`: the tile form without gradients, the
per-token form with them); the rows marked "per-token kernels" repeat P2 / P2b with the plan's
form="token" for both, and the prefill stages list the tile and per-token kernels apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math

import torch
import torch.nn.functional as F

from scripts.common.bench import spla_plan


def bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def decode_case(B=4, HQ=32, H=8, D=128, S=131072, bs=64, top=16, sweep=True):
    from subquadratic.kernels.spla import BlockStats, Launch, SPLAParams, spla_attention
    from subquadratic.kernels.utils import slot_offsets

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, 1, HQ, D, device=dev, dtype=dt)
    k = torch.randn(B, H, S, D, device=dev, dtype=dt)  # stored as the model's cache stores them
    v = torch.randn(B, H, S, D, device=dev, dtype=dt)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # the op's [B, S, H, D] layout: views, no copies
    pos = torch.arange(S, device=dev).expand(B, S).contiguous()
    stats = BlockStats.empty(B, H, D, dev).add(kt, pos, bs)
    sbar = torch.randn(B, H, D, D, device=dev) * 0.01
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=1, num_local_blocks=2)
    koff = slot_offsets(pos)  # the model computes this once per forward for all layers
    ours = bench(lambda: spla_attention(q, kt, vt, pos[:, -1:], pos, stats, sbar, params, backend="triton",
                                        k_offsets=koff))
    qd = q.transpose(1, 2)
    peer = bench(lambda: F.scaled_dot_product_attention(qd, k, v, enable_gqa=True))

    def step(launch=None):  # one decode step on the plan's kernels, with other launch settings if given
        plan = spla_plan(q, kt, params, **({} if launch is None else {"launch": launch}))
        return spla_attention(q, kt, vt, pos[:, -1:], pos, stats, sbar, params, k_offsets=koff, plan=plan)

    # the same step replayed as one CUDA graph (how serving stacks run decode): launch gaps removed
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ours_graph = bench(graph.replay)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # GPU time of each kernel of the step
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    print("\ndecode launch settings (whole step as a CUDA graph, median ms)")
    settings = (Launch(topk_bn=128), Launch(topk_warps=2, topk_bn=128), Launch(topk_warps=1, topk_bn=128),
                Launch(topk_bn=512), Launch(topk_bn=1024), Launch(topk_warps=8, topk_bn=1024),
                Launch(topk_warps=2, topk_bn=512), Launch(decode_blocks_per_split=4, topk_bn=512),
                Launch(decode_warps=8, topk_bn=512))
    for launch in settings if sweep else ():
        step(launch)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(launch)
        print("  " + " ".join(f"{f.name}={getattr(launch, f.name)}" for f in dataclasses.fields(launch)) +
              f": {bench(g.replay):8.4f}")
    print("\nGPU kernels of one decode step (mean of 20 steps)")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
        print(f"  {e.key[:60]:60} {e.device_time_total / 20 / 1000:8.4f} ms")
    dense_bytes = 2 * B * H * S * D * 2
    ours_bytes = (2 * B * H * top * bs * D * 2  # selected K and V tiles
                  + 2 * B * H * (S // bs) * D * 4 + B * (S // bs) * 4  # block statistics (fp32)
                  + B * H * D * D * 4)  # Sbar
    return peer, ours, ours_graph, ours_bytes / dense_bytes


def breakdown(Tq, S, B, HQ=32, H=8, D=128, bs=64, top=16) -> dict[str, float]:
    """Median ms of each stage of one SPLA call (queries = the last Tq of S tokens)."""
    import triton

    from subquadratic.kernels.spla import (
        BlockStats,
        SparseAttention,
        SPLAParams,
        causal_linear_term,
        feature_map,
        key_features,
        queries_by_block,
        select_indices,
        select_indices_fast,
        sparse_forward,
        spla_attention,
        tile_shape,
        tile_sparse_attention,
        tile_sparse_forward,
        tile_union,
    )
    from subquadratic.kernels.utils import slot_offsets

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, Tq, HQ, D, device=dev, dtype=dt)
    k = torch.randn(B, H, S, D, device=dev, dtype=dt)  # the cache's layout; the op gets [B, S, H, D] views
    v = torch.randn(B, H, S, D, device=dev, dtype=dt)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    pos = torch.arange(S, device=dev).expand(B, S).contiguous()
    qpos = pos[:, S - Tq:]
    stats = BlockStats.empty(B, H, D, dev).add(kt, pos, bs)
    sbar = torch.zeros(B, H, D, D, device=dev)
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=1, num_local_blocks=2)
    koff = slot_offsets(pos)
    plan = spla_plan(q, kt, params)  # the call's plan: the decode kernels for one token, else the tile prefill
    many = Tq > 64  # the two-launch selection scores many queries with matmuls, a few with its scoring kernel
    idx = select_indices(q, stats, qpos, params, matmul=many)
    G = HQ // H
    qh = q.transpose(1, 2)  # [B, HQ, Tq, D] view, the sparse kernels' operand
    phiq_t = feature_map(q).to(dt)  # [B, Tq, HQ, D]
    out = {
        "slot_offsets": bench(lambda: slot_offsets(pos)),
        "selection (scores + group top-k kernel)": bench(lambda: select_indices(q, stats, qpos, params, matmul=many)),
        "causal linear term": bench(lambda: causal_linear_term(  # as the Triton path calls it: phi in q's dtype
            phiq_t, feature_map(kt[:, S - Tq:]).to(dt), vt[:, S - Tq:], sbar, qpos >= 0, "ieee")),
        "whole call": bench(lambda: spla_attention(q, kt, vt, qpos, pos, stats, sbar, params, plan=plan,
                                                   k_offsets=koff)),
    }
    tiles = plan.select == "tile"
    if tiles:
        token = spla_plan(q, kt, params, form="token")
        out["whole call, per-token kernels"] = bench(
            lambda: spla_attention(q, kt, vt, qpos, pos, stats, sbar, params, plan=token, k_offsets=koff))
        out["selection, one launch per query tile (select_indices_fast)"] = bench(
            lambda: select_indices_fast(q, stats, qpos, params, prec=plan.select_prec))
    if Tq == S:
        out["block stats (prefill)"] = bench(lambda: BlockStats.empty(B, H, D, dev).add(kt, pos, bs))
    nsp = plan.splits  # the per-token kernel's split-K for these shapes
    qi = qpos.to(torch.int32).contiguous()
    phik = key_features(k)

    def kernel(use_rla=True, pre=False):  # the sparse kernel (and, for nsp > 1, the merge of its splits)
        sparse_forward(qh, k, v, idx, qi, koff, use_rla, bs, nsp, phik=phik if pre else None)

    out["sparse kernel (sparse branch + correction)"] = bench(kernel)
    out["  same, phi(k) precomputed (used for Tq > 64)"] = bench(lambda: kernel(True, True))
    out["  phi(k) of all keys (key_features)"] = bench(lambda: key_features(k))
    out["  same kernel without the correction (SPA)"] = bench(lambda: kernel(False))
    if tiles:  # the query-tile kernels (phi(k) precomputed)
        GP, BM = tile_shape(G, plan.tile_rows)
        NB = triton.cdiv(S, bs)
        union = tile_union(idx, NB, BM)
        out[f"tile: union lists ({union[2].float().mean().item():.1f} blocks per tile)"] = bench(
            lambda: tile_union(idx, NB, BM))
        out["tile: sparse forward incl. union (inference rows)"] = bench(lambda: tile_sparse_forward(
            qh, k, v, idx, qi, koff, True, bs, rows=plan.tile_rows, phik=phik))
    if Tq == S:  # the backward pass of the sparse branch + correction
        qg, kg, vg = (x.detach().requires_grad_() for x in (qh, k, v))
        o, ot = SparseAttention.apply(qg, kg, vg, idx, qi, koff, True, bs, True)
        g = torch.randn_like(o)
        out["CSR lists (queries per key block)"] = bench(lambda: queries_by_block(idx, triton.cdiv(S, bs)))
        out["sparse backward (dq kernel + CSR + dkv kernel)"] = bench(
            lambda: torch.autograd.grad([o, ot], [qg, kg, vg], [g, g], retain_graph=True))
        rows = spla_plan(q, kt, params, grad=True).tile_rows  # a training call's tiles
        o, ot = tile_sparse_attention(qg, kg, vg, idx, qi, koff, True, bs, True, grad=True, rows=rows)
        out["tile: sparse backward (dq kernel + lists + dkv kernel)"] = bench(
            lambda: torch.autograd.grad([o, ot], [qg, kg, vg], [g, g], retain_graph=True))
    return out


def prefill_fn(T, B=1, HQ=32, H=8, D=128, bs=64, top=16, backward=False, layout="bhtd", form=None):
    """(ours, peer) callables of one prefill call at T tokens: SPLA (block stats, selection, sparse
    kernel, residual term) vs SDPA flash; with backward=True both also run the backward pass for
    random output gradients. layout "bthd" stores q, k, v token-major (the op's layout), "bhtd"
    head-major (SDPA's, the model's cache); each side gets views in its own layout. `form`: the
    plan's sparse kernels ("tile" or "token"; default: the plan's choice)."""
    from subquadratic.kernels.spla import BlockStats, SPLAParams, spla_attention

    dev, dt = "cuda", torch.bfloat16

    def make(n):
        if layout == "bthd":
            return torch.randn(B, T, n, D, device=dev, dtype=dt).transpose(1, 2)
        return torch.randn(B, n, T, D, device=dev, dtype=dt)

    q, k, v = (make(n).requires_grad_(backward) for n in (HQ, H, H))
    pos = torch.arange(T, device=dev).expand(B, T).contiguous()
    sbar = torch.zeros(B, H, D, D, device=dev)
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=1, num_local_blocks=2)
    g_sp, g_rla = torch.randn(2, B, HQ, T, D, device=dev, dtype=dt)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, T, heads, D] views
    gt_sp, gt_rla = g_sp.transpose(1, 2), g_rla.transpose(1, 2)
    plan = spla_plan(qt, kt, params, grad=backward, **({} if form is None else {"form": form}))

    def ours():
        stats = BlockStats.empty(B, H, D, dev).add(kt.detach(), pos, bs)
        o_sp, o_rla, _ = spla_attention(qt, kt, vt, pos, pos, stats, sbar, params, plan=plan)
        if backward:
            torch.autograd.backward([o_sp, o_rla], [gt_sp, gt_rla])

    def peer():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if backward:
            o.backward(g_sp)

    return ours, peer


def nsa_case(T=32768, B=1, HQ=64, H=4, D=128, bs=64, top=16, backward=False):
    """P3: fla's parallel_nsa (compressed + selected branches, its own top-16 selection) vs SPLA on
    the configuration NSA accepts (G = 16), same tensors; ms (nsa, ours)."""
    from fla.ops.nsa import parallel_nsa

    ours, _ = prefill_fn(T, B, HQ, H, D, bs, top, backward=backward, layout="bthd")
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, T, HQ, D, device=dev, dtype=dt, requires_grad=backward)
    k, v = (torch.randn(B, T, H, D, device=dev, dtype=dt, requires_grad=backward) for _ in range(2))
    g_cmp, g_slc = (torch.rand(B, T, HQ, device=dev, dtype=dt) for _ in range(2))
    g = torch.randn(B, T, HQ, D, device=dev, dtype=dt)

    def nsa():
        o = parallel_nsa(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=top, block_size=bs)
        if backward:
            o.backward(g)

    return bench(nsa), bench(ours)


def score_variants(B=4, HQ=32, H=8, D=128, S=131072, bs=64, Tq=1):
    """Median ms of the selection (scoring launch + group top-k launch) for the last Tq queries in
    each scoring setting (BN blocks per program, dot precision or elementwise fp32 sums)."""
    from subquadratic.kernels.spla import BlockStats, Launch, SPLAParams, select_indices

    dev = "cuda"
    q = torch.randn(B, Tq, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
    pos = torch.arange(S, device=dev).expand(B, S).contiguous()
    stats = BlockStats.empty(B, H, D, dev).add(k, pos, bs)
    qpos = pos[:, -Tq:].to(torch.int32).contiguous()
    params = SPLAParams(block_size=bs, top_k_blocks=16, num_sink_blocks=1, num_local_blocks=2)
    out = {}
    for bn, prec, use_dot, warps in ((64, "tf32x3", True, 4), (16, "ieee", False, 4)):
        launch = Launch(score_bn=bn, score_prec=prec, score_dot=use_dot, score_warps=warps)
        out[f"selection, score BN={bn} {('dot ' + prec) if use_dot else 'elementwise'} warps={warps}"] = bench(
            lambda launch=launch: select_indices(q, stats, qpos, params, launch=launch))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="smaller contexts (smoke run)")
    ap.add_argument("--prefill-only", action="store_true", help="skip the decode rows and stages (P1)")
    ap.add_argument("--no-nsa", action="store_true", help="skip the fla NSA rows (P3)")
    ap.add_argument("--decode-only", action="store_true", help="only the decode rows and stages (P1)")
    ap.add_argument("--no-sweep", action="store_true", help="no decode launch-settings sweep and no stage breakdowns")
    args = ap.parse_args()
    import transformers
    import triton

    rows = []
    S = 32768 if args.quick else 131072
    if not args.prefill_only:
        peer, ours, ours_graph, frac = decode_case(S=S, sweep=not args.no_sweep)
        rows.append(dict(id="P1", what=f"decode step, B4 HQ32 H8 d128, {S // 1024}k ctx, 16x64", peer_ms=peer,
                         ours_ms=ours, speedup=peer / ours, bytes_vs_dense=frac, target=">= 15x, bytes <= 5%"))
        rows.append(dict(id="P1g", what="  same, SPLA step replayed as a CUDA graph", peer_ms=peer,
                         ours_ms=ours_graph, speedup=peer / ours_graph, target=">= 15x"))
    T = 8192 if args.quick else 32768
    if not args.decode_only:
        o_fn, p_fn = prefill_fn(T)
        t_ours, t_peer = bench(o_fn), bench(p_fn)
        rows.append(dict(id="P2", what=f"prefill fwd, B1 HQ32 H8 d128, T {T // 1024}k", peer_ms=t_peer, ours_ms=t_ours,
                         speedup=t_peer / t_ours, target=">= 3x"))
        o_fn, p_fn = prefill_fn(T, backward=True)
        tb_ours, tb_peer = bench(o_fn), bench(p_fn)
        rows.append(dict(id="P2b", what=f"prefill fwd+bwd, B1 HQ32 H8 d128, T {T // 1024}k", peer_ms=tb_peer,
                         ours_ms=tb_ours, speedup=tb_peer / tb_ours, target=">= 2x"))
        t_tok = bench(prefill_fn(T, form="token")[0])  # the per-token prefill kernels on the same calls
        tb_tok = bench(prefill_fn(T, backward=True, form="token")[0])
        rows.append(dict(id="P2", what="  same fwd, per-token kernels", peer_ms=t_peer,
                         ours_ms=t_tok, speedup=t_peer / t_tok, target=">= 3x"))
        rows.append(dict(id="P2b", what="  same fwd+bwd, per-token kernels", peer_ms=tb_peer,
                         ours_ms=tb_tok, speedup=tb_peer / tb_tok, target=">= 2x"))
        try:
            if args.no_nsa:
                raise ImportError("--no-nsa")
            for bwd in (False, True):
                t_nsa, t_o = nsa_case(T, backward=bwd)
                rows.append(dict(id="P3" + ("b" if bwd else ""), peer="fla parallel_nsa (cmp + slc)",
                                 what=f"vs NSA, {'fwd+bwd' if bwd else 'fwd'}, B1 HQ64 H4 d128, T {T // 1024}k",
                                 peer_ms=t_nsa, ours_ms=t_o, speedup=t_nsa / t_o, target="> 1x"))
        except ImportError as e:
            print(f"P3 skipped: {e}")
        o2, _ = prefill_fn(2 * T)
        t2 = bench(o2)
        rows.append(dict(id="P6", what=f"SPLA prefill fwd time({2 * T // 1024}k)/time({T // 1024}k)", ours_ms=t2,
                         ratio=t2 / t_ours, target="<= 2.1"))
        o2, _ = prefill_fn(2 * T, backward=True)
        t2 = bench(o2)
        rows.append(dict(id="P6b", what=f"SPLA fwd+bwd time({2 * T // 1024}k)/time({T // 1024}k)", ours_ms=t2,
                         ratio=t2 / tb_ours, target="<= 2.1"))
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, transformers=transformers.__version__)
    print(json.dumps(meta))
    print(f"{'id':4} {'what':58} {'peer ms':>9} {'ours ms':>9} {'ratio':>8}  target")
    for r in rows:
        ratio = r.get("speedup", r.get("ratio", math.nan))
        extra = f"  bytes {100 * r['bytes_vs_dense']:.2f}% of dense" if "bytes_vs_dense" in r else ""
        print(f"{r['id']:4} {r['what']:58} {r.get('peer_ms', math.nan):9.3f} {r['ours_ms']:9.3f} {ratio:8.2f}  "
              f"{r['target']}{extra}")
    parts = {} if args.decode_only else {f"prefill, B1, {T // 1024}k": breakdown(T, T, 1)}
    if not args.prefill_only and not args.no_sweep:
        parts["decode, B4, 128k"] = breakdown(1, S, 4)
        parts["decode selection kernels, settings"] = score_variants(S=S)
    for name, stages in parts.items():
        print(f"\nstages of one call, {name} (median ms)")
        for stage, ms in stages.items():
            print(f"  {stage:45} {ms:9.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, stages=parts), f, indent=2)


if __name__ == "__main__":
    main()
