"""The check the fused-kernel tests share: a model's logits and parameter gradients with a kernel
forced on equal those of its PyTorch form (on a GPU where there is one, else on the CPU under the
interpreter)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def perturb(model) -> None:
    """Move every weight away from its initial value (so that zero-initialised parts matter)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


def forced_kernel_matches(model, monkeypatch, gates: list, fn_owner, fn_name: str) -> int:
    """Run `model` on fixed ids with labels (forward and backward) as it is, then with each
    (module, name, predicate) of `gates` patched in (the kernel taken), or each callable of `gates`
    called with True before (False before the first run: a plan setting, `set_plan`), and
    `fn_owner.fn_name` counted; assert the logits and every parameter gradient agree. Returns the
    kernel's calls. The model moves to the GPU where there is one (the kernels need CUDA tensors
    without the interpreter)."""
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0)).to(model.device)
    results, calls, real = [], [], getattr(fn_owner, fn_name)
    for forced in (False, True):
        for gate in gates:
            if callable(gate):
                gate(forced)
            elif forced:
                monkeypatch.setattr(*gate)
        if forced:
            monkeypatch.setattr(fn_owner, fn_name, lambda *a: calls.append(1) or real(*a))
        model.zero_grad()
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        results.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                              if p.grad is not None}))
    (plain, plain_grads), (fused_logits, fused_grads) = results
    torch.testing.assert_close(fused_logits, plain, rtol=1e-5, atol=1e-5)
    assert plain_grads.keys() == fused_grads.keys()
    for n, g in plain_grads.items():
        torch.testing.assert_close(fused_grads[n], g, rtol=1e-4, atol=1e-5, msg=n)
    return len(calls)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius norms, fp64)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class CopyCounter(TorchDispatchMode):
    """Counts the clones (what .contiguous() of a strided tensor dispatches) inside it."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] == "clone":  # .contiguous() (the interpreter's own traffic is copy_)
            self.n += 1
        return func(*args, **(kwargs or {}))
