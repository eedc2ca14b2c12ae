"""The Ray launcher preset (conf/hydra/launcher/ray_cluster.yaml) on a local Ray instance: a small
roofline sweep, each run a Ray task. Skipped unless the `ray` extra is installed
(`pip install -e '.[ray]'`: hydra-ray-launcher 1.2.2 and ray < 3, not in the dev set-up)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")
pytest.importorskip("hydra_plugins.hydra_ray_launcher",
                    reason="hydra-ray-launcher is not installed: pip install -e '.[ray]'")


@pytest.mark.slow
def test_roofline_sweep_through_local_ray(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local instance
    p = subprocess.run(
        [sys.executable, "-m", "harness", "-m", "hydra/launcher=ray_cluster",
         "hydra.launcher.ray.remote.num_gpus=0", "hydra.launcher.ray.remote.num_cpus=1",
         "+hydra.launcher.ray.init.num_cpus=2", "executor=roofline", "cache.kv_budget=auto",
         "workload=random", "workload.num_requests=8", "backend=paged,fp8",
         f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], env=env,
        timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = sorted(m.parent.name for m in tmp_path.rglob("metrics.json"))
    assert runs == ["0-paged-random", "1-fp8-random"]
