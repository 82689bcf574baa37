"""Benchmarks: `kernels/` (one op at a time) and `models/` (whole models: prefill, decode, training steps)."""
