"""Sequences, the scheduler and the per-step record (pure Python, no torch)."""
