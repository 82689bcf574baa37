"""SPLA's sparse branch + residual correction in its three Triton forms on one GPU, with SDPA flash on
the same heads in the same run (triton.testing.do_bench medians, fresh random data): the block-major
kernels (`triton_blocks`: work = the selected (token, block) pairs), the query-tile kernels
(`triton_tile.tile_sparse_attention`: work = each tile's union of blocks) and the per-token kernels
(`triton_parallel.SparseAttention`: every token loads its own blocks). Forward, and forward +
backward for random output gradients; the selection itself is not timed (the block-major form's
inversion of it is).

  python -m scripts.benchmarks.kernels.bench_spla_blocks [--T 32768 65536] [--real FILE] [--sweep [0,1,...]]
      [--atomics] [--out r.json]
  python -m scripts.benchmarks.kernels.bench_spla_blocks --quick        # CPU smoke run in the Triton interpreter

Inputs, B1 HQ32 H8 d128 (--D) bf16, 16 blocks of 64 per token (1 sink + 2 local + 13 chosen):
  iid   random selections: the forced blocks plus distinct uniformly random past blocks (what a
        random-weight model on random tokens selects: an 8-token tile's union covers nearly every block);
  sel   `select_indices_fast` (the package's selection) on random q, k;
  real  (--real FILE, written by scripts/tools/dump_spla_inputs.py: q [L, T, HQ, D], k, v [L, T, H, D] of
        SmolLM2-135M on real text, HQ9 H3 d64, 8k tokens) each layer with its own selection.
Each row prints the mean block union of the tile form's query tiles (training rows / inference rows),
the (token, block) pairs, and the block-major form's counted floors (tensor-core flops of its dots,
HBM bytes of its inputs and outputs, fp32 atomic adds); "check" compares its values and gradients
with the per-token kernels'. --sweep times block-major launch plans (forward form, partials, rows,
warps, window, sort) on the first iid case, the forward with and without the residual term. A
summary table comes last; --out writes every row as JSON. docs/benchmarks_history.md holds the run of
2026-12-01 ("SPLA sparse branch, block-major kernels").
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():  # the Triton interpreter on CPU (--quick); set before Triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from subquadratic.kernels.spla.triton_blocks_common import add_rows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def probe_kernel(OUT, ROWS, R: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    """One [R, D] tile of ones x program id added (MODE >= 0: `add_rows` ATOMICS) or stored (MODE < 0)
    to the rows ROWS[program * R:][:R] of OUT [rows, D]."""
    r = tl.load(ROWS + tl.program_id(0) * R + tl.arange(0, R))
    x = tl.full([R, D], 1.0, tl.float32) * tl.program_id(0).to(tl.float32)
    if MODE < 0:
        tl.store(OUT + r[:, None] * D + tl.arange(0, D)[None, :], x)
    else:
        add_rows(OUT, r, x, r >= 0, D, MODE)


def timed(fn, quick: bool) -> float:
    """Median ms of fn(): do_bench on CUDA; one call in the interpreter (a smoke run, not a timing)."""
    if quick:
        t0 = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - t0)
    from scripts.common.bench import bench

    return bench(fn, warmup=25, rep=100)


def attempt(what: str, fn, default=math.nan):
    """fn() or `default` (the traceback's last lines on stderr), so that one failure keeps the table."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        print(f"{what}: failed\n{traceback.format_exc(limit=3)}", file=sys.stderr, flush=True)
        return default
    finally:
        if DEV == "cuda":
            torch.cuda.empty_cache()


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def iid_selection(B, T, H, bs, top, sink, local, seed=0, chunk=2048) -> torch.Tensor:
    """idx [B, T, H, local + sink + top] int32 in the selection's layout: the local blocks (current
    first), the sinks that are not local, then top - forced distinct uniformly random candidate blocks
    (past, neither sink nor local), -1 for the rest."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    NB = -(-T // bs)
    nsel = local + sink + top
    out = torch.full((B, T, H, nsel), -1, dtype=torch.int32, device=DEV)
    n = torch.arange(NB, device=DEV)
    for t0 in range(0, T, chunk):
        cur = torch.arange(t0, min(T, t0 + chunk), device=DEV) // bs  # [C]
        C = cur.numel()
        loc = cur[:, None] - torch.arange(local, device=DEV)[None, :]  # [C, local]
        snk = torch.arange(sink, device=DEV)[None, :].expand(C, sink)
        snk = torch.where(snk <= cur[:, None] - local, snk, -1)
        forced = (loc >= 0).sum(1) + (snk >= 0).sum(1)  # [C]
        cand = (n[None, :] >= sink) & (n[None, :] <= cur[:, None] - local)  # [C, NB]
        r = torch.rand(B, C, H, NB, device=DEV, generator=g)
        r = torch.where(cand[None, :, None, :], r, -1.0)
        val, ind = r.topk(min(top, NB), dim=-1)  # [B, C, H, top]
        keep = (val >= 0) & (torch.arange(ind.shape[-1], device=DEV) < (top - forced)[None, :, None, None])
        free = torch.where(keep, ind, -1)
        fixed = torch.cat([torch.where(loc >= 0, loc, -1), snk], 1)[None, :, None, :].expand(B, C, H, -1)
        out[:, t0:t0 + C, :, :local + sink] = fixed.int()
        out[:, t0:t0 + C, :, local + sink:local + sink + free.shape[-1]] = free.int()
    return out


def package_selection(q, k, bs, top, sink, local) -> torch.Tensor:
    """The package's one-launch selection (`select_indices_fast`) of q [B, T, HQ, D] over k [B, T, H, D]."""
    from subquadratic.kernels.spla import BlockStats, SPLAParams, select_indices_fast

    B, T, H, D = k.shape
    pos = torch.arange(T, device=DEV).expand(B, T).contiguous()
    stats = BlockStats.empty(B, H, D, DEV).add(k, pos, bs)
    params = SPLAParams(block_size=bs, top_k_blocks=top, num_sink_blocks=sink, num_local_blocks=local)
    return select_indices_fast(q, stats, pos.to(torch.int32), params, prec="tf32x3" if DEV == "cuda" else "ieee")


#: Rows of a query tile of the tile form with and without gradients (the defaults of `plan_spla`).
TILE_ROWS_TRAIN, TILE_ROWS_INFERENCE = 64, 128


def union_sizes(idx, T, G, bs) -> tuple[float, float]:
    """Mean blocks per query tile of the tile form: with its training rows and its inference rows."""
    from subquadratic.kernels.spla import triton_tile as tile

    NB = -(-T // bs)
    out = []
    for rows in (TILE_ROWS_TRAIN, TILE_ROWS_INFERENCE):
        _, BM = tile.tile_shape(G, rows)
        out.append(tile.tile_union(idx, NB, BM)[2].float().mean().item())
    return out[0], out[1]


def floors(bp, q, k, G, bs, nsel, plan) -> dict:
    """Counted floors of the block-major form on these pairs: dot flops (useful: real rows; issued: the
    chunks' padded rows), HBM bytes of inputs and outputs, fp32 atomic adds (forward, backward)."""
    from subquadratic.kernels.spla import triton_blocks

    B, HQ, T, D = q.shape
    H, S = k.shape[1], k.shape[2]
    pairs = int(bp.starts[-1])
    mm = 2 * G * bs * D  # one [G, D] x [D, BS] dot per pair and head group
    esz = q.element_size()
    out = dict(pairs=pairs, flops_fwd=5 * pairs * mm, flops_bwd=10 * pairs * mm)
    for name, bwd, nmm in (("fwd", False, 5), ("bwd", True, 10)):
        _, _, count = triton_blocks.segments(bp, plan.seg_pairs(G, bwd))
        chunks = int(((count + plan.tokens(G, bwd) - 1) // plan.tokens(G, bwd)).sum())
        rows = plan.bwd_rows if bwd else plan.rows
        out[f"issued_flops_{name}"] = chunks * rows * 2 * bs * D * nmm
        out[f"segments_{name}"] = int((count > 0).sum())
    qb, kvb, rows_f32 = B * T * HQ * D * esz, 2 * B * S * H * D * esz, B * T * HQ * D * 4
    out["bytes_fwd"] = qb + kvb + 2 * rows_f32 + B * T * H * nsel * 4 * (1 + 2 * G)  # + idx, slot lse write+read
    out["bytes_bwd"] = qb + kvb + 5 * rows_f32 + 2 * B * S * H * D * 4  # o, do, dot, dq in fp32; dk, dv fp32
    out["atomics_fwd"] = 2 * pairs * G * D
    out["atomics_bwd"] = pairs * G * D + 2 * out["segments_bwd"] * bs * D
    return out


def flash(q, k, v, bwd: bool, quick: bool) -> float:
    """SDPA (flash on bf16 CUDA) causal attention of q [B, HQ, T, D] over k, v [B, H, T, D]."""
    qf, kf, vf = (x.detach().contiguous().requires_grad_(bwd) for x in (q, k, v))
    g = torch.randn_like(qf)

    def run():
        if bwd:
            F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True).backward(g)
        else:
            with torch.no_grad():
                F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)

    return timed(run, quick)


def forms(plan):
    """name -> fn(q, k, v, idx, qpos, koff, bs) returning (o_sp, otilde), each form's own entry point."""
    from subquadratic.kernels.spla import triton_blocks, triton_parallel, triton_tile

    return {
        "blocks": lambda q, k, v, idx, qp, ko, bs: triton_blocks.blocks_sparse_attention(
            q, k, v, idx, qp, ko, True, bs, plan=plan),
        "tile": lambda q, k, v, idx, qp, ko, bs: triton_tile.tile_sparse_attention(
            q, k, v, idx, qp, ko, True, bs, True, grad=torch.is_grad_enabled() and q.requires_grad,
            rows=TILE_ROWS_TRAIN if torch.is_grad_enabled() and q.requires_grad else TILE_ROWS_INFERENCE),
        "token": lambda q, k, v, idx, qp, ko, bs: triton_parallel.SparseAttention.apply(q, k, v, idx, qp, ko, True,
                                                                                        bs, True),
    }


def run_case(label, q, k, v, idx, bs, quick, plan=None, check=True) -> dict:
    """Times of every form and flash on q [B, HQ, T, D], k, v [B, H, T, D] (views of token-major
    tensors, the model's layout) with the selection idx."""
    from subquadratic.kernels.spla import triton_blocks

    B, HQ, T, D = q.shape
    H = k.shape[1]
    G = HQ // H
    qpos = torch.arange(T, device=DEV, dtype=torch.int32).expand(B, T).contiguous()
    koff = torch.zeros(B, dtype=torch.int32, device=DEV)
    plan = plan or triton_blocks.blocks_plan(G, D, DEV)
    row = dict(case=label, T=T, HQ=HQ, H=H, D=D, nsel=idx.shape[-1])
    row["union_train"], row["union_infer"] = attempt(f"{label} union", lambda: union_sizes(idx, T, G, bs),
                                                     (math.nan, math.nan))
    bp = triton_blocks.block_pairs(idx, qpos, -(-T // bs), bs, plan.window, plan.sort)
    row.update(attempt(f"{label} floors", lambda: floors(bp, q, k, G, bs, idx.shape[-1], plan), {}))
    row["flash_fwd"] = attempt(f"{label} flash fwd", lambda: flash(q, k, v, False, quick))
    row["flash_fb"] = attempt(f"{label} flash fwd+bwd", lambda: flash(q, k, v, True, quick))
    g1, g2 = (torch.randn(B, T, HQ, D, device=DEV) for _ in range(2))
    last = {}  # name -> (o_sp, otilde, dq, dk, dv) of the form's last timed forward + backward
    for name, fn in forms(plan).items():
        def fwd(fn=fn):
            with torch.no_grad():
                return fn(q, k, v, idx, qpos, koff, bs)

        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

        def fb(fn=fn, qg=qg, kg=kg, vg=vg, name=name):
            o, ot = fn(qg, kg, vg, idx, qpos, koff, bs)
            last[name] = (o, ot, *torch.autograd.grad([o, ot], [qg, kg, vg], [g1, g2]))

        row[f"{name}_fwd"] = attempt(f"{label} {name} fwd", lambda fwd=fwd: timed(fwd, quick))
        row[f"{name}_fb"] = attempt(f"{label} {name} fwd+bwd", lambda fb=fb: timed(fb, quick))
    if check and "blocks" in last and "token" in last:
        row["check"] = max(rel(a, b) for a, b in zip(last["blocks"], last["token"], strict=True))
    last.clear()
    if not quick:
        row.update(attempt(f"{label} stages", lambda: stages(q, k, v, idx, qpos, koff, bs, plan, g1, g2), {}))
    print(json.dumps({a: (round(b, 4) if isinstance(b, float) else b) for a, b in row.items()}), flush=True)
    return row


def stages(q, k, v, idx, qpos, koff, bs, plan, g1, g2) -> dict:
    """ms of the block-major form's pieces: the inversion (both sorts), the split forward (its pass and
    combine), each pass of the atomic forward, the backward."""
    from subquadratic.kernels.spla import triton_blocks
    from subquadratic.kernels.spla.triton_blocks_bwd import blocks_sparse_backward

    NB = -(-k.shape[2] // bs)
    out = {}
    for sort in ("sort", "count"):
        out[f"st_pairs_{sort}"] = timed(
            lambda sort=sort: triton_blocks.block_pairs(idx, qpos, NB, bs, plan.window, sort), False)
    bp = triton_blocks.block_pairs(idx, qpos, NB, bs, plan.window, plan.sort)
    nsel, G = idx.shape[-1], q.shape[1] // k.shape[1]
    out["st_segments"] = timed(lambda: triton_blocks.segments(bp, plan.seg_pairs(G)), False)
    launch = triton_blocks._launch(q, k, bp, nsel, bs, plan, False)
    out["st_split"] = timed(lambda: triton_blocks.split_pass(q, k, v, bp, qpos, koff, nsel, True, bs, plan, False,
                                                             launch), False)
    out["st_pass1"] = timed(lambda: triton_blocks.lse_pass(q, k, bp, qpos, koff, nsel, bs, plan, False, launch), False)
    lse = triton_blocks.lse_pass(q, k, bp, qpos, koff, nsel, bs, plan, False, launch)
    out["st_pass2"] = timed(lambda: triton_blocks.out_pass(q, k, v, bp, qpos, koff, lse, nsel, True, bs, plan, False,
                                                           launch), False)
    o, _ = triton_blocks.out_pass(q, k, v, bp, qpos, koff, lse, nsel, True, bs, plan, False, launch)
    out["st_backward"] = timed(lambda: blocks_sparse_backward(q, k, v, qpos, koff, o, lse, bp, nsel, g1, g2, True, bs,
                                                              plan), False)
    return out


def atomics_probe(quick: bool) -> list[dict]:
    """The rate of fp32 atomic adds of [64, 128] row tiles (the kernels' O / dq updates, through
    `triton_blocks_common.add_rows`: scalar tl.atomic_add or red.global.add.v4.f32) into a [32768 x 32, 128]
    buffer (the O of 32k tokens x 32 heads, 537 MB), rows drawn at random inside a window of
    4096 x 32 rows (what the window order gives) or over the whole buffer, and plain stores to random
    rows, over 2^31 adds (32k forward's O: T x HQ x NSEL x D)."""
    n_rows, D, R = (1024 if quick else 32768 * 32), 128, 64
    adds = n_rows * 16 * D
    out = torch.zeros(n_rows, D, device=DEV)
    progs = adds // (R * D)
    res = []
    modes = [0, 2] if quick else [0, 1]
    for what, window, mode in [(f"atomics {m}, rows in a window", 4096 * 32, m) for m in modes] + [
            (f"atomics {m}, rows anywhere", n_rows, m) for m in modes] + [("store, rows anywhere", n_rows, -1)]:
        window = min(window, n_rows)
        base = torch.arange(progs, device=DEV) * (n_rows // window) // progs * window  # the windows in order
        rows = (base[:, None] + torch.randint(0, window, (progs, R), device=DEV)).clamp(max=n_rows - 1)
        rows = rows.to(torch.int32).contiguous()
        ms = timed(lambda rows=rows, mode=mode: probe_kernel[(progs,)](out, rows, R=R, D=D, MODE=mode, num_warps=4),
                   quick)
        res.append(dict(what=what, ms=ms, adds_per_s=adds / (ms * 1e-3)))
        print(f"atomics probe: {what:30} {ms:8.3f} ms for {adds / 1e9:.2f}G fp32 ({adds / (ms * 1e6):.3g} G/s)",
              flush=True)
    return res


def make_qkv(B, T, HQ, H, D, seed, dtype=torch.bfloat16):
    """Fresh random q [B, HQ, T, D], k, v [B, H, T, D] as views of token-major [B, T, heads, D] tensors."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(B, T, n, D, device=DEV, generator=g).to(dtype).transpose(1, 2) for n in (HQ, H, H))


#: Block-major plans that --sweep times (overrides of the default `blocks_plan`), most telling first.
SWEEP = [dict(), dict(dq="pairs"), dict(forward="atomic"), dict(partials="bf16"),
         dict(window=4096, seg_chunks=16, bwd_seg_chunks=16),
         dict(window=16384),
         dict(seg_chunks=64, bwd_seg_chunks=64), dict(bwd_seg_chunks=16), dict(atomics="scalar"),
         dict(bwd="split"), dict(bwd_rows=64, bwd_warps=8), dict(rows=128, warps=8), dict(dkdv_keys=32),
         dict(sort="count"), dict(bwd_stages=2), dict(bwd_stages=3), dict(stages=2), dict(bwd_rows=16),
         dict(bwd_rows=64), dict(dq_keys=32), dict(bwd_stages=2, dq="pairs"), dict(bwd_rows=32),
         dict(bwd="fused"), dict(bwd="fused", bwd_warps=8), dict(bwd="fused", bwd_rows=32),
         dict(bwd="fused", bwd_rows=128, bwd_warps=8), dict(rows=64, warps=4), dict(rows=128, warps=4),
         dict(lse_rows=64, lse_warps=4)]


def sweep(q, k, v, idx, bs, quick, which: str = "all") -> list[dict]:
    """Forward and forward + backward of the block-major form under the plans of SWEEP ("all" or a
    comma list of indices)."""
    from subquadratic.kernels.spla import triton_blocks

    B, HQ, T, D = q.shape
    G = HQ // k.shape[1]
    qpos = torch.arange(T, device=DEV, dtype=torch.int32).expand(B, T).contiguous()
    koff = torch.zeros(B, dtype=torch.int32, device=DEV)
    g1, g2 = (torch.randn(B, T, HQ, D, device=DEV) for _ in range(2))
    rows = []
    plans = SWEEP if which == "all" else [SWEEP[int(i)] for i in which.split(",")]
    for over in plans[:2] if quick else plans:
        plan = triton_blocks.blocks_plan(G, D, DEV, **over)

        def fwd(plan=plan, rla=True):
            with torch.no_grad():
                triton_blocks.blocks_sparse_attention(q, k, v, idx, qpos, koff, rla, bs, plan=plan)

        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

        def fb(plan=plan, qg=qg, kg=kg, vg=vg):
            o, ot = triton_blocks.blocks_sparse_attention(qg, kg, vg, idx, qpos, koff, True, bs, plan=plan)
            torch.autograd.backward([o, ot], [g1, g2])

        r = dict(plan=over or "default", fwd=attempt(f"sweep {over} fwd", lambda fwd=fwd: timed(fwd, quick)),
                 fwd_sparse_only=attempt(f"sweep {over} fwd without the residual term",
                                         lambda fwd=fwd: timed(lambda: fwd(rla=False), quick)),
                 fb=attempt(f"sweep {over} fwd+bwd", lambda fb=fb: timed(fb, quick)))
        print(f"sweep T={T} {json.dumps(r)}", flush=True)
        rows.append(r)
    return rows


def real_cases(path, quick, layers=None):
    """(label, q, k, v, idx, bs) of each layer of a dump_spla_inputs.py file, with its own selection."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        qa, ka, va = (f.get_tensor(n) for n in "qkv")  # [L, T, heads, D]
    bs = int(meta.get("block_size", 64))
    top = int(meta.get("top_k_blocks", 16))
    names = json.loads(meta["layers"]) if "layers" in meta else list(range(qa.shape[0]))
    for li in range(qa.shape[0]) if layers is None else layers:
        q, k, v = (x[li][None].to(DEV, torch.float32 if quick else torch.bfloat16) for x in (qa, ka, va))
        idx = package_selection(q, k, bs, top, 1, 2)
        yield f"real L{names[li]}", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), idx, bs


def summary(rows: list[dict]) -> None:
    cols = ["case", "T", "union_train", "union_infer", "flash_fwd", "blocks_fwd", "tile_fwd", "token_fwd",
            "flash_fb", "blocks_fb", "tile_fb", "token_fb", "check"]
    print("\n| " + " | ".join(cols) + " | flash/blocks fwd | flash/blocks fwd+bwd |")
    print("|" + " --- |" * (len(cols) + 2))
    for r in rows:
        cells = [f"{r.get(c, math.nan):.3g}" if isinstance(r.get(c, math.nan), float) else str(r.get(c))
                 for c in cols]
        rf = r.get("flash_fwd", math.nan) / r.get("blocks_fwd", math.nan)
        rb = r.get("flash_fb", math.nan) / r.get("blocks_fb", math.nan)
        print("| " + " | ".join(cells) + f" | {rf:.2f} | {rb:.2f} |")
    print("\nblock-major floors (per case): pairs, dot TFLOP useful / issued fwd, bwd; HBM GB fwd, bwd; "
          "atomic adds (G) fwd, bwd; stages ms")
    for r in rows:
        if "pairs" not in r:
            continue
        st = " ".join(f"{k[3:]}={r[k]:.3f}" for k in r if k.startswith("st_"))
        print(f"  {r['case']:10} T={r['T']}: pairs {r['pairs'] / 1e6:.2f}M, TFLOP fwd {r['flops_fwd'] / 1e12:.3f} / "
              f"{r['issued_flops_fwd'] / 1e12:.3f}, bwd {r['flops_bwd'] / 1e12:.3f} / "
              f"{r['issued_flops_bwd'] / 1e12:.3f}; "
              f"GB fwd {r['bytes_fwd'] / 1e9:.2f}, bwd {r['bytes_bwd'] / 1e9:.2f}; atomics fwd "
              f"{r['atomics_fwd'] / 1e9:.2f}, bwd {r['atomics_bwd'] / 1e9:.2f}; {st}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=None, help="sequence lengths (default 32768 65536)")
    ap.add_argument("--data", nargs="+", default=["iid", "sel"], choices=["iid", "sel"])
    ap.add_argument("--real", default=None, help="a scripts/tools/dump_spla_inputs.py file: time every layer of it")
    ap.add_argument("--sweep", nargs="?", const="all", default=None,
                    help="time block-major launch plans (SWEEP, or a comma list of its indices) on the first iid case")
    ap.add_argument("--D", type=int, default=128, help="head dim (Llama-3.2-1B: 64)")
    ap.add_argument("--no-check", action="store_true", help="skip the values/gradients comparison")
    ap.add_argument("--atomics", action="store_true", help="measure the fp32 atomic-add rate first")
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    ap.add_argument("--quick", action="store_true", help="tiny shapes in the CPU interpreter (smoke run)")
    args = ap.parse_args()
    quick = args.quick
    if not quick and DEV != "cuda":
        sys.exit("bench_spla_blocks.py needs a CUDA GPU (or --quick for the CPU smoke run)")
    if quick:
        B, HQ, H, D, bs, top, Ts, dtype = 1, 4, 2, 16, 16, 3, args.T or [36], torch.float32
    else:
        B, HQ, H, D, bs, top, Ts, dtype = 1, 32, 8, args.D, 64, 16, args.T or [32768, 65536], torch.bfloat16
    rows, sweeps = [], []
    probes = attempt("atomics probe", lambda: atomics_probe(quick), []) if args.atomics else []
    for T in Ts:
        for kind in args.data:
            q, k, v = make_qkv(B, T, HQ, H, D, seed=T + len(kind), dtype=dtype)
            if kind == "iid":
                idx = iid_selection(B, T, H, bs, top, 1, 2, seed=T)
            else:
                idx = package_selection(q.transpose(1, 2), k.transpose(1, 2), bs, top, 1, 2)
            if args.sweep and kind == "iid" and not sweeps:
                sweeps = sweep(q, k, v, idx, bs, quick, args.sweep)
            rows.append(run_case(kind, q, k, v, idx, bs, quick, check=not args.no_check))
            del q, k, v, idx
    if args.real:
        for label, q, k, v, idx, bs_r in real_cases(args.real, quick):
            rows.append(run_case(label, q, k, v, idx, bs_r, quick, check=not args.no_check))
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                torch=torch.__version__, triton=triton.__version__)
    print(json.dumps(meta))
    if sweeps:
        print("\nblock-major plans (first iid case), ms: " + "; ".join(
            f"{s['plan']}: fwd {s['fwd']:.3f} (without the residual term {s['fwd_sparse_only']:.3f}) "
            f"fwd+bwd {s['fb']:.3f}" for s in sweeps))
    summary(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, sweep=sweeps, atomics=probes), f, indent=2, default=str)


if __name__ == "__main__":
    main()
