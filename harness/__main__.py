"""``python -m harness``: a thin Hydra entry point around :func:`harness.runner.run`."""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from harness.config import register_configs

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from harness.runner import print_summary, run

    with open_dict(cfg):
        cfg.out_dir = HydraConfig.get().runtime.output_dir
    result = run(cfg)
    print_summary(result.metrics, result.out_dir)


if __name__ == "__main__":
    main()
