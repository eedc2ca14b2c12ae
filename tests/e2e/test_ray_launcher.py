"""The Ray launcher preset (conf/hydra/launcher/ray_cluster.yaml) on a local Ray instance: a small
roofline sweep, each run a Ray task. Skipped unless the `ray` extra is installed
(`pip install -e '.[ray]'`: hydra-ray-launcher 1.2.2 and ray < 3, not in the dev set-up)."""

from __future__ import annotations

import json
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
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], env=env,
        timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = sorted(m.parent.name for m in tmp_path.rglob("metrics.json"))
    assert runs == ["0-paged-random", "1-fp8-random"]


@pytest.mark.slow
def test_cluster_sweep_through_local_ray(tmp_path: Path) -> None:
    """A sweep of cluster what-ifs (harness.cluster): 3 replicas behind two routers, each
    run a Ray task holding its whole cluster."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.run(
        [sys.executable, "-m", "harness", "-m", "hydra/launcher=ray_cluster",
         "hydra.launcher.ray.remote.num_gpus=0", "hydra.launcher.ray.remote.num_cpus=1",
         "+hydra.launcher.ray.init.num_cpus=2", "executor=roofline", "cache.kv_budget=auto",
         "workload=multiturn", "workload.conversations=6", "workload.turns=3",
         "cluster.replicas=3", "cluster.router=round_robin,prefix_aware",
         f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], env=env,
        timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    found = {}
    for m in sorted(tmp_path.rglob("metrics.json")):
        metrics = json.loads(m.read_text())
        found[metrics["run.router"]] = metrics
    assert sorted(found) == ["prefix_aware", "round_robin"]
    for metrics in found.values():
        assert metrics["cluster.replicas"] == 3
        assert sum(metrics[f"replica.{i}.requests_routed"] for i in range(3)) == 18
