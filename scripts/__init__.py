"""Benchmarks, studies and tools of the project, run as modules from the repository root
(`python -m scripts.studies.real_quality ...`); scripts/README.md lists them."""
