"""Triton kernels and their torch references (installed as ``harness.kernels``)."""
