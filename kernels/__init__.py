"""Triton token-mixing ops (one folder per op: naive reference, chunked Triton kernels, decode step)."""
