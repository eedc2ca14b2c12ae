"""KV backends (installed as ``harness.backends``)."""
