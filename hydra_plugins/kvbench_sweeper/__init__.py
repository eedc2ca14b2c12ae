"""kvbench's Hydra plugins (Hydra loads plugins only from the ``hydra_plugins`` namespace):
the sweeper of ``python -m harness -m`` (sweeper.py)."""
