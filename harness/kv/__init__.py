"""Block pool, KV managers and the reservation ledger (pure Python, no torch)."""
