"""Kernel benchmarks: one op (SPLA, SSE, HLA, GLA, the window) against its reference, and host time per call."""
