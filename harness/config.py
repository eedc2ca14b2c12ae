"""Typed run configuration: dataclasses registered in Hydra's ConfigStore.

Every YAML file under conf/ extends one of these schemas, so a typo in a key fails when
the config is composed, not halfway through a run. Groups mirror the plugin axes. A
plugin's options have one home: the backend's ``Options`` dataclass (backends/<name>.py)
and the workload's config dataclass (harness/workloads/<name>.py); their schemas are
registered here from the two registries, under ``schema/<group>/<name>`` (out of the
option lists: ``backend=`` offers conf/backend/*.yaml only).

A run converts the composed config once into a :class:`RunConfig` (``run_config``) and
passes it down typed; ``__post_init__`` checks of every dataclass run there, before
anything is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.backends import BACKENDS
from harness.backends.base import BackendOptions
from harness.cluster.config import ClusterConfig
from harness.errors import UserError
from harness.kv.eviction import ADMISSIONS, EVICTIONS
from harness.metrics.goodput import SLOConfig, check_slo
from harness.quality_config import QualityConfig
from harness.roofline.config import RooflineConfig
from harness.sched.scheduler import SchedulerConfig
from harness.sched.spec import SCHEDULER_SIZES, SchedulerSpec
from harness.units import parse_bytes
from harness.validate import finite_floats, one_of
from harness.workloads import WORKLOADS, WorkloadOptions


@dataclass
class ModelSpec:
    # smollm2 | gguf | hf | a tiny preset (tiny, tiny-bias, ...) | a random-weight shape
    # (random-smollm2, random-llama8b: harness.model.random_shapes)
    source: str = "smollm2"
    path: str | None = None  # a .gguf file or an HF folder; overrides source when set
    dtype: str = "float32"


def check_sizes(obj: object, group: str, keys: tuple[str, ...], example: str) -> None:
    """Each of ``keys`` of ``obj`` is a size in bytes (``parse_bytes``), not negative."""
    for key in keys:
        value = getattr(obj, key)
        try:
            if parse_bytes(value) < 0:
                raise ValueError
        except ValueError:
            raise UserError(f"{group}.{key}={value!r} is not a size in bytes (e.g. "
                            f"{example})") from None


@dataclass
class TierSpec:
    """``cache.tiers``: lower tiers of the prefix cache below the device (harness.kv.tiers).
    Named blocks leaving the device's LRU go down to host memory (``cpu`` bytes), and from
    there to disk (``disk`` bytes); a prompt's lookup that misses on the device loads what
    it finds there instead of recomputing it. Sizes are bytes of the backend's own blocks
    (a 1-byte cache holds twice the tokens of a 2-byte one in the same bytes)."""

    cpu: str = "0"  # host memory for the CPU tier (0: no tiers)
    disk: str = "0"  # disk below it (0: none); needs a CPU tier
    # When a block goes down: "evict" (as it leaves the device's LRU: vLLM's CPU offloading
    # on eviction) or "through" (as soon as its K/V are computed: LMCache's store on write).
    write: str = "evict"
    # executor=roofline: whether transfers overlap the step's compute (the step takes the
    # longer of the two: an asynchronous copy stream, layer-wise loading) or add to it
    # (a synchronous copy before the forward, which is what the model executor does).
    overlap: bool = False
    # The links (executor=roofline; the model executor measures its own copies). 0: the
    # hardware spec's host_bw (~50 GB/s one way on H100: vLLM's KV offloading blog,
    # 2026-01-08). Latency is per transfer: one step's blocks in one direction. Disk: one
    # datacenter NVMe drive (Samsung PM9A3, PCIe 4: 6.5 GB/s sequential read; Samsung's
    # PM983 datasheet: 85 us typical random read latency).
    cpu_bw_gbs: float = 0.0
    cpu_latency_us: float = 10.0
    disk_bw_gbs: float = 6.5
    disk_latency_us: float = 85.0
    # executor=model: the folder the disk tier's files go in (a fresh subfolder per run,
    # removed at its end; default: the system's temp folder). Not kept across runs.
    disk_dir: str | None = None
    # Each tier's eviction order (harness/kv/eviction.py's, over the tier's slots: which
    # block spills or falls out first); None: cache.eviction's.
    cpu_policy: str | None = None  # lru | fifo | lfu | slru | arc | cost
    disk_policy: str | None = None

    def __post_init__(self) -> None:
        from harness.kv.tiers import WRITE_MODES

        check_sizes(self, "cache.tiers", ("cpu", "disk"), "4GiB, 0 for none")
        if parse_bytes(self.disk) and not parse_bytes(self.cpu):
            raise UserError("cache.tiers.disk needs a CPU tier above it (blocks reach the "
                            "disk from host memory): set cache.tiers.cpu as well")
        if self.write not in WRITE_MODES:
            raise UserError(f"cache.tiers.write must be one of {', '.join(WRITE_MODES)}, got "
                            f"{self.write!r}")
        for key in ("cpu_bw_gbs", "cpu_latency_us", "disk_bw_gbs", "disk_latency_us"):
            if getattr(self, key) < 0:
                raise UserError(f"cache.tiers.{key} must be >= 0, got {getattr(self, key)}")
        if self.disk_bw_gbs == 0 and parse_bytes(self.disk):
            raise UserError("cache.tiers.disk_bw_gbs must be > 0 with a disk tier")
        for key in ("cpu_policy", "disk_policy"):
            if getattr(self, key) is not None:
                one_of(self, "cache.tiers", key, EVICTIONS)

    def policies(self, eviction: str) -> list[str]:
        """Each tier's eviction order, host first (``eviction``: cache.eviction, the
        default), for the tiers this spec asks for."""
        tiers = ("cpu", "disk") if parse_bytes(self.disk) else ("cpu",)
        return [getattr(self, f"{t}_policy") or eviction for t in tiers]

    def custom_policies(self, eviction: str) -> list[str]:
        """The ``<tier>_policy`` options set to other than ``eviction`` (their default),
        as ``key=value``."""
        return [f"cache.tiers.{k}={getattr(self, k)}" for k in ("cpu_policy", "disk_policy")
                if getattr(self, k) not in (None, eviction)]

    @property
    def enabled(self) -> bool:
        return parse_bytes(self.cpu) > 0


@dataclass
class CacheSpec:
    # Bytes of K/V on the device, the same for every backend; auto (executor=roofline):
    # memory x utilization - weights - activation reserve of the hardware spec.
    kv_budget: str = "256MiB"
    swap_space: str = "0"  # bytes of CPU swap blocks (paged backends, preemption_mode=swap)
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # share of the cache kept free at admission (at least a block)
    tiers: TierSpec = field(default_factory=TierSpec)  # host and disk below the device
    # A model whose layers differ in attention (harness.layer_types), under both executors:
    # "grouped", one KV cache group per attention type over one pool (a sliding layer
    # holds its window; harness.kv.groups), or "uniform", every layer holding every token
    # (the sliding layers still attend only to their window): what a cache without groups
    # reserves. Ignored for a model whose layers all attend alike.
    kv_groups: str = "grouped"
    # Which cached block (ref 0, named) goes first when the pool needs room, and whether a
    # finished block is cached at all (harness/kv/eviction.py): prefix caching only.
    eviction: str = "lru"  # lru | fifo | lfu | slru | arc | cost
    admission: str = "always"  # always | second_hit | tinylfu

    def without_tiers(self) -> CacheSpec:
        """This cache with no lower tiers (the quality evaluation's stacks: their streamed
        texts share no prefixes, and a second host tier would double the run's memory)."""
        return dataclasses.replace(self, tiers=TierSpec())

    def __post_init__(self) -> None:
        if not 0.0 <= self.watermark < 1.0:
            raise UserError(f"cache.watermark is a share of the cache in [0, 1), got "
                            f"{self.watermark}")
        one_of(self, "cache", "kv_groups", ("grouped", "uniform"))
        one_of(self, "cache", "eviction", EVICTIONS)
        one_of(self, "cache", "admission", ADMISSIONS)
        if not self.enable_prefix_caching and (self.eviction, self.admission) != (
                "lru", "always"):
            raise UserError(f"cache.eviction={self.eviction} / cache.admission="
                            f"{self.admission} choose among cached prefix blocks: they need "
                            "cache.enable_prefix_caching=true (or leave them at lru / always)")
        check_sizes(self, "cache", ("swap_space",) if self.kv_budget == "auto" else
                    ("kv_budget", "swap_space"), "64MiB, 1GiB, 1000000")
        self._check_tier_policies()

    def _check_tier_policies(self) -> None:
        """A tier's eviction order set where that tier cannot be is refused, as
        cache.eviction is without prefix caching."""
        custom = self.tiers.custom_policies(self.eviction)
        if not custom:
            return
        t = self.tiers
        if not self.enable_prefix_caching:
            raise UserError(f"{' / '.join(custom)} choose among a lower tier's cached prefix "
                            "blocks: they need cache.enable_prefix_caching=true and "
                            "cache.tiers (or leave them unset)")
        if not t.enabled:
            raise UserError(f"{' / '.join(custom)} choose which block a lower tier gives up, "
                            "but there are no tiers (cache.tiers.cpu=0): set cache.tiers.cpu "
                            "(e.g. 4GiB), or leave them unset")
        if t.disk_policy not in (None, self.eviction) and not parse_bytes(t.disk):
            raise UserError(f"cache.tiers.disk_policy={t.disk_policy} chooses which block the "
                            "disk tier gives up, but there is none (cache.tiers.disk=0): set "
                            "cache.tiers.disk (e.g. 16GiB), or leave it unset")


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


RECORD_FORMATS = ("csv", "parquet")


CUDA_GRAPHS = ("auto", "off", "on")


@dataclass
class EngineSpec:
    """How the model executor runs a step (``engine.*``)."""

    # Decode steps replayed from CUDA graphs captured per batch bucket at start-up
    # (harness.engine.graphs): auto = on with CUDA where the backend is graph-safe and
    # nothing counts per-step touches (KVBENCH_CHECK); on = the same, refused without
    # CUDA or with a backend that is not graph-safe; off = every step eager. The run
    # records what it did in run.cuda_graphs.
    cuda_graphs: str = "auto"

    def __post_init__(self) -> None:
        one_of(self, "engine", "cuda_graphs", CUDA_GRAPHS)


@dataclass
class RecordsSpec:
    """How a run writes its per-step and per-request records (``records.*``)."""

    # csv: steps.csv and requests.csv; parquet: steps.parquet and requests.parquet
    # (columnar, compressed, what pandas.read_parquet reads; needs pyarrow, the [parquet]
    # extra). Written a chunk at a time either way, never as one string in memory.
    format: str = "csv"
    # Keep each request's output ids (RunResult.outputs, requests' output_ids column).
    # false: not kept, and the column is left out: a million requests' outputs are GBs
    # (under executor=roofline they are synthetic ids anyway). Quality scoring needs them.
    # None (the default): true under executor=model, false under executor=roofline
    # (RunConfig resolves it; a 1M-row trace kept 7 GB of synthetic ids, issue #54).
    output_ids: bool | None = None

    @property
    def keep_output_ids(self) -> bool:
        """``output_ids`` as the run resolved it (:class:`RunConfig`)."""
        assert self.output_ids is not None, "resolved by RunConfig.__post_init__"
        return self.output_ids

    def __post_init__(self) -> None:
        one_of(self, "records", "format", RECORD_FORMATS)


@dataclass
class RunConfig:
    # Any + MISSING: each option of the group brings its own schema (the plugin's options).
    backend: Any = MISSING
    workload: Any = MISSING
    model: ModelSpec = field(default_factory=ModelSpec)
    # A SchedulerSpec until its unset sizes are resolved: at once under executor=model (here),
    # by the roofline target under executor=roofline (the engine's sizes need the model,
    # the backend's bytes per token and the workload's lengths).
    scheduler: SchedulerConfig = field(default_factory=SchedulerSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    logger: LoggerSpec = field(default_factory=LoggerSpec)
    quality: QualityConfig = field(default_factory=QualityConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)  # goodput targets (metrics.goodput)
    records: RecordsSpec = field(default_factory=RecordsSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
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
    # model: the real forward on the wall clock; roofline: no weights, the step time
    # modelled from roofline.model on roofline.hardware, on a virtual clock.
    executor: str = "model"
    roofline: RooflineConfig = field(default_factory=RooflineConfig)
    # Replicas behind a router (harness.cluster): 1 is a plain run.
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # The same configuration ``repeats`` times, for speed figures with intervals
    # (harness/repeats.py): a run folder then holds repeat-0/ .. repeat-<N-1>/ and their
    # summary; a sweep interleaves the repeats across its configurations. ``repeat`` (which
    # one this is) and ``repeat_of`` (the sweep's configuration index) are set by kvbench.
    repeats: int = 1
    repeat: int = 0
    repeat_of: int | None = None

    def __post_init__(self) -> None:
        if self.executor not in ("model", "roofline"):
            raise UserError(f"executor must be model or roofline, got {self.executor!r}")
        if self.cpu_threads < 0:
            raise UserError(f"cpu_threads must be >= 0 (0: torch's default), got "
                            f"{self.cpu_threads}")
        if self.repeats < 1:
            raise UserError(f"repeats must be >= 1 (the runs of one configuration), got "
                            f"{self.repeats}")
        if not 0 <= self.repeat < self.repeats:
            raise UserError(f"repeat={self.repeat} is set by kvbench (0 .. repeats-1); "
                            "leave it out and give repeats=N")
        if self.records.output_ids is None:
            self.records.output_ids = self.executor == "model"
        if isinstance(self.scheduler, SchedulerSpec) and self.executor == "model":
            self.scheduler = self.scheduler.resolved()
        if not self.records.output_ids and self.executor != "roofline":
            raise UserError("records.output_ids=false drops the outputs a model made, which "
                            "its quality and task scores read: it is for executor=roofline "
                            "runs (synthetic outputs); drop it")
        if self.repeats > 1 and self.executor == "roofline":
            raise UserError(f"repeats={self.repeats} with executor=roofline: a roofline run "
                            "is deterministic (the same configuration gives the same numbers "
                            "every time), so repeats measure nothing; drop repeats. Its "
                            "uncertainty is the step model's error against real GPUs, not noise")
        if self.cache.tiers.overlap and self.executor == "model":
            raise UserError("cache.tiers.overlap=true is a what-if option (executor=roofline): "
                            "the model executor copies tier blocks before the forward and "
                            "measures that; drop cache.tiers.overlap")
        if not 0 <= self.seed < 2**63:
            raise UserError(f"seed must be in [0, 2^63), got {self.seed}")
        check_slo(self.slo, self.quality.enabled, self.quality.generation_agreement)
        self.cluster.check_executor(self.executor)


# Keys a run resolves when the config leaves them unset (null), and config.yaml holds
# resolved: the scheduler's sizes (kvbench's under executor=model, the modelled engine's
# under executor=roofline) and records.output_ids (true under model, false under roofline).
RESOLVED_AT_RUN = (*(f"scheduler.{k}" for k in SCHEDULER_SIZES), "records.output_ids")


def as_recorded(config: dict[str, Any]) -> dict[str, Any]:
    """A composed config (a plain container) with the unset values a run resolves from it
    alone, as its config.yaml will hold them: executor=model's scheduler sizes and
    records.output_ids. A what-if's sizes stay null: they are the engine's (they need the
    model, the backend and the workload; harness.roofline.sizes)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    model = out.get("executor", "model") == "model"
    sched, records = out.get("scheduler"), out.get("records")
    if isinstance(records, dict) and records.get("output_ids") is None:
        records["output_ids"] = model
    if isinstance(sched, dict) and model:
        for k, v in SCHEDULER_SIZES.items():
            if sched.get(k) is None:
                sched[k] = v
    return out


def run_config(cfg: DictConfig | dict[str, Any] | RunConfig) -> RunConfig:
    """The composed config as typed dataclasses (checked by their ``__post_init__``).

    A plain dict (tests) is completed with the registered schemas of its backend and
    workload, so the same defaults apply however a run is started."""
    if isinstance(cfg, RunConfig):
        return cfg
    if isinstance(cfg, dict):
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), _typed_groups(cfg))
        return run_config(merged)  # type: ignore[arg-type]
    refuse_unknown_keys(cfg)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise UserError(f"bad configuration: {e}") from None
    if isinstance(obj, dict):  # composed without the run schema (a test's bare dict)
        return run_config({str(k): v for k, v in obj.items()})
    assert isinstance(obj, RunConfig)
    if not isinstance(obj.backend, BackendOptions):
        obj.backend = _backend_options(obj.backend)
    if not isinstance(obj.workload, WorkloadOptions):
        obj.workload = _workload_options(obj.workload)
    finite_floats(obj)
    refuse_ignored(obj)
    return obj


# --- keys no run reads (issue #54) ----------------------------------------------------------
# A key the schema does not know (``+backend.blocksize=32``, the fix Hydra suggests for a
# typo, or ``++backend.budget_ratio=0.2`` on paged) used to be carried along and never read,
# and the run went on with the default. A schema key the chosen backend or workload declares
# it ignores (``ignored_options`` on its class: contiguous storage has no blocks), set away
# from its default, was the same silent no-op. Both are refused where the config is typed,
# so a sweep's job check (harness/app/hydra_callbacks.py) refuses them before any job runs.

def _option_owner(group: str, node: Any) -> str:
    """How a message names the option a key belongs to: ``backend=paged``, ``cache.tiers``,
    ``the run config``."""
    name = node.get("name") if isinstance(node, Mapping | DictConfig) else None
    if group in ("backend", "workload", "logger") and name:
        return f"{group}={name}"
    return group or "the run config"


def unknown_key_message(group: str, owner: str, key: str, known: list[str]) -> str:
    """``<group>.<key> is not an option of <owner>; did you mean <group>.<close>? Known:
    ...``, and for a backend or workload key, which others take it."""
    prefix = f"{group}." if group else ""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean {prefix}{close[0]}?" if close else "."
    takers: list[str] = []
    if group == "backend":
        takers = [n for n, b in BACKENDS.items()
                  if key in {f.name for f in dataclasses.fields(b.Options)}]
    elif group == "workload":
        takers = [n for n, (c, _) in WORKLOADS.items()
                  if key in {f.name for f in dataclasses.fields(c)}]
    elsewhere = f" ({group}={', '.join(takers)} take it)" if takers else ""
    return (f"{prefix}{key} is not an option of {owner}{hint} Known: {', '.join(known)}"
            f"{elsewhere}. kvbench refuses a key no run would read (it would run with the "
            "default): fix or drop it")


def _schema_fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name != "name"]


def _unknown_keys(node: DictConfig, path: str) -> Iterator[str]:
    """Messages for the keys of ``node`` (and of the nodes below it) that its schema (a
    dataclass) lacks; a node without a schema (a dict field) is only descended."""
    cls = OmegaConf.get_type(node)
    known = set(_schema_fields(cls)) | {"name"} if dataclasses.is_dataclass(cls) else None
    for key in node:
        k = str(key)
        if not path and k == "hydra":  # Hydra's own, when composed with it
            continue
        if known is not None and k not in known:
            assert isinstance(cls, type)
            yield unknown_key_message(path, _option_owner(path, node), k, _schema_fields(cls))
            continue
        child = node._get_node(k)
        if (isinstance(child, DictConfig) and not child._is_missing() and not child._is_none()
                and not child._is_interpolation()):
            yield from _unknown_keys(child, f"{path}.{k}" if path else k)


def refuse_unknown_keys(cfg: DictConfig) -> None:
    """UserError naming every key of the composed config that no schema has (set with
    ``+`` / ``++``), with the known keys and the closest one."""
    found = list(_unknown_keys(cfg, ""))
    if found:
        raise UserError("\n".join(found))


def _default(cls: type, key: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[key]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING


def ignored_message(group: str, opts: Any, ignored: Mapping[str, str]) -> str | None:
    """The refusal of ``opts``'s keys in ``ignored`` ({key: why}) set away from their
    defaults (None: none is)."""
    cls = type(opts)
    keys = {f.name for f in dataclasses.fields(cls)}
    set_ = [k for k in ignored if k in keys and getattr(opts, k) != _default(cls, k)]
    if not set_:
        return None
    what = ", ".join(f"{group}.{k}={getattr(opts, k)}" for k in set_)
    why = ignored[set_[0]] if len(set_) == 1 else "; ".join(f"{k}: {ignored[k]}" for k in set_)
    return (f"{what}: ignored by {group}={opts.name} ({why}); kvbench refuses an option the "
            f"run would not read: drop {'it' if len(set_) == 1 else 'them'}")


def refuse_ignored(rc: RunConfig) -> None:
    """UserError for a backend or workload option its class declares it ignores
    (``ignored_options``), set away from its default by the user or a preset."""
    from harness.backends import BACKENDS as backends

    found = []
    if (b := backends.get(rc.backend.name)) is not None:
        found.append(ignored_message("backend", rc.backend, b.ignored_options))
    if (w := WORKLOADS.get(rc.workload.name)) is not None:
        found.append(ignored_message("workload", rc.workload,
                                     getattr(w[1], "ignored_options", {})))
    if msgs := [m for m in found if m]:
        raise UserError("\n".join(msgs))


def _typed_groups(cfg: dict[str, Any]) -> dict[str, Any]:
    out = dict(cfg)
    for key, make in (("backend", _backend_options), ("workload", _workload_options)):
        if isinstance(out.get(key), dict):
            out[key] = OmegaConf.structured(make(out[key]))
    return out


def _backend_options(values: Any) -> BackendOptions:
    from harness.backends import get_backend

    values = dict(values)
    name = str(values.get("name", ""))
    cls = get_backend(name).Options
    if unknown := [unknown_key_message("backend", f"backend={name}", k, _schema_fields(cls))
                   for k in values if k not in {f.name for f in dataclasses.fields(cls)}]:
        raise UserError("\n".join(unknown))
    opts: BackendOptions = cls(**values)
    return opts


def _workload_options(values: Any) -> WorkloadOptions:
    from harness.workloads import workload_options

    values = dict(values)
    return workload_options(str(values.get("name", "")), values)


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(overrides: list[str]) -> DictConfig:
    """conf/config.yaml composed with ``overrides``, as ``python -m harness`` composes it
    (no Hydra run folder, no job callbacks): for the harness's own runs of configs."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def register_configs() -> None:
    """Put the schemas where conf/*.yaml's defaults lists look for them: each plugin's
    from its registry, the rest from this module."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for name, backend in BACKENDS.items():
        cs.store(group="schema/backend", name=name, node=backend.Options(name=name))
    for name, (config_cls, _) in WORKLOADS.items():
        cs.store(group="schema/workload", name=name, node=config_cls(name=name))
    cs.store(group="schema/model", name="model", node=ModelSpec)
    cs.store(group="schema/scheduler", name="scheduler", node=SchedulerSpec)
    cs.store(group="schema/cache", name="cache", node=CacheSpec)
    cs.store(group="schema/slo", name="slo", node=SLOConfig)
    cs.store(group="schema/logger", name="none", node=LoggerSpec)
    cs.store(group="schema/logger", name="wandb", node=WandbLoggerSpec)
    if not OmegaConf.has_resolver("kvbench_job"):  # hydra.sweep.subdir, with repeats
        from harness.repeats import job_number, repeat_tail

        OmegaConf.register_new_resolver("kvbench_job", job_number)
        OmegaConf.register_new_resolver("kvbench_repeat", repeat_tail)
