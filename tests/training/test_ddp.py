"""Plain DistributedDataParallel (find_unused_parameters=False: no graph walk per step) trains every
family: two CPU processes over gloo (127.0.0.1), one torchrun launch
(tests/training/ddp_worker.py) training in turn SPLA inside its budget
(where the residual gain takes part only through an exact zero), SPLA beyond it, SSE-H (SSE layers
with a softmax layer, the router's load-balance loss on) and an HLA hybrid. Without a gradient for
every parameter on every rank, DDP's reducer fails at the second step. The two ranks end with the
same weights; where the loss is a mean over equal halves (no batch-level router loss: SPLA, HLA)
they follow one process on the whole batch."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from subquadratic import SPLAConfig
from tests.processes import clean_env, run_child
from tests.training.ddp_worker import CASES, T, model_and_data, train

ROOT = Path(__file__).parents[2]


def test_two_processes_train_every_family_with_plain_ddp(tmp_path):
    # --standalone: torchrun's own store on a port it binds itself; a fresh environment; 300 s for two
    # cold PyTorch imports on a shared machine, after which the ranks are stopped and the test fails
    r = run_child([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "-m", "tests.training.ddp_worker", tmp_path], timeout=300, cwd=str(ROOT),
                  env=clean_env(OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]  # the reducer's unused-parameter error, if any
    assert SPLAConfig(**CASES["spla-inside-budget"][2]).budget_tokens >= T
    assert SPLAConfig(**CASES["spla-sparse"][2]).budget_tokens < T
    for case, (*_, same_as_one_process) in CASES.items():
        ranks = [torch.load(tmp_path / f"{case}-rank{r}.pt") for r in range(2)]
        fresh, _ = model_and_data(case)
        moved = 0.0
        for name, p in fresh.state_dict().items():
            torch.testing.assert_close(ranks[1][name], ranks[0][name], rtol=0, atol=0, msg=f"{case} {name}")
            moved = max(moved, (ranks[0][name] - p).abs().max().item())
        assert moved > 1e-3, f"{case} did not train"
        if same_as_one_process:  # one process, the whole batch: the same mean gradient
            model, ids = model_and_data(case)
            train(model, ids, slice(None))
            for name, p in model.state_dict().items():
                torch.testing.assert_close(ranks[0][name], p, rtol=1e-4, atol=1e-5, msg=f"{case} {name}")
