"""SPLA speed on one GPU against SDPA flash attention measured in the same run (bf16, fresh random
data, triton.testing.do_bench medians). Prints one table (peer, ours, ratio) and writes it as JSON.

  python scripts/bench_spla.py [--out results.json] [--quick]

Rows: P1 decode step at 128k context (B4 HQ32 H8 d128, 16 blocks of 64) with the bytes each reads;
P2 prefill forward at 32k (B1 HQ32 H8 d128); P6 time(64k)/time(32k) of the SPLA prefill forward.
The backward kernels are not written yet, so no fwd+bwd row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math

import torch
import torch.nn.functional as F


def bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def decode_case(B=4, HQ=32, H=8, D=128, S=131072, bs=64, top=16):
    from subquadratic.kernels.positions import left_pad_offsets
    from subquadratic.kernels.spla import BlockStats
    from subquadratic.kernels.spla.triton_ops import spla_attention_triton

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=dt)
    k = torch.randn(B, H, S, D, device=dev, dtype=dt)
    v = torch.randn(B, H, S, D, device=dev, dtype=dt)
    pos = torch.arange(S, device=dev).expand(B, S).contiguous()
    stats = BlockStats.empty(B, H, D, dev).add(k, pos, bs)
    sbar = torch.randn(B, H, D, D, device=dev) * 0.01
    cfg = dict(block_size=bs, top_k_blocks=top, num_sink_blocks=1, num_local_blocks=2)
    koff = left_pad_offsets(pos)  # the model computes this once per forward for all layers
    ours = bench(lambda: spla_attention_triton(q, k, v, pos[:, -1:], pos, stats, sbar, k_offsets=koff, **cfg))
    qd = q.transpose(1, 2).reshape(B, 1, HQ, D).transpose(1, 2)
    peer = bench(lambda: F.scaled_dot_product_attention(qd, k, v, enable_gqa=True))
    # the same step replayed as one CUDA graph (how serving stacks run decode): launch gaps removed
    step = lambda: spla_attention_triton(q, k, v, pos[:, -1:], pos, stats, sbar, k_offsets=koff, **cfg)  # noqa: E731
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
    from subquadratic.kernels.spla import triton_ops as tk

    print("\ndecode launch settings (whole step, median ms)")
    default = (tk.DECODE_SCORE_BN, tk.DECODE_SCORE_IEEE, tk.DECODE_WARPS)
    for bn, ieee, warps in ((32, True, 4), (64, True, 4), (128, True, 4), (128, False, 4), (64, True, 8),
                            (64, False, 2)):
        tk.DECODE_SCORE_BN, tk.DECODE_SCORE_IEEE, tk.DECODE_WARPS = bn, ieee, warps
        print(f"  score BN={bn:3} ieee={ieee!s:5} decode warps={warps}: {bench(step):8.4f}")
    tk.DECODE_SCORE_BN, tk.DECODE_SCORE_IEEE, tk.DECODE_WARPS = default
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
    from subquadratic.kernels.positions import left_pad_offsets
    from subquadratic.kernels.spla import BlockStats, feature_map, select_blocks
    from subquadratic.kernels.spla import triton_ops as tk

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, HQ, Tq, D, device=dev, dtype=dt)
    k = torch.randn(B, H, S, D, device=dev, dtype=dt)
    v = torch.randn(B, H, S, D, device=dev, dtype=dt)
    pos = torch.arange(S, device=dev).expand(B, S).contiguous()
    qpos = pos[:, S - Tq:]
    stats = BlockStats.empty(B, H, D, dev).add(k, pos, bs)
    sbar = torch.zeros(B, H, D, D, device=dev)
    kw = dict(block_size=bs, top_k_blocks=top, num_sink_blocks=1, num_local_blocks=2)
    koff = left_pad_offsets(pos)
    sel = select_blocks(q, stats, qpos, **kw)
    idx = (tk.select_block_indices(q, stats, qpos, **kw) if Tq <= tk.SCORE_KERNEL_MAX_TQ
           else tk.selected_block_indices(sel, top))
    nsel = idx.shape[-1]
    G = HQ // H
    phiq = feature_map(q).view(B, H, G, Tq, D)
    out = {
        "left_pad_offsets": bench(lambda: left_pad_offsets(pos)),
        "select_blocks (scores + top-k)": bench(lambda: select_blocks(q, stats, qpos, **kw)),
        "block indices (sort)": bench(lambda: tk.selected_block_indices(sel, top)),
        "causal linear term": bench(lambda: tk.causal_linear_term(
            phiq, feature_map(k[:, :, S - Tq:]), v[:, :, S - Tq:].float(), sbar, qpos >= 0, chunk=min(64, Tq))),
        "whole call": bench(lambda: tk.spla_attention_triton(q, k, v, qpos, pos, stats, sbar, k_offsets=koff, **kw)),
    }
    if Tq <= tk.SCORE_KERNEL_MAX_TQ:
        out["scoring kernel + top-k (used for Tq <= 64)"] = bench(lambda: tk.select_block_indices(q, stats, qpos, **kw))
    if Tq == S:
        out["block stats (prefill)"] = bench(lambda: BlockStats.empty(B, H, D, dev).add(k, pos, bs))
    GP = max(16, G)
    nsp = max(1, min(nsel, 264 // (B * H * Tq))) if Tq <= 8 else 1
    per = -(-nsel // nsp)
    parts = [torch.empty(nsp, B, Tq, HQ, D, device=dev) for _ in range(2)]
    ml = [torch.empty(nsp, B, Tq, HQ, device=dev) for _ in range(2)]
    qi = qpos.to(torch.int32).contiguous()

    def kernel(warps=4, stages=2):
        tk.spla_sparse_kernel[(Tq, B * H, nsp)](
            q, k, v, idx, qi, koff, parts[0], parts[1], ml[0], ml[1], q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), Tq, H, nsel, per,
            1 / math.sqrt(D), G=G, GP=GP, D=D, BS=bs, USE_RLA=True, IEEE=False, num_warps=warps, num_stages=stages)

    out["sparse kernel (sparse branch + correction)"] = bench(kernel)
    for warps, stages in ((2, 2), (4, 3), (8, 2), (8, 3)):
        out[f"  sparse kernel, num_warps={warps} num_stages={stages}"] = bench(lambda w=warps, s=stages: kernel(w, s))
    return out


def prefill_fn(T, B=1, HQ=32, H=8, D=128, bs=64, top=16):
    from subquadratic.kernels.spla import BlockStats
    from subquadratic.kernels.spla.triton_ops import spla_attention_triton

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, HQ, T, D, device=dev, dtype=dt)
    k = torch.randn(B, H, T, D, device=dev, dtype=dt)
    v = torch.randn(B, H, T, D, device=dev, dtype=dt)
    pos = torch.arange(T, device=dev).expand(B, T).contiguous()
    sbar = torch.zeros(B, H, D, D, device=dev)
    cfg = dict(block_size=bs, top_k_blocks=top, num_sink_blocks=1, num_local_blocks=2)

    def ours():
        stats = BlockStats.empty(B, H, D, dev).add(k, pos, bs)
        return spla_attention_triton(q, k, v, pos, pos, stats, sbar, **cfg)

    def peer():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return ours, peer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="smaller contexts (smoke run)")
    args = ap.parse_args()
    import transformers
    import triton

    rows = []
    S = 32768 if args.quick else 131072
    peer, ours, ours_graph, frac = decode_case(S=S)
    rows.append(dict(id="P1", what=f"decode step, B4 HQ32 H8 d128, {S // 1024}k ctx, 16x64", peer_ms=peer,
                     ours_ms=ours, speedup=peer / ours, bytes_vs_dense=frac, target=">= 15x, bytes <= 5%"))
    rows.append(dict(id="P1g", what="  same, SPLA step replayed as a CUDA graph", peer_ms=peer, ours_ms=ours_graph,
                     speedup=peer / ours_graph, target=">= 15x"))
    T = 8192 if args.quick else 32768
    o_fn, p_fn = prefill_fn(T)
    t_ours, t_peer = bench(o_fn), bench(p_fn)
    rows.append(dict(id="P2", what=f"prefill fwd, B1 HQ32 H8 d128, T {T // 1024}k", peer_ms=t_peer, ours_ms=t_ours,
                     speedup=t_peer / t_ours, target=">= 3x"))
    o2, _ = prefill_fn(2 * T)
    t2 = bench(o2)
    rows.append(dict(id="P6", what=f"SPLA prefill fwd time({2 * T // 1024}k)/time({T // 1024}k)", ours_ms=t2,
                     ratio=t2 / t_ours, target="<= 2.1"))
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, transformers=transformers.__version__)
    print(json.dumps(meta))
    print(f"{'id':4} {'what':58} {'peer ms':>9} {'ours ms':>9} {'ratio':>8}  target")
    for r in rows:
        ratio = r.get("speedup", r.get("ratio", math.nan))
        extra = f"  bytes {100 * r['bytes_vs_dense']:.2f}% of dense" if "bytes_vs_dense" in r else ""
        print(f"{r['id']:4} {r['what']:58} {r.get('peer_ms', math.nan):9.3f} {r['ours_ms']:9.3f} {ratio:8.2f}  "
              f"{r['target']}{extra}")
    parts = {"decode, B4, 128k": breakdown(1, S, 4), f"prefill, B1, {T // 1024}k": breakdown(T, T, 1)}
    for name, stages in parts.items():
        print(f"\nstages of one call, {name} (median ms)")
        for stage, ms in stages.items():
            print(f"  {stage:45} {ms:9.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, stages=parts), f, indent=2)


if __name__ == "__main__":
    main()
