"""Studies: the real-model protocol, replication, MQAR, the transfer probe, FSDP scaling (scripts/README.md)."""
