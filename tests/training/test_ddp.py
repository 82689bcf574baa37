"""Plain DistributedDataParallel (find_unused_parameters=False: no graph walk per step) trains a tiny
SPLA model on inputs inside its budget, where the residual gain takes part only through an exact
zero: two CPU processes over gloo (127.0.0.1) follow one process on the whole batch."""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from subquadratic import SPLAConfig, SPLAForCausalLM

STEPS, ROWS, T = 3, 4, 16  # ROWS split over two processes; T inside the budget of 4 blocks of 8
CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, block_size=8, top_k_blocks=4, pad_token_id=0)


def model_and_data():
    torch.manual_seed(0)
    model = SPLAForCausalLM(SPLAConfig(**CONFIG)).train()
    assert model.config.budget_tokens >= T
    ids = torch.randint(1, 96, (STEPS, ROWS, T), generator=torch.Generator().manual_seed(1))
    return model, ids


def train(model, ids, rows: slice) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        x = ids[step, rows]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model, ids = model_and_data()
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
        half = ROWS // 2
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        for step in range(STEPS):
            x = ids[step, rank * half:(rank + 1) * half]
            ddp(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if rank == 0:
            torch.save(model.state_dict(), out)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_spla_inside_its_budget_with_plain_ddp(tmp_path):
    out = str(tmp_path / "rank0.pt")
    procs = mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    try:
        while not procs.join(timeout=1):  # raises if a process failed
            assert time.monotonic() < deadline, "the two DDP processes did not finish within 120 s"
    finally:
        for proc in procs.processes:
            if proc.is_alive():
                proc.kill()
    model, ids = model_and_data()
    train(model, ids, slice(None))  # one process, the whole batch: the same mean gradient
    got = torch.load(out)
    moved = 0.0
    fresh, _ = model_and_data()
    for name, p in model.state_dict().items():
        torch.testing.assert_close(got[name], p, rtol=1e-4, atol=1e-5, msg=name)
        moved = max(moved, (p - fresh.state_dict()[name]).abs().max().item())
    assert moved > 1e-3  # it trained
