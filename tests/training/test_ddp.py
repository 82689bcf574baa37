"""Plain DistributedDataParallel (find_unused_parameters=False: no graph walk per step) trains every
family: two CPU processes over gloo (127.0.0.1), one spawn training in turn SPLA inside its budget
(where the residual gain takes part only through an exact zero), SPLA beyond it, SSE-H (SSE layers
with a softmax layer, the router's load-balance loss on) and an HLA hybrid. Without a gradient for
every parameter on every rank, DDP's reducer fails at the second step. The two ranks end with the
same weights; where the loss is a mean over equal halves (no batch-level router loss: SPLA, HLA)
they follow one process on the whole batch."""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from subquadratic import HLAConfig, HLAForCausalLM, SPLAConfig, SPLAForCausalLM, SSEConfig, SSEForCausalLM

STEPS, ROWS, T = 3, 4, 16  # ROWS split over two processes
_SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0)
CASES = {
    # name: (config class, model class, fields, whether one process on the whole batch computes the same step)
    "spla-inside-budget": (SPLAConfig, SPLAForCausalLM, dict(_SMALL, block_size=8, top_k_blocks=4), True),
    "spla-sparse": (SPLAConfig, SPLAForCausalLM, dict(_SMALL, block_size=4, top_k_blocks=2, num_local_blocks=1),
                    True),
    "sse-h": (SSEConfig, SSEForCausalLM, dict(_SMALL, num_hidden_layers=3, sse_chunk_size=8, sse_gate_rank=8,
                                              mixer_types=["sse", "full_attention", "sse"]), False),
    "hla-hybrid": (HLAConfig, HLAForCausalLM, dict(_SMALL, num_hidden_layers=3, hla_chunk_size=8,
                                                   mixer_types=["hla", "full_attention", "hla"]), True),
}


def model_and_data(case: str):
    cfg_cls, model_cls, fields, _ = CASES[case]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**fields)).train()
    ids = torch.randint(1, 96, (STEPS, ROWS, T), generator=torch.Generator().manual_seed(1))
    return model, ids


def train(model, ids, rows: slice) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        x = ids[step, rows]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _worker(rank: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for case in CASES:
            model, ids = model_and_data(case)
            ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
            half = ROWS // 2
            train(ddp, ids, slice(rank * half, (rank + 1) * half))
            torch.save(model.state_dict(), f"{folder}/{case}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_every_family_with_plain_ddp(tmp_path):
    procs = mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 300  # two cold PyTorch imports on a shared machine
    try:
        while not procs.join(timeout=1):  # raises if a process failed (the reducer's unused-parameter error)
            assert time.monotonic() < deadline, "the two DDP processes did not finish within 300 s"
    finally:
        for proc in procs.processes:
            if proc.is_alive():
                proc.kill()
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
