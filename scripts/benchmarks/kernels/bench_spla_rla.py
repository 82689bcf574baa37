"""What SPLA's residual linear term costs (issue: an adapted model, gamma != 0, against the fresh
conversion, gamma = 0, whose inference skips the term): one layer's attention op at Llama-3.2-1B shapes
(B1 HQ32 H8 d64, 16 blocks of 64, bf16, fresh random data, triton.testing.do_bench medians), the op
with the term (`use_rla=True`, then o + RMSNorm_gamma(o_rla)) against the op without it (`use_rla=False`),
for a prefill without gradients, a forward + backward and a decode step, and the stages of the term
apart (the sparse kernel with and without the correction, the block-major one with the correction added
with atomics instead of per-slot partials, the feature maps, the causal linear term, the dropped rows, the
subtraction and the norm-add), and the prefill op on the block-major form whatever the plan picks,
with and without the norm-add in the combine (`SPLAPlan.fuse_norm`).

  python -m scripts.benchmarks.kernels.bench_spla_rla [--lengths 4096,16384,32768] [--decode 131072]
                                                   [--out r.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import torch

from scripts.common.bench import bench


def layer_case(T: int, S: int, B: int = 1, HQ: int = 32, H: int = 8, D: int = 64, bs: int = 64, top: int = 16,
               backward: bool = False) -> dict[str, float]:
    """Median ms of one SPLA layer op (queries = the last T of S keys) with and without the residual term,
    and, for a prefill without gradients, its stages."""
    from subquadratic.kernels.spla import BlockStats, SPLAParams, spla_attention
    from subquadratic.kernels.spla.plan import plan_spla
    from subquadratic.kernels.utils import slot_offsets
    from subquadratic.modeling.fused import HeadNorm

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, T, HQ, D, device=dev, dtype=dt, requires_grad=backward)
    k = torch.randn(B, S, H, D, device=dev, dtype=dt, requires_grad=backward)
    v = torch.randn(B, S, H, D, device=dev, dtype=dt, requires_grad=backward)
    pos = torch.arange(S, device=dev).expand(B, S).contiguous()
    qpos = pos[:, S - T:]
    stats = BlockStats.empty(B, H, D, dev).add(k.detach(), pos, bs)
    sbar = torch.zeros(B, H, D, D, device=dev)
    koff = slot_offsets(pos)
    norm = HeadNorm(HQ, D, init_value=0.1).to(dev)
    with_rla = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=1, num_local_blocks=2)
    without = dataclasses.replace(with_rla, use_rla=False)

    def op(params, **fields):
        plan = plan_spla(q.shape, k.shape, dt, q.device, params, backend="triton", grad=backward, **fields)

        def run():
            # as the SPLA mixer calls it: without gradients the kernels may add the norm themselves
            o_sp, o_rla, _ = spla_attention(q, k, v, qpos, pos, stats, sbar, params, plan=plan, k_offsets=koff,
                                            causal=True, rla_norm=None if backward else (norm.weight, norm.eps))
            o = o_sp.transpose(1, 2)
            if o_rla is not None:
                o = norm.add(o, o_rla.transpose(1, 2), "triton")
            if backward:
                o.float().sum().backward()
            return o
        return run

    if not backward:
        with torch.no_grad():
            out = {"op with the term": bench(op(with_rla)), "op without the term": bench(op(without))}
            if T >= 16:  # the plan's form against the block-major one
                out["op with the term, block-major form, the norm-add after (fuse_norm=False)"] = bench(
                    op(with_rla, form="blocks", fuse_norm=False))
                out["op with the term, block-major, the norm-add in the combine (fuse_norm=True)"] = bench(
                    op(with_rla, form="blocks", fuse_norm=True))
            out.update(stages(q, k, v, qpos, pos, stats, sbar, koff, with_rla, norm) if T > 1 else {})
        return out
    return {"op with the term": bench(op(with_rla)), "op without the term": bench(op(without))}


def stages(q, k, v, qpos, pos, stats, sbar, koff, params, norm) -> dict[str, float]:
    """Median ms of the pieces of a prefill call on the plan's path (no gradients)."""
    from subquadratic.kernels.spla import select_indices_stream
    from subquadratic.kernels.spla.plan import plan_spla
    from subquadratic.kernels.spla.triton_blocks import blocks_sparse_attention
    from subquadratic.kernels.spla.triton_blocks_common import blocks_plan
    from subquadratic.kernels.spla.triton_common import key_features
    from subquadratic.kernels.spla.triton_parallel import (
        causal_linear_term,
        dropped_rows,
        dropped_rows_reference,
        feature_rows,
        residual_term,
    )
    from subquadratic.kernels.spla.triton_tile import query_tile_union, tile_sparse_attention

    B, T, HQ, D = q.shape
    H = k.shape[2]
    bs = params.block_size
    plan = plan_spla(q.shape, k.shape, q.dtype, q.device, params, backend="triton", grad=False)
    qi = qpos.to(torch.int32).contiguous()
    idx = select_indices_stream(q, stats, qi, params, precision=plan.select_prec)
    kq, kk, kv = (x.transpose(1, 2) for x in (q, k, v))
    union = query_tile_union(idx, kk.shape[2], HQ // H, bs, plan.tile_rows)
    out = {
        f"selection ({plan.select}, {plan.select_prec}; form {plan.form}, mean union "
        f"{union[2].float().mean().item():.1f} blocks)": bench(
            lambda: select_indices_stream(q, stats, qi, params, precision=plan.select_prec)),
        "phi(k) of all keys": bench(lambda: key_features(kk)),
        "tile sparse kernel with the correction": bench(lambda: tile_sparse_attention(
            kq, kk, kv, idx, qi, koff, True, bs, True, grad=False, rows=plan.tile_rows, precision=plan.precision)),
        "tile sparse kernel without it": bench(lambda: tile_sparse_attention(
            kq, kk, kv, idx, qi, koff, False, bs, False, grad=False, rows=plan.tile_rows, precision=plan.precision)),
        "block-major sparse kernel with the correction": bench(lambda: blocks_sparse_attention(
            kq, kk, kv, idx, qi, koff, True, bs, precision=plan.precision, o_dtype=q.dtype)),
        "block-major sparse kernel without it": bench(lambda: blocks_sparse_attention(
            kq, kk, kv, idx, qi, koff, False, bs, precision=plan.precision, o_dtype=q.dtype)),
        "block-major sparse kernel, the correction added with atomics (rla_sum='atomic')": bench(
            lambda: blocks_sparse_attention(kq, kk, kv, idx, qi, koff, True, bs, o_dtype=q.dtype, plan=blocks_plan(
                HQ // H, D, q.device, True, precision=plan.precision, dtype=q.dtype, rla_sum="atomic"))),
    }
    kt, vt = k[:, -T:], v[:, -T:]
    phiq, phik = feature_rows(q, q.dtype), feature_rows(kt, q.dtype)
    out["phi(q), phi(k) of the new tokens (feature_rows)"] = bench(
        lambda: (feature_rows(q, q.dtype), feature_rows(kt, q.dtype)))
    out["causal linear term (chunked)"] = bench(lambda: causal_linear_term(phiq, phik, vt, sbar, None, "tf32"))
    o_lin, _ = causal_linear_term(phiq, phik, vt, sbar, None, "tf32")

    out["dropped rows (PyTorch form)"] = bench(lambda: dropped_rows_reference(idx, qpos, bs))
    out["dropped rows (dropped_rows, one launch)"] = bench(lambda: dropped_rows(idx, qi, bs))
    drop = dropped_rows(idx, qi, bs)
    otilde = torch.randn_like(o_lin)
    out["o_lin - otilde (residual_term)"] = bench(lambda: residual_term(o_lin, otilde, drop, q.dtype))
    o_rla = residual_term(o_lin, otilde, drop, q.dtype)
    o = torch.randn_like(q)
    out["o + RMSNorm(o_rla) (norm add)"] = bench(lambda: norm.add(o.transpose(1, 2), o_rla.transpose(1, 2), "triton"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096,16384,32768")
    ap.add_argument("--decode", default="131072", help="contexts of the decode rows (B1 and B4)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import transformers
    import triton

    res = {"meta": dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                        torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__),
           "rows": {}}

    def record(name, row):
        res["rows"][name] = row
        print(f"\n{name}")
        for what, ms in row.items():
            print(f"  {what:52} {ms:9.3f} ms")
        w, wo = row.get("op with the term"), row.get("op without the term")
        if w and wo:
            print(f"  {'with / without':52} {w / wo:9.3f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)

    for T in (int(x) for x in args.lengths.split(",") if x):
        record(f"prefill T={T}", layer_case(T, T))
        torch.cuda.empty_cache()
        record(f"fwd+bwd T={T}", layer_case(T, T, backward=True))
        torch.cuda.empty_cache()
    for S in (int(x) for x in args.decode.split(",") if x):
        for B in (1, 4):
            record(f"decode B{B} S={S}", layer_case(1, S, B=B))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
