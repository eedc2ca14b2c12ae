"""kvbench: a benchmark-and-evaluation harness for LLM KV-cache management.

The core (allocator, scheduler) imports without torch; the engine, model and backends
need it. ``harness.run(cfg)`` is the programmatic entry point (see harness.runner).
"""

__version__ = "0.1.0"
