"""The ranks of tests/training/test_ddp.py: each trains every case of CASES under plain
DistributedDataParallel (find_unused_parameters=False) over gloo on its half of the batch and saves
its weights to FOLDER/<case>-rank<r>.pt. Run by torchrun (its own rendezvous, a port bound by the
store itself), so nothing of the pytest process (its environment, its threads, its ports) reaches it."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

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


def main(folder: str) -> None:
    """One rank of `torchrun --standalone --nproc_per_node 2 -m tests.training.ddp_worker FOLDER`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a lost peer fails a collective, not hangs
    rank = dist.get_rank()
    wrapped = []  # every DDP wrapper stays alive to the end (see below)
    for case in CASES:
        model, ids = model_and_data(case)
        wrapped.append(torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False))
        half = ROWS // 2
        train(wrapped[-1], ids, slice(rank * half, (rank + 1) * half))
        torch.save(model.state_dict(), f"{folder}/{case}-rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    # No Python teardown of the process group: freeing the last DDP reducer drops the last reference to
    # ProcessGroupGloo, whose destructor joins its worker thread while holding the GIL, and that thread
    # may still be freeing the last all-reduce (a Python object, which needs the GIL): a deadlock that a
    # busy machine makes likely. The weights are saved; the process ends without destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
