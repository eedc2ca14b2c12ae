"""Assemble one serving stack (backend + KV manager + scheduler + engine) for a model.

The run builds one for its workload; quality evaluation builds more on the same model
(the backend under test on the evaluation texts, and the exact reference).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from harness import layer_types
from harness.backends import BACKENDS, get_backend
from harness.backends.base import BackendOptions, CacheSizing, KVBackend, KVLayout, LayerSlot
from harness.backends.costs import GroupedCosts
from harness.backends.tier_storage import TierStorage, check_room
from harness.engine.engine import Engine
from harness.engine.executor import Executor
from harness.engine.sampler import TokenSampler
from harness.errors import UserError
from harness.kv.base import KVManager
from harness.kv.evicting import WindowKVManager
from harness.kv.groups import (
    GroupedKVManager,
    KVGroup,
    assign_layers,
    describe_groups,
    plan_groups,
)
from harness.kv.paged import PagedKVManager
from harness.kv.policies.window import WindowPolicy
from harness.kv.tiers import LowerTiers
from harness.layer_types import LayerAttention
from harness.metrics.collector import MetricsCollector
from harness.model import LoadedModel
from harness.sched.scheduler import Scheduler, SchedulerConfig, SchedulerFactory
from harness.sizing import min_budget_for, size_cache
from harness.units import format_bytes, parse_bytes
from harness.workloads.base import RequestShape

if TYPE_CHECKING:  # harness.config imports quality, which builds stacks
    from harness.config import CacheSpec


@dataclass
class Stack:
    backend: KVBackend
    sizing: CacheSizing
    kv: KVManager
    scheduler: Scheduler
    collector: MetricsCollector
    engine: Engine
    prefix_caching: bool
    tiers: LowerTiers | None = None  # the prefix cache's host and disk tiers, if on


def model_layout(loaded: LoadedModel) -> KVLayout:
    mc = loaded.config
    return KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                    next(loaded.model.parameters()).dtype,
                    tuple(loaded.model.rope.inv_freq.tolist()))


def make_backend(opts: BackendOptions, layout: KVLayout, device: torch.device) -> KVBackend:
    """The backend ``opts`` names, built from its typed options."""
    cls = get_backend(opts.name)
    kwargs = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)
              if f.name != "name"}
    return cls(layout, device, **kwargs)


def build_stack(loaded: LoadedModel, device: torch.device, backend_opts: BackendOptions,
                cache: CacheSpec, sched: SchedulerConfig, sampler: TokenSampler,
                shapes: Iterable[RequestShape] | None = None, quiet: bool = False,
                kv_budget: str | int | None = None) -> Stack:
    """One serving stack for ``backend_opts`` under the run's ``cache`` and ``sched``
    configs. With ``shapes`` (the requests', harness.workloads.base.request_shapes), fail
    early (and say which budget would do) when the budget cannot hold even the smallest
    of them. ``kv_budget`` overrides ``cache.kv_budget``
    (quality evaluation's reference). A hybrid-attention model gets its KV cache groups
    (or its uniform cache with per-layer windows: ``cache.kv_groups``) here, so every
    stack on it (the quality evaluation's too) attends as the model does."""
    backend = make_backend(backend_opts, model_layout(loaded), device)
    mc = loaded.config
    plan = None
    if mc.layer_attention and not layer_types.own_window(mc.layer_attention, backend_opts):
        check_model_groups(mc.name, mc.layer_attention, backend)
        plan = kv_plan(mc.name, mc.layer_attention, backend, cache.kv_groups)
    backend.calibrate(loaded.model, loaded.tokenizer)  # (duo_attention's heads)
    return assemble_stack(backend, device, cache, sched, sampler,
                          mc.max_position_embeddings, tuple(loaded.tokenizer.eos_ids),
                          model=loaded, shapes=shapes, quiet=quiet, kv_budget=kv_budget,
                          groups=plan)


def check_model_groups(name: str, layers: tuple[LayerAttention, ...],
                       backend: KVBackend) -> None:
    """What the real engine runs of a hybrid-attention model: sliding and full layers, on
    a backend that attends per layer (:attr:`KVBackend.supports_groups`)."""
    if any(a.kind == "chunked" for a in layers):
        raise UserError(f"{name} has chunked-attention layers ({layer_types.describe(layers)})"
                        ": the real engine does not mask chunks yet; its memory runs in the "
                        "what-if (executor=roofline roofline.model=<its config.json>)")
    if not backend.supports_groups:
        raise UserError(
            f"{name} mixes attention types per layer ({layer_types.describe(layers)}): "
            f"backend {backend.name} cannot attend per layer (a sliding layer's window, "
            f"its KV cache group's tables); the backends that can: {group_backends()}")


def group_backends() -> str:
    """The backends that run a hybrid-attention model (for the messages that refuse one)."""
    return ", ".join(n for n, cls in BACKENDS.items() if cls.supports_groups)


def kv_plan(name: str, layers: tuple[LayerAttention, ...], backend: KVBackend,
            mode: str) -> list[KVGroup] | None:
    """How a hybrid model's cache is laid out (``cache.kv_groups``): its KV cache groups
    (``grouped``), or None for one uniform cache in which every layer holds every token
    (``uniform``). Either way the backend's costs are declared per layer type
    (:class:`~harness.backends.costs.GroupedCosts`) and each layer attends through its
    :class:`~harness.backends.base.LayerSlot` (its group, storage tensor and window).
    The run's label of the layout is :func:`kv_plan_label`'s."""
    per_layer = backend.per_layer_bytes()
    if per_layer is None:
        sinks = getattr(backend, "sink_tokens", 0)
        fix = ("set backend.sink_tokens=0 (its full-precision sinks are per sequence, not "
               "per layer)" if backend.name in ("fp8", "int8") and sinks else
               f"use one of: {group_backends()}")
        raise UserError(
            f"{name} mixes attention types per layer ({layer_types.describe(layers)}): "
            "its cache is laid out per layer type, which takes a backend whose bytes scale "
            f"with the layers; backend {backend.name} as configured is not one: {fix}")
    kinds = layer_types.groups(layers)
    if backend.full_group_policy() is not None and all(a.kind != "full" for a in layers):
        span = layers[0].span
        raise UserError(
            f"{name} has no full-attention layer ({layer_types.describe(layers)}): backend "
            f"{backend.name}'s window would apply to none of them and be ignored. Run it "
            f"with backend=paged (its own windows), or backend.window={span} "
            "backend.sink_tokens=0 (the model's own cache)")
    bs = backend.costs().block_size
    full = backend.layer_costs(per_layer)
    windows = [a.span if a.kind == "sliding" else 0 for a in layers]
    if mode == "uniform":
        if backend.full_group_policy() is not None:
            raise UserError(
                f"backend {backend.name} compresses a hybrid model's full layers only, "
                "which takes KV cache groups (one uniform cache cannot give back the full "
                "layers' blocks and keep the sliding layers' windows): use "
                "cache.kv_groups=grouped")
        backend.use_costs(GroupedCosts(kinds, per_layer, bs, per_layer * len(layers), full))
        backend.use_layer_slots(tuple(LayerSlot(0, i, w) for i, w in enumerate(windows)))
        return None
    plan, size = plan_groups(layers)
    backend.use_costs(GroupedCosts(kinds, per_layer, bs, per_layer * size, full))
    backend.use_layer_slots(tuple(LayerSlot(g, j, w) for (g, j), w in
                                  zip(assign_layers(layers, plan, size), windows)))
    return plan


def kv_plan_label(layers: tuple[LayerAttention, ...], kv: KVManager) -> str:
    """``run.kv_groups``: the groups a hybrid model's cache had (and what compressed its
    full groups, if anything), the model's own window (one window over every layer, run as
    ``backend=sliding_window`` with it), or its uniform layout."""
    if isinstance(kv, WindowKVManager) and len(set(layers)) == 1:
        return f"the model's own window: {layer_types.describe(layers)}, one cache"
    if isinstance(kv, GroupedKVManager):
        label = describe_groups(kv.plan, max(g.layers for g in kv.plan))
        p = kv.full_policy
        if isinstance(p, WindowPolicy) and any(g.attention.kind == "full" for g in kv.plan):
            label += (f"; the full groups windowed by the backend ({p.window} tokens + "
                      f"{p.sinks} sinks), the sliding ones keeping their own")
        elif p is not None:
            label += (f"; the full group's tokens chosen by {p.name}, the sliding groups "
                      "keeping their own window")
        return label
    return f"uniform: {layer_types.describe(layers)}, every layer holding every token"


def assemble_stack(backend: KVBackend, device: torch.device, cache: CacheSpec,
                   sched: SchedulerConfig, sampler: TokenSampler, max_position: int,
                   eos_ids: tuple[int, ...], model: LoadedModel | None = None,
                   executor: Executor | None = None,
                   shapes: Iterable[RequestShape] | None = None,
                   quiet: bool = False, kv_budget: str | int | None = None,
                   groups: list[KVGroup] | None = None,
                   make_scheduler: SchedulerFactory = Scheduler) -> Stack:
    """The stack around ``backend``: the model's forward (``model``), or ``executor``
    (the roofline's), which needs no cache tensors, so none are allocated; the KV
    manager, the scheduler and the backend's sizing are the same either way. ``groups``:
    KV cache groups of a hybrid-attention model (harness.kv.groups), its backend's costs
    and layer slots set already (:func:`kv_plan`). ``make_scheduler``: builds the
    scheduler from its config, the KV manager, the EOS ids and the swap manager (the
    roofline's fast path passes its choice, harness/roofline/fastpath)."""
    budget = cache.kv_budget if kv_budget is None else kv_budget
    if budget == "auto":
        raise UserError("cache.kv_budget=auto sizes the cache from a hardware spec: it needs "
                        "executor=roofline; give bytes (e.g. 256MiB) for executor=model")
    sizing = size_cache(backend, budget, cache.swap_space)
    if executor is None:  # a roofline run holds no K/V tensors: nothing to fit here
        # Before any per-block bookkeeping: a 1 TiB pool is 50M Python list entries.
        check_memory(device, sizing)
    max_model_len = min(sched.max_model_len, max_position)
    if backend.storage == "paged" and sizing.block_size > max_model_len and not quiet:
        print(f"kvbench: warning: backend.block_size={sizing.block_size} exceeds the longest "
              f"sequence (max_model_len={max_model_len}): every sequence takes a block it "
              f"cannot fill ({sizing.block_size - max_model_len}+ slots wasted each); lower "
              "backend.block_size", file=sys.stderr)
    prefix_caching = bool(cache.enable_prefix_caching and backend.supports_prefix_caching
                          and backend.storage == "paged"
                          and not (groups and backend.compressed_prefixes))
    if cache.enable_prefix_caching and not prefix_caching and not quiet \
            and backend.storage == "paged":
        why = ("caches compressed prefixes (harness.kv.compressed), which KV cache groups "
               "do not" if backend.supports_prefix_caching else
               "rewrites its blocks as it runs (each prompt is compressed anew)")
        print(f"kvbench: backend {backend.name} {why}: prefix caching is off for this run "
              "(run.prefix_caching=false)", file=sys.stderr)
    kv_opts: dict[str, Any] = ({"enable_prefix_caching": prefix_caching,
                                "watermark": cache.watermark}
                               if backend.storage == "paged" else
                               {"max_model_len": max_model_len, "watermark": cache.watermark,
                                "granule": sizing.block_size})
    tiers = make_tiers(cache, backend, sizing, prefix_caching, quiet)
    if tiers is not None:
        kv_opts["tiers"] = tiers
    # A budget below one block still gets a 1-block manager, only so that check_budget
    # can say which budget the workload needs.
    if groups:
        kv: KVManager = GroupedKVManager(max(1, sizing.num_blocks), sizing.block_size, groups,
                                         watermark=cache.watermark,
                                         max_chunk_tokens=sched.max_num_batched_tokens,
                                         enable_prefix_caching=prefix_caching,
                                         full_policy=backend.full_group_policy(),
                                         num_cpu_blocks=sizing.num_cpu_blocks, tiers=tiers)
    else:
        kv = backend.make_manager(dataclasses.replace(
            sizing, num_blocks=max(1, sizing.num_blocks),
            num_slots=max(sizing.block_size, sizing.num_slots)), **kv_opts)
    if (cache.eviction, cache.admission) != ("lru", "always"):
        if not prefix_caching or not isinstance(kv, PagedKVManager | GroupedKVManager):
            raise UserError(
                f"cache.eviction={cache.eviction} / cache.admission={cache.admission} choose "
                f"among cached prefix blocks, and backend {backend.name} runs without prefix "
                "caching (it rewrites or reserves its blocks): leave them at lru / always, "
                "or use a paged backend (paged, fp8, int8, quest, kivi, sliding_window)")
        kv.set_cache_policy(cache.eviction, cache.admission)
    swap = kv if sched.preemption_mode == "swap" and \
        isinstance(kv, PagedKVManager | GroupedKVManager) and kv.supports_swap else None
    scheduler = make_scheduler(dataclasses.replace(sched, max_model_len=max_model_len),
                               kv, eos_ids, swap)
    if sched.preemption_mode == "swap" and not (swap is not None and sizing.num_cpu_blocks):
        raise UserError(
            "scheduler.preemption_mode=swap needs CPU swap blocks and a backend that swaps: "
            "set cache.swap_space (e.g. 1GiB)" if swap is not None else
            f"scheduler.preemption_mode=swap: backend {backend.name} does not swap; use "
            f"scheduler.preemption_mode=recompute")
    if shapes is not None:
        check_budget(shapes, kv, backend, sizing, cache.watermark, quiet)
    if model is not None:  # RoPE for every position the scheduler admits, read without a sync
        model.model.reserve_positions(max_model_len)
        # The fused layer kernels go with the Triton attention (the run's kernel).
        model.model.use_fused_layers(backend.kernel == "triton")
    if executor is None:  # a roofline run holds no K/V tensors
        if tiers is not None:
            check_tier_space(cache, tiers, sizing, device)
        backend.allocate(sizing)
        if tiers is not None:
            blocks = backend.block_tensors()
            assert blocks is not None
            backend.tier_storage = TierStorage(blocks, [t.num_blocks for t in tiers.tiers],
                                               cache.tiers.disk_dir, tiers)
    collector = MetricsCollector(kv, scheduler, sizing.bytes_per_slot)
    engine = Engine(model.model if model is not None else None, backend, scheduler, sampler,
                    collector, device, executor)
    return Stack(backend, sizing, kv, scheduler, collector, engine, prefix_caching, tiers)


def make_tiers(cache: CacheSpec, backend: KVBackend, sizing: CacheSizing,
               prefix_caching: bool, quiet: bool) -> LowerTiers | None:
    """The lower tiers ``cache.tiers`` asks for, in blocks of this backend's bytes; None
    when none are asked for, or (said on stderr) when this run's cache cannot have them."""
    spec = cache.tiers
    if not spec.enabled:
        return None
    why = (None if prefix_caching and backend.block_tensors_supported()
           and not backend.compressed_prefixes else
           "prefix caching is off for this run" if not prefix_caching else
           f"backend {backend.name} caches compressed prefixes, not blocks by their tokens"
           if backend.compressed_prefixes else
           f"backend {backend.name} cannot move whole blocks")
    if why is not None:
        custom = spec.custom_policies(cache.eviction)
        if custom:  # (as cache.eviction is refused where a run has no prefix cache)
            raise UserError(f"{' / '.join(custom)} choose which block a lower tier gives up, "
                            f"but this run has no lower tiers ({why}): leave them unset")
        if not quiet:
            print(f"kvbench: cache.tiers: {why}, so the prefix cache has no lower tiers "
                  "(run.tiers=off)", file=sys.stderr)
        return None
    block_bytes = sizing.block_bytes
    nums = []
    for key in ("cpu", "disk"):
        size = parse_bytes(getattr(spec, key))
        if size and size < block_bytes:
            raise UserError(f"cache.tiers.{key}={getattr(spec, key)} holds no block: one "
                            f"block of backend {backend.name} is {format_bytes(block_bytes)} "
                            f"({sizing.block_size} tokens); give at least that")
        if size:
            nums.append(size // block_bytes)
    return LowerTiers(nums, sizing.block_size, spec.write, spec.policies(cache.eviction))


def check_budget(shapes: Iterable[RequestShape], kv: KVManager, backend: KVBackend,
                 sizing: CacheSizing, watermark: float, quiet: bool = False) -> None:
    """Fail at start, with a budget that fits every request, if no request can ever be
    admitted; warn (with the same suggestion) if some cannot. ``shapes``: (prompt tokens,
    max_tokens, n) per request."""
    count = Counter(shapes)  # a million-row trace has far fewer distinct shapes
    if not count:
        return
    need_of = {sh: kv.slots_needed(*sh) for sh in count}
    needs = list(need_of.values())
    # An admission must leave the watermark free (at least one block; see the managers).
    wm = kv.watermark_blocks * sizing.block_size if isinstance(kv, PagedKVManager) \
        else getattr(kv, "watermark_slots", 0)
    room = sizing.num_slots - wm
    too_big = sum(count[sh] for sh, n in need_of.items() if n > room)
    total = sum(count.values())
    if not too_big:
        return
    want = min_budget_for(backend, sizing, max(needs), watermark)
    fix = f"cache.kv_budget={want} ({format_bytes(want)})"
    holds = (f"cache.kv_budget={format_bytes(sizing.kv_budget_bytes)} holds "
             f"{sizing.num_slots} tokens for backend {backend.name}")
    if backend.reserved_bytes() and backend.reserved_why():
        holds += (f" (after {format_bytes(backend.reserved_bytes())} held outside them: "
                  f"{backend.reserved_why()}; fewer leave more room)")
    if too_big == total:
        raise UserError(f"{holds}, but the smallest request needs {min(needs)}: set {fix} "
                        f"or more to run this workload")
    if not quiet:
        print(f"kvbench: warning: {holds}; {too_big} of {total} requests need more "
              f"(up to {max(needs)}) and will be rejected: {fix} fits them all",
              file=sys.stderr)


def available_memory(device: torch.device) -> int | None:
    """Bytes free for the cache on ``device`` now (None when unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_tier_space(cache: CacheSpec, tiers: LowerTiers, sizing: CacheSizing,
                     device: torch.device) -> None:
    """The lower tiers fit where they go (executor=model): the CPU tier in host memory
    beside the device cache (the same memory on a CPU), the disk tier on its disk."""
    block = sizing.block_bytes
    host = tiers.tiers[0].num_blocks * block
    if device.type != "cuda":
        host += sizing.num_blocks * block + sizing.num_cpu_blocks * block
    free = available_memory(torch.device("cpu"))
    if free is not None and host > 0.9 * free:
        raise UserError(f"cache.tiers.cpu={cache.tiers.cpu} needs {format_bytes(host)} of host "
                        f"memory with the cache beside it, but only {format_bytes(free)} is "
                        "available: lower cache.tiers.cpu (or cache.kv_budget)")
    if len(tiers.tiers) > 1:
        check_room(cache.tiers.disk_dir, tiers.tiers[1].num_blocks, block, cache.tiers.disk)


def check_memory(device: torch.device, sizing: CacheSizing) -> None:
    """A budget the machine cannot hold is the user's mistake, said before allocating:
    1 TiB gave a raw allocator traceback, 32 GiB on a 24 GiB machine the OOM killer."""
    need = sizing.num_blocks * sizing.block_bytes
    host = sizing.num_cpu_blocks * sizing.block_bytes
    if device.type != "cuda":
        need, host = need + host, 0
    for where, dev, nbytes in ((str(device), device, need),
                               ("host (cache.swap_space)", torch.device("cpu"), host)):
        free = available_memory(dev) if nbytes else None
        if free is not None and nbytes > 0.9 * free:
            raise UserError(f"the KV cache needs {format_bytes(nbytes)} on {where} but only "
                            f"{format_bytes(free)} is available: lower cache.kv_budget "
                            f"(or cache.swap_space)")
