"""Count the aten ops of one mixer layer's forward (and backward) per family on the CPU: a
device-independent proxy for the kernel launches of the glue around the attention kernels (each
non-view aten op is one launch or more on the GPU; views launch nothing and are not counted).

Two views per family:
- "model": one layer of the family's model (Llama-like tiny shapes, no padding: `SequenceInfo.causal`
  set as in a plain prefill), the mixer's forward alone (forward hooks switch the counter on), without
  and with gradients, and the whole one-layer model's backward; with --cuda-paths (the default) the
  backends' "auto" takes the Triton paths on the CPU as it does on CUDA (the interpreter runs them),
  so the glue counted is the CUDA path's;
- "triton": the CUDA path's Python wrapper (`hla_triton`, `sse_triton`, `spla_parallel_triton`)
  called on CPU tensors under TRITON_INTERPRET=1; each Triton launch counts as one op
  ("<triton>") and the interpreter's own tensor traffic is not counted.

    TRITON_INTERPRET=1 python -m scripts.tools.count_ops [--family hla] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

FAMILIES = ("hla", "sse", "spla")
SHAPE = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5)


#: ops that allocate or wrap a host scalar and launch no kernel
NO_LAUNCH = frozenset({"empty.memory_format", "empty_strided.default", "new_empty.default", "new_empty_strided.default",
                       "scalar_tensor.default", "promote_types.default"})


class OpCounter(TorchDispatchMode):
    """Counts the non-view aten ops dispatched while `active` (and not inside a Triton launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.active = True
        self._in_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active and not self._in_kernel and not func.is_view and func.__name__ not in ("detach.default",):
            self.counts[func.__name__] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def triton_launches(self):
        """Count each interpreted Triton launch as one op, and nothing inside it."""
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:
            yield
            return
        run = InterpretedFunction.run
        counter = self

        def counted(fn_self, *args, **kwargs):
            if counter.active and not counter._in_kernel:
                counter.counts["<triton>"] += 1
            counter._in_kernel += 1
            try:
                return run(fn_self, *args, **kwargs)
            finally:
                counter._in_kernel -= 1

        InterpretedFunction.run = counted
        try:
            yield
        finally:
            InterpretedFunction.run = run

    def total(self) -> int:
        return sum(self.counts.values())


def launches(c: collections.Counter) -> int:
    """The ops of c that launch a kernel (allocations and wrapped scalars left out)."""
    return sum(n for op, n in c.items() if op not in NO_LAUNCH)


#: The ops whose plans a model makes as for a CUDA device (`set_plan(op, device="cuda")`): the mixers', the
#: window branches' (decode step and ring fill), the softmax layers' and the decoder's fused elementwise ops.
CUDA_PLANS = ("sse", "hla", "window", "softmax", "fused", "spla")


def build_model(family: str, dtype: torch.dtype = torch.float32):
    from subquadratic.families.hla.configuration import HLAConfig
    from subquadratic.families.hla.modeling import HLAForCausalLM
    from subquadratic.families.spla.configuration import SPLAConfig
    from subquadratic.families.spla.modeling import SPLAForCausalLM
    from subquadratic.families.sse.configuration import SSEConfig
    from subquadratic.families.sse.modeling import SSEForCausalLM

    torch.manual_seed(0)
    if family == "hla":
        model = HLAForCausalLM(HLAConfig(**SHAPE, hla_chunk_size=16))
    elif family == "sse":
        model = SSEForCausalLM(SSEConfig(**SHAPE, sse_chunk_size=16))
    else:
        model = SPLAForCausalLM(SPLAConfig(**SHAPE, block_size=16, top_k_blocks=2, num_sink_blocks=1,
                                           num_local_blocks=1))
    with torch.no_grad():  # a trained-looking model: nonzero gamma, LoRA offsets, gates
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.normal_(0.0, 0.02)
    return model.to(dtype).eval()


def count_model(family: str, T: int = 64, cuda: bool = True,
                dtype: torch.dtype = torch.float32) -> dict[str, collections.Counter]:
    """{"forward": ops, "forward+grad": ops, "backward": ops} of one mixer layer at B = 1, T tokens;
    `cuda`: every op planned as for a CUDA device (`CUDA_PLANS`)."""
    model = build_model(family, dtype)
    if cuda:
        for op in CUDA_PLANS:  # their plans as for a CUDA device
            model.set_plan(op, device="cuda")
    mixer = model.model.layers[0].self_attn
    ids = torch.randint(0, SHAPE["vocab_size"], (1, T))
    with torch.no_grad():  # a first call builds the projections' pack and stacks: not what a call costs
        model(ids, use_cache=True, logits_to_keep=1)
    out = {}
    for name, grad in (("forward", False), ("forward+grad", True)):
        counter = OpCounter()
        counter.active = False
        stack = contextlib.ExitStack()
        stack.enter_context(counter.triton_launches())
        pre = mixer.register_forward_pre_hook(lambda *_, c=counter: setattr(c, "active", True))
        post = mixer.register_forward_hook(lambda *_, c=counter: setattr(c, "active", False))
        try:
            with torch.set_grad_enabled(grad), counter:
                logits = model(ids, use_cache=not grad, logits_to_keep=1).logits
        finally:
            pre.remove()
            post.remove()
            stack.close()
        out[name] = counter.counts
        if grad:
            counter = OpCounter()
            with counter, counter.triton_launches():
                logits.float().sum().backward()
            out["backward (whole layer)"] = counter.counts
    return out


def count_triton(family: str, T: int = 64) -> dict[str, collections.Counter]:
    """{"forward": ops, "forward+grad": ops, "backward": ops} of the CUDA wrapper on CPU tensors."""
    torch.manual_seed(0)
    B, HQ, H, D = 1, SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
    dt = torch.float32

    def inputs():
        if family == "hla":
            from subquadratic.kernels.hla import hla_triton

            q, k, v = (torch.randn(B, T, HQ, D, dtype=dt) * 0.3 for _ in range(3))
            la = -torch.rand(B, T, HQ) * 0.1
            return (q, k, v, la), lambda *a: hla_triton(*a, chunk_size=16)[0]
        if family == "sse":
            from subquadratic.kernels.sse import router_topk
            from subquadratic.kernels.sse.triton_sse import sse_triton

            N = 4
            q1, k1, q2, k2, v = (torch.randn(B, T, HQ, D, dtype=dt) * 0.3 for _ in range(5))
            g1, g2 = (-torch.rand(B, T, HQ, D) * 0.1 for _ in range(2))
            probs, sel = router_topk(torch.randn(B, T, N), 2)
            return (q1, k1, q2, k2, v, g1, g2, probs), lambda *a: sse_triton(*a, sel, chunk_size=16, topk=2)[0]
        from subquadratic.kernels.spla import BlockStats, SPLAParams
        from subquadratic.kernels.spla.plan import plan_spla
        from subquadratic.kernels.spla.triton_parallel import spla_parallel_triton

        params = SPLAParams(block_size=16, top_k_blocks=2, num_sink_blocks=1, num_local_blocks=1)
        q = torch.randn(B, T, HQ, D, dtype=dt)
        k, v = torch.randn(B, T, H, D, dtype=dt), torch.randn(B, T, H, D, dtype=dt)
        pos = torch.arange(T)[None].expand(B, T)
        koff = torch.zeros(B, dtype=torch.int32)

        def call(q, k, v):
            stats = BlockStats.empty(B, H, D, q.device, torch.float32, num_blocks=T // 16).add_(k, pos, 16)
            sbar = torch.zeros(B, H, D, D)
            grad = torch.is_grad_enabled()
            plan = plan_spla(q.shape, k.shape, q.dtype, torch.device("cuda"), params, backend="triton", grad=grad)
            o_sp, o_rla, _ = spla_parallel_triton(q, k, v, pos, pos, stats, sbar, koff, params, plan)
            return o_sp + o_rla

        return (q, k, v), call

    out = {}
    for name, grad in (("forward", False), ("forward+grad", True)):
        args, fn = inputs()
        if grad:
            for a in args:
                a.requires_grad_(a.is_floating_point())
        counter = OpCounter()
        with torch.set_grad_enabled(grad), counter, counter.triton_launches():
            o = fn(*args)
        out[name] = counter.counts
        if grad:
            counter = OpCounter()
            with counter, counter.triton_launches():
                o.sum().backward()
            out["backward"] = counter.counts
    return out


def report(title: str, counts: dict[str, collections.Counter], top: int) -> None:
    """One line per count: ops (all non-view), launches (no allocations), host syncs, the top ops."""
    for name, c in counts.items():
        ops = ", ".join(f"{op.split('.')[0]} x{n}" for op, n in c.most_common(top))
        syncs = c["_local_scalar_dense.default"]
        print(f"{title:16s} {name:24s} ops {sum(c.values()):4d} launches {launches(c):4d} syncs {syncs:2d}  {ops}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=FAMILIES, action="append", help="default: all")
    ap.add_argument("--top", type=int, default=10, help="ops listed per row")
    ap.add_argument("--no-triton", action="store_true", help="skip the Triton wrappers")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="the model's dtype")
    ap.add_argument("--cpu-paths", action="store_true", help="count the model on its CPU paths (PyTorch forms)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    for fam in args.family or FAMILIES:
        report(f"{fam} model", count_model(fam, cuda=not args.cpu_paths, dtype=dtype), args.top)
        if not args.no_triton:
            report(f"{fam} triton", count_triton(fam), args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
