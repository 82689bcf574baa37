"""Helpers the scripts share: `bench` (kernel timing, SPLA plans), `models` (the model shapes and
builders of the model benchmarks), `profile` (torch.profiler tables), `fsdp` (the accelerate launch
lines and logs of the FSDP studies)."""
