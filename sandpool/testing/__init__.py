"""Helpers for sandpool's own test clusters and benchmarks; never used by the runtime."""
