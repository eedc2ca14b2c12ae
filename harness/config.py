"""Typed run configuration: dataclasses registered in Hydra's ConfigStore.

Every YAML file under conf/ extends one of these schemas, so a typo in a key fails when
the config is composed, not halfway through a run. Groups mirror the plugin axes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from harness.quality import QualityConfig
from harness.workloads.long_prompt import LongPromptConfig
from harness.workloads.multiturn import MultiturnConfig
from harness.workloads.random_lengths import RandomConfig
from harness.workloads.sampling import SamplingWorkloadConfig
from harness.workloads.shared_prefix import SharedPrefixConfig


@dataclass
class BackendConfig:
    name: str = "paged"
    block_size: int = 16  # paged backends; ignored by contiguous


@dataclass
class PagedConfig(BackendConfig):
    name: str = "paged"
    kernel: str = "auto"  # auto | torch | triton


@dataclass
class ContiguousConfig(BackendConfig):
    name: str = "contiguous"
    reserve: str = "max"  # max | pow2 | exact


@dataclass
class QuantizedConfig(PagedConfig):
    name: str = "int8"
    sink_tokens: int = 0  # first tokens of each sequence also kept in full precision


@dataclass
class SlidingWindowConfig(PagedConfig):
    name: str = "sliding_window"
    window: int = 256
    sink_tokens: int = 4


@dataclass
class H2OConfig(BackendConfig):
    name: str = "h2o"
    budget: int = 0  # tokens per sequence; or
    budget_ratio: float = 0.0  # share of prompt + max_tokens (set exactly one)
    heavy_ratio: float = 0.5  # heavy hitters' share of the budget; the rest is recent


@dataclass
class FlashAttnConfig(BackendConfig):
    name: str = "flash_attn"
    block_size: int = 256  # flash-attn 2's paged kernels need a multiple of 256


@dataclass
class FlexConfig(BackendConfig):
    name: str = "flex"


@dataclass
class ModelSpec:
    source: str = "smollm2"  # smollm2 | gguf | hf | a tiny preset (tiny, tiny-bias, ...)
    path: str | None = None  # a .gguf file or an HF folder; overrides source when set
    dtype: str = "float32"


@dataclass
class SchedulerSpec:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # recompute | swap
    policy: str = "fcfs"  # fcfs | priority
    max_model_len: int = 2048


@dataclass
class CacheSpec:
    kv_budget: str = "256MiB"  # bytes of K/V on the device, the same for every backend
    swap_space: str = "0"  # bytes of CPU swap blocks (paged backends, preemption_mode=swap)
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # share of blocks kept free at admission


@dataclass
class LoggerSpec:
    name: str = "none"


class WandbMode(Enum):
    offline = "offline"  # files under the run's folder, uploaded later with `wandb sync`
    online = "online"  # needs an account (WANDB_API_KEY or `wandb login`) and the network
    disabled = "disabled"  # nothing written, nothing sent


@dataclass
class WandbLoggerSpec(LoggerSpec):
    name: str = "wandb"
    mode: WandbMode = WandbMode.offline
    project: str = "kvbench"
    entity: str | None = None  # None: the account's default entity
    group: str | None = None  # None: the sweep folder's name in a multirun, else no group
    job_type: str = "benchmark"
    tags: list[str] = field(default_factory=list)  # added to backend:..., workload:..., ...
    dir: str | None = None  # None: the run's results folder (W&B adds wandb/ below it)


@dataclass
class WorkloadSpec:
    name: str = "multiturn"


@dataclass
class MultiturnSpec(WorkloadSpec, MultiturnConfig):
    name: str = "multiturn"


@dataclass
class SharedPrefixSpec(WorkloadSpec, SharedPrefixConfig):
    name: str = "shared_prefix"


@dataclass
class BeamSearchSpec(WorkloadSpec, SamplingWorkloadConfig):
    name: str = "beam_search"


@dataclass
class ParallelSamplingSpec(WorkloadSpec, SamplingWorkloadConfig):
    name: str = "parallel_sampling"


@dataclass
class LongPromptSpec(WorkloadSpec, LongPromptConfig):
    name: str = "long_prompt"


@dataclass
class RandomSpec(WorkloadSpec, RandomConfig):
    name: str = "random"


@dataclass
class RunConfig:
    # Any + MISSING: each option of the group brings its own schema (paged, contiguous...).
    backend: Any = MISSING
    workload: Any = MISSING
    model: ModelSpec = field(default_factory=ModelSpec)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    logger: LoggerSpec = field(default_factory=LoggerSpec)
    quality: QualityConfig = field(default_factory=QualityConfig)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # torch's intra-op threads on CPU (0 = torch's default). 1 by default: on a shared
    # 2-core machine two OpenMP threads fighting another process made a small GEMM 25x
    # slower (M=8: 0.65 ms with 1 thread, 16.6 ms with 2 under load).
    cpu_threads: int = 1
    results_dir: str = "results"
    run_name: str | None = None
    progress: bool = True  # a progress bar when stdout is a terminal
    out_dir: str | None = None  # set by the CLI (Hydra's output dir) or by tests


def register_configs() -> None:
    """Put the schemas where conf/*.yaml's defaults lists look for them."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="backend", name="paged_schema", node=PagedConfig)
    cs.store(group="backend", name="contiguous_schema", node=ContiguousConfig)
    cs.store(group="backend", name="quantized_schema", node=QuantizedConfig)
    cs.store(group="backend", name="sliding_window_schema", node=SlidingWindowConfig)
    cs.store(group="backend", name="h2o_schema", node=H2OConfig)
    cs.store(group="backend", name="flash_attn_schema", node=FlashAttnConfig)
    cs.store(group="backend", name="flex_schema", node=FlexConfig)
    for spec in (MultiturnSpec, SharedPrefixSpec, BeamSearchSpec, ParallelSamplingSpec,
                 LongPromptSpec, RandomSpec):
        cs.store(group="workload", name=f"{spec.name}_schema", node=spec)
    cs.store(group="model", name="model_schema", node=ModelSpec)
    cs.store(group="scheduler", name="scheduler_schema", node=SchedulerSpec)
    cs.store(group="cache", name="cache_schema", node=CacheSpec)
    cs.store(group="logger", name="logger_schema", node=LoggerSpec)
    cs.store(group="logger", name="wandb_schema", node=WandbLoggerSpec)
