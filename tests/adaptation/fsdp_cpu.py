"""`python -m subquadratic` with accelerate's FSDP path taken on CPU processes (for the two-process
test; run under torchrun with ACCELERATE_USE_CPU=1 and the FSDP_* variables `accelerate launch`
sets from a configuration file, see `fsdp_env`).

accelerate turns an FSDP configuration on only for GPU (and other accelerator) processes; on CPU it
runs data-parallel. This launcher sets the FSDP plugin (read from the FSDP_* variables) on the accelerator state
after it is made, so
that `accelerator.prepare` shards the model through `fully_shard` over gloo exactly as it would on
GPUs (auto-wrap from `_no_split_modules`, full state dict gathered for saving), and writes the class
names of the sharded modules to $FSDP_UNITS_FILE.<rank>."""

import json
import os

import accelerate
import torch.distributed.fsdp as fsdp
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

units = []
_fully_shard = fsdp.fully_shard


def recording_fully_shard(module, *args, **kwargs):
    for m in module if isinstance(module, list) else [module]:
        units.append(type(m).__name__)
    return _fully_shard(module, *args, **kwargs)


def fsdp_env(config_file: str) -> dict[str, str]:
    """The FSDP_* variables `accelerate launch --config_file config_file` gives its processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", config_file, "x.py"]))
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith("FSDP_")}


class CPUFSDPAccelerator(accelerate.Accelerator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables
        self.state.distributed_type = DistributedType.FSDP
        accelerate.PartialState().distributed_type = DistributedType.FSDP


if __name__ == "__main__":
    fsdp.fully_shard = recording_fully_shard
    accelerate.Accelerator = CPUFSDPAccelerator
    from subquadratic.cli import main

    try:
        main()
    finally:
        with open(f"{os.environ['FSDP_UNITS_FILE']}.{os.environ.get('RANK', '0')}", "w") as f:
            json.dump(units, f)
