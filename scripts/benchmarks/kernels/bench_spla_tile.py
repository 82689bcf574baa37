"""SPLA query-tile kernels on one GPU: correctness at real shapes (bf16 vs the fp32 reference) and
speed against SDPA flash and the per-token sparse kernel, measured in the same run
(triton.testing.do_bench medians, fresh random data).

  python -m scripts.benchmarks.kernels.bench_spla_tile [--check] [--time] [--T 32768 65536] [--rows 64 128]

"old" is the per-token form (the plan's form="token": `select_indices`, `sparse_forward`,
`SparseAttention`), "new" the query-tile form, the prefill default. The whole-call
comparison of the two is also in scripts/benchmarks/kernels/bench_spla.py (P2 / P2b rows marked "token").

Two kinds of data: "random" (iid q, k: every token selects nearly independent blocks, the worst
case of a tile's union) and "corr" (queries drift slowly along the sequence and keys carry a
per-block offset, as in trained models, where consecutive queries share most of their blocks).
The mean union size per tile is printed with each row. ("corr" gives a union of 26.6 blocks per
16 queries and 38.9 per 64 at 4k, near the 26.4 / 34.7 measured on SmolLM2-135M at 8k.)

Measured on one H200 in one run (torch 2.11, Triton 3.6; B1 HQ32 H8 d128, blocks of 64, 16 selected
incl. 1 sink + 2 local; sparse kernels only, phi(k) precomputed, selection not included; rows = tile
rows, union = mean blocks per tile; "tile fwd" and the tile fwd+bwd include the union build, then
the earlier O(NB * BM * K) union kernel, 2.78 ms at 32k and 10.7 ms at 64k; selection = the
two-launch `select_indices`, not yet `select_indices_fast`):

| T | data | rows | union | flash fwd | old fwd | tile fwd | fwd+bwd flash / old / tile | selection |
| 32k | corr | 64 | 35.5 | 15.15 | 32.10 | 16.21 | 56.81 / 108.2 / 86.6 | 17.2 |
| 32k | corr | 128 | 49.5 | 15.15 | 32.10 | 14.03 | 56.81 / 108.2 / 137.5 | 17.2 |
| 32k | random | 64 | 127.1 | 15.15 | 32.10 | 49.41 | 56.81 / 107.5 / 236.4 | 17.2 |
| 64k | corr | 64 | 39.4 | 59.60 | 64.27 | 40.82 | 229.5 / 217.5 / 192.4 | 62.4 |
| 64k | corr | 128 | 57.3 | 59.60 | 64.27 | 36.91 | 229.5 / 217.5 / 309.7 | 62.4 |
| 64k | random | 64 | 154.7 | 59.60 | 64.79 | 125.9 | 229.5 / 218.6 / 576.6 | 62.4 |
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from scripts.common.bench import spla_plan


def bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def data(kind, B, HQ, H, T, D, dev="cuda", dt=torch.bfloat16, seed=0, bs=64):
    g = torch.Generator(device=dev).manual_seed(seed)
    if kind == "random":
        q, k, v = (torch.randn(B, n, T, D, device=dev, generator=g) for n in (HQ, H, H))
    else:
        rho = 0.98  # AR(1) drift of the queries along the sequence
        w = torch.randn(B, HQ, T, D, device=dev, generator=g)
        steps = torch.arange(T, device=dev, dtype=torch.float32)
        # q_t = sum_s rho^(t-s) w_s, computed as a scan in chunks of a decaying cumulative sum
        q = torch.empty_like(w)
        state = torch.zeros(B, HQ, D, device=dev)
        C = 256
        dec = rho ** steps[:C]
        for c0 in range(0, T, C):
            wc = w[:, :, c0:c0 + C]
            n = wc.shape[2]
            cs = torch.cumsum(wc / dec[:n, None], dim=2) * dec[:n, None]
            q[:, :, c0:c0 + n] = cs + state[:, :, None] * (rho * dec[:n, None])
            state = q[:, :, c0 + n - 1]
        q = q * (1 - rho * rho) ** 0.5 * 2.0
        nb = -(-T // bs)
        off = torch.randn(B, H, nb, D, device=dev, generator=g).repeat_interleave(bs, dim=2)[:, :, :T]
        k = off + 0.5 * torch.randn(B, H, T, D, device=dev, generator=g)
        v = torch.randn(B, H, T, D, device=dev, generator=g)
    return q.to(dt), k.to(dt), v.to(dt)


def check():
    from subquadratic.kernels.spla import BlockStats, SPLAParams, spla_attention, spla_parallel

    dev = "cuda"
    worst = 0.0
    for kind, T, G, D, grad in [("random", 2048, 1, 64, True), ("corr", 2048, 4, 128, True),
                                ("random", 4096, 16, 128, True), ("corr", 8192, 4, 128, False),
                                ("random", 8192, 16, 64, False), ("corr", 4096, 8, 64, True)]:
        H = 2
        HQ = G * H
        q, k, v = (x.transpose(1, 2) for x in data(kind, 1, HQ, H, T, D, seed=T + G))  # [B, T, heads, D]
        pos = torch.arange(T, device=dev)[None].contiguous()
        stats = BlockStats.empty(1, H, D, dev).add(k, pos, 64)
        sbar = torch.zeros(1, H, D, D, device=dev)
        params = SPLAParams(block_size=64, top_k_blocks=16, num_sink_blocks=1, num_local_blocks=2, use_rla=True)
        ins = [x.float().requires_grad_(grad) for x in (q, k, v)]
        want = spla_parallel(*ins, pos, pos, stats, sbar, params)
        outs = [x.detach().requires_grad_(grad) for x in (q, k, v)]
        plan = spla_plan(outs[0], outs[1], params, grad=grad, form="tile")  # the tile kernels, forward and backward
        got = spla_attention(*outs, pos, pos, stats, sbar, params, plan=plan)
        errs = [rel(got[0], want[0]), rel(got[1], want[1])]
        if grad:
            gs = [torch.randn_like(want[0]) for _ in range(2)]
            torch.autograd.backward(want[:2], gs)
            torch.autograd.backward(got[:2], [x.to(got[0].dtype) for x in gs])
            errs += [rel(a.grad, b.grad) for a, b in zip(outs, ins, strict=True)]
        worst = max(worst, *errs)
        print(f"check {kind:6s} T{T} G{G} d{D}: rel o_sp {errs[0]:.2e} o_rla {errs[1]:.2e}"
              + (f" dq {errs[2]:.2e} dk {errs[3]:.2e} dv {errs[4]:.2e}" if grad else ""), flush=True)
    print(f"check worst rel {worst:.2e} ({'PASS' if worst <= 1e-2 else 'FAIL'})", flush=True)


def flash_case(T, B=1, HQ=32, H=8, D=128):
    q, k, v = data("random", B, HQ, H, T, D)
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
    gout = torch.randn_like(q)

    def flash_fb():
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True).backward(gout)

    f_f = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    f_fb = bench(flash_fb)
    print(f"T{T} flash fwd {f_f:.2f} ms fwd+bwd {f_fb:.2f} ms", flush=True)
    return f_f, f_fb


def tile_case(rows, q, k, v, idx, qpos, koff, phik, bs, ref, grads_old, g1, g2):
    from subquadratic.kernels.spla import tile_shape, tile_sparse_attention, tile_sparse_forward, tile_union

    B, HQ, T, D = q.shape
    H = k.shape[1]
    GP, BM = tile_shape(HQ // H, rows)
    NB = -(-T // bs)
    union = tile_union(idx, NB, BM)
    mean_u = union[2].float().mean().item()
    t_union = bench(lambda: tile_union(idx, NB, BM))
    t_new = bench(lambda: tile_sparse_forward(q, k, v, idx, qpos, koff, True, bs, rows=rows, phik=phik))
    o, ot, lse, _ = tile_sparse_forward(q, k, v, idx, qpos, koff, True, bs, rows=rows, phik=phik)
    err = max(rel(o, ref[0]), rel(ot, ref[1]), rel(lse, ref[2]))
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))

    def new_fb():
        o, ot = tile_sparse_attention(qg, kg, vg, idx, qpos, koff, True, bs, True, grad=True, rows=rows)
        torch.autograd.backward([o, ot], [g1, g2])

    t_new_fb = bench(new_fb)
    qg.grad = kg.grad = vg.grad = None
    new_fb()
    gerr = max(rel(x.grad, y) for x, y in zip((qg, kg, vg), grads_old, strict=True))
    return dict(rows=rows, BM=BM, union=mean_u, union_ms=t_union, new_f=t_new, new_fb=t_new_fb, err=err, gerr=gerr)


def data_case(T, kind, rows_list, B=1, HQ=32, H=8, D=128, bs=64):
    from subquadratic.kernels.spla import (
        BlockStats,
        SparseAttention,
        SPLAParams,
        key_features,
        select_indices,
        select_indices_fast,
        sparse_forward,
        spla_attention,
    )

    dev = "cuda"
    params = SPLAParams(block_size=bs, top_k_blocks=16, num_sink_blocks=1, num_local_blocks=2)
    q, k, v = data(kind, B, HQ, H, T, D)
    pos = torch.arange(T, device=dev)[None].contiguous()
    qpos = pos.to(torch.int32)
    koff = torch.zeros(B, dtype=torch.int32, device=dev)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # the op's layout [B, T, heads, D], as views
    stats = BlockStats.empty(B, H, D, dev).add(kt, pos, bs)
    prec = spla_plan(qt, kt, params).select_prec  # the tile selection's precision on this device
    t_sel = bench(lambda: select_indices(qt, stats, qpos, params, matmul=True))  # T queries: score matmuls
    idx = select_indices(qt, stats, qpos, params, matmul=True)
    t_sel_new = bench(lambda: select_indices_fast(qt, stats, qpos, params, prec=prec))
    idx_new = select_indices_fast(qt, stats, qpos, params, prec=prec)
    same = (torch.sort(idx_new, -1).values == torch.sort(idx, -1).values).all(-1).float().mean().item()
    print(f"T{T} {kind} selection: old {t_sel:.2f} ms new {t_sel_new:.2f} ms (old/new {t_sel / t_sel_new:.2f}x), "
          f"same block set for {100 * same:.3f}% of (token, KV head)", flush=True)
    phik = key_features(k)
    t_old = bench(lambda: sparse_forward(q, k, v, idx, qpos, koff, True, bs, phik=phik))
    ref = sparse_forward(q, k, v, idx, qpos, koff, True, bs, phik=phik)
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
    g1, g2 = torch.randn(2, B, T, HQ, D, device=dev)

    def old_fb():
        o, ot = SparseAttention.apply(qg, kg, vg, idx, qpos, koff, True, bs, True)
        torch.autograd.backward([o, ot], [g1, g2])

    t_old_fb = bench(old_fb)
    qg.grad = kg.grad = vg.grad = None
    old_fb()
    grads_old = [x.grad.clone() for x in (qg, kg, vg)]
    out = []
    for rows in rows_list:
        r = dict(T=T, kind=kind, sel=t_sel, old_f=t_old, old_fb=t_old_fb)
        r.update(tile_case(rows, q, k, v, idx, qpos, koff, phik, bs, ref, grads_old, g1, g2))
        print(" ".join(f"{a}={b:.3g}" if isinstance(b, float) else f"{a}={b}" for a, b in r.items()), flush=True)
        out.append(r)
    # the whole prefill call (selection, sparse kernel, residual term), old and new
    sbar = torch.zeros(B, H, D, D, device=dev)
    old, new = (spla_plan(qt, kt, params, form=form) for form in ("token", "tile"))
    whole_old = bench(lambda: spla_attention(qt, kt, vt, pos, pos, stats, sbar, params, plan=old))
    whole_new = bench(lambda: spla_attention(qt, kt, vt, pos, pos, stats, sbar, params, plan=new))
    print(f"T{T} {kind} whole call fwd: old {whole_old:.2f} new {whole_new:.2f} ms (rows {new.tile_rows}, "
          f"old/new {whole_old / whole_new:.2f}x)", flush=True)
    return out


def timing(Ts, rows_list, kinds):
    table = []
    for T in Ts:
        f_f, f_fb = flash_case(T)
        for kind in kinds:
            for r in data_case(T, kind, rows_list):
                table.append(dict(r, flash_f=f_f, flash_fb=f_fb))
    print("\n| T | data | rows | BM | union | flash f | old f | new f | flash/new | old/new | flash fb | old fb "
          "| new fb | flash/new | old/new | select | union ms |")
    for r in table:
        f, fb = r["flash_f"], r["flash_fb"]
        print(f"| {r['T']} | {r['kind']} | {r['rows']} | {r['BM']} | {r['union']:.1f} | {f:.2f} | "
              f"{r['old_f']:.2f} | {r['new_f']:.2f} | {f / r['new_f']:.2f} | {r['old_f'] / r['new_f']:.2f} | "
              f"{fb:.2f} | {r['old_fb']:.2f} | {r['new_fb']:.2f} | {fb / r['new_fb']:.2f} | "
              f"{r['old_fb'] / r['new_fb']:.2f} | {r['sel']:.2f} | {r['union_ms']:.3f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--T", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--rows", type=int, nargs="+", default=[64])
    ap.add_argument("--kinds", nargs="+", default=["corr", "random"])
    a = ap.parse_args()
    if a.check:
        check()
    if a.time:
        timing(a.T, a.rows, a.kinds)


if __name__ == "__main__":
    main()
