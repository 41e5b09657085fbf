"""Benchmarks run by `make bench`: every non-private module here with `NAME` and `run() -> dict` is one."""
