"""``python -m harness``: Hydra's entry point. What a run, a sweep and their exit codes
are is harness/app/cli.py (its docstring) and docs/errors.md.

Only the decorated ``main`` lives here: Hydra finds conf/ relative to the file that
defines it, and a launcher's worker (joblib) imports it by this name."""

from __future__ import annotations

import sys

# The project's packages, missing outside its environment (issue #54): say how to run it.
_DEPENDENCIES = {"hydra", "omegaconf", "torch", "numpy", "transformers", "gguf", "yaml"}

try:
    import hydra
    from omegaconf import DictConfig

    from harness.app import cli as app
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in _DEPENDENCIES:
        raise
    print(f"kvbench: this Python ({sys.executable}) lacks the project's packages "
          f"({e.name} is not installed). Run it as\n"
          "  scripts/run.sh backend=paged workload=multiturn   (sets up .venv on first use)\n"
          "or, once set up:\n"
          "  .venv/bin/python -m harness backend=paged workload=multiturn", file=sys.stderr)
    sys.exit(2)
except KeyboardInterrupt:
    print("\nkvbench: stopped by SIGINT (Ctrl-C) while starting; nothing was run",
          file=sys.stderr)
    sys.exit(130)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    app.main(cfg)


if __name__ == "__main__":
    app.cli(main)
