"""Model benchmarks: prefill, decode and training steps of converted models against the dense source."""
