"""The ``roofline`` config node (used when ``executor=roofline``) and the KV budget
``cache.kv_budget=auto`` gives."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import UserError
from harness.roofline.arch import ArchSpec
from harness.roofline.engines import PROFILES
from harness.roofline.hardware import ATTENTION, HardwareSpec
from harness.units import format_bytes, parse_bytes
from harness.validate import at_least, in_range, one_of

# Bytes per weight, scales included: MXFP4 (OCP microscaling) keeps one 8-bit E8M0 scale
# per 32 weights, NVFP4 one 8-bit E4M3 scale per 16 (and one fp32 per tensor: nothing a
# weight); int4 (AWQ / GPTQ) as 0.5, its group scales left out as before.
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "int8": 1.0,
                "int4": 0.5, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
FP4_WEIGHTS = ("mxfp4", "nvfp4")
COMPUTE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class RooflineConfig:
    model: str = "Llama-3.1-8B"  # a spec (harness.roofline.models) or a config.json path
    hardware: str = "h100-sxm"  # h100-sxm | h200 | a100-80gb | a100-40gb | l40s | b200 | cpu
    tp: int = 1  # tensor-parallel degree (devices)
    dtype: str = "bfloat16"  # activations and the cache (float32 | bfloat16 | float16)
    # bytes per weight: float32 bfloat16 float16 fp8 int8 int4 mxfp4 nvfp4
    weight_dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.9  # share of each device's memory the server may use
    # What that share is of: "total" (vLLM's gpu_memory_utilization: of the device's
    # memory, weights included) or "free" (TensorRT-LLM's kv_cache_free_gpu_mem_fraction:
    # of what the weights and the activation reserve leave).
    memory_utilization_of: str = "total"
    activation_reserve: str = "auto"  # per device, kept for activations (auto: the spec's)
    # How attention runs: the spec's (fused kernels on a GPU, the torch gather on the cpu
    # spec), or forced: "fused" | "gather" (harness.roofline.shape).
    attention: str = "spec"
    # The serving engine whose CPU time a step pays (harness.roofline.engines): auto
    # (kvbench on the cpu spec, vllm-0.6 on a GPU) | vllm-0.6 | vllm-v1 | sglang | trtllm
    # | kvbench (the hardware spec's own overheads).
    engine: str = "auto"
    # Whether requests come through the engine's HTTP server (its front end's time added
    # to each request's TTFT and end-to-end latency, the profile's request_s and
    # prompt_token_s) or offline (trtllm-bench, LLM.generate: none). Also picks vLLM V1's
    # default batch sizes (API server or LLM class).
    served: bool = True
    # A served run's API server as a serial stage (harness.metrics.api_server: one process
    # takes each request's input and each streamed token's output in turn, so a burst
    # queues there), where its seconds are set; false: the front end's delay alone.
    api_server: bool = True
    # Its seconds a request's input and a streamed token's output (null: the profile's;
    # none is fitted yet, docs/results/2026-12-05-whatif-api-server.md: measure yours).
    api_request_s: float | None = None
    api_token_s: float | None = None
    # true: the engine's own scheduling (the profile's mixing, chunked prefill, admission
    # and prefix caching: harness.roofline.engines) where the command line sets none;
    # false: kvbench's (the decode lanes stay on), only the batch sizes follow the engine.
    engine_scheduling: bool = False
    # The engine's CPU time overlapped with the forward (vLLM's --async-scheduling,
    # SGLang's overlap scheduler): true | false | null (the profile's default).
    async_scheduling: bool | None = None
    # Not modelled yet (issue #53's finding 9): each refused unless at its default, with
    # a message naming the missing feature. Speculative decoding (none | eagle3 | mtp |
    # ngram), expert parallelism's degree, SGLang's data-parallel attention.
    speculative: str = "none"
    expert_parallel: int = 1
    dp_attention: bool = False
    # The weight GEMMs' dtype: auto (the activations') or fp8 / int8 (W8A8 on the fp8 or
    # int8 units; needs weight_dtype of the same, as TensorRT-LLM's FP8 and SmoothQuant
    # checkpoints are; weight_dtype=int8 alone is weight-only, W8A16), or fp4 (W4A4 on
    # Blackwell's FP4 units, weight_dtype mxfp4 or nvfp4; elsewhere those weights run
    # weight-only). int8's share of its peak has no kernel profile yet: the spec's bf16
    # share (a prior); fp4's is the B200's NVFP4 kernel tables' (hardware.BLACKWELL_GEMM).
    compute_dtype: str = "auto"
    # Decode lanes (harness/roofline/fastpath): running decodes advanced as sums, touched only
    # when they take or fill a block, finish or are preempted; every number equals
    # stepping one by one (tests/roofline/test_lane.py). false: step every sequence one by one.
    fast_path: bool = True

    def __post_init__(self) -> None:
        at_least(self, "roofline", 1, "tp")
        one_of(self, "roofline", "dtype", COMPUTE)
        one_of(self, "roofline", "weight_dtype", WEIGHT_BYTES)
        one_of(self, "roofline", "compute_dtype", ("auto", "fp8", "int8", "fp4"))
        one_of(self, "roofline", "engine", ("auto", *PROFILES))
        self._refuse_unmodelled()
        c = self.compute_dtype
        if c == "fp4" and self.weight_dtype not in FP4_WEIGHTS:
            raise UserError("roofline.compute_dtype=fp4 multiplies FP4 weights on the FP4 "
                            "units: set roofline.weight_dtype=mxfp4 or nvfp4 (got "
                            f"{self.weight_dtype})")
        if c not in ("auto", "fp4") and self.weight_dtype != c:
            raise UserError(f"roofline.compute_dtype={c} multiplies {c} weights on the {c} "
                            f"units: set roofline.weight_dtype={c} (got {self.weight_dtype})")
        in_range(self, "roofline", "gpu_memory_utilization", 0.0, 1.0, lo_open=True)
        for name in ("api_request_s", "api_token_s"):
            if getattr(self, name) is not None:
                at_least(self, "roofline", 0.0, name)
        one_of(self, "roofline", "memory_utilization_of", ("total", "free"))
        one_of(self, "roofline", "attention", ("spec", *ATTENTION))

    def _refuse_unmodelled(self) -> None:
        if self.speculative != "none":
            raise UserError(f"roofline.speculative={self.speculative} is not modelled: the "
                            "what-if has no draft model or acceptance rate (EAGLE-3, MTP, "
                            "n-gram); leave roofline.speculative=none")
        if self.expert_parallel != 1:
            raise UserError(f"roofline.expert_parallel={self.expert_parallel} is not "
                            "modelled: experts are split with the rest by roofline.tp "
                            "(tensor parallelism) and no all-to-all is priced; leave it 1")
        if self.dp_attention:
            raise UserError("roofline.dp_attention=true is not modelled: SGLang's "
                            "data-parallel attention (one KV cache per DP rank, MLA's "
                            "latent not replicated) has no step model here; leave it false")

    def gemm_dtype(self) -> str:
        """The weight GEMMs' dtype for the step model."""
        return COMPUTE[self.dtype] if self.compute_dtype == "auto" else self.compute_dtype

    def reserve_bytes(self, hw: HardwareSpec) -> int:
        if self.activation_reserve == "auto":
            return hw.activation_reserve_bytes
        try:
            return parse_bytes(self.activation_reserve)
        except ValueError:
            raise UserError(f"roofline.activation_reserve={self.activation_reserve!r} is not "
                            "a size (e.g. 2GiB) or auto") from None


def weights_bytes(arch: ArchSpec, cfg: RooflineConfig) -> int:
    """The weights' bytes over the group: the linear layers at ``weight_dtype`` (the dense
    path at 16 bits where the checkpoint quantizes the experts alone:
    ``ArchSpec.experts_only_quant``); the embedding and lm_head at 16 bits where that is
    narrower (quantized checkpoints, FP8, INT8 and AWQ int4, keep them so)."""
    wb = WEIGHT_BYTES[cfg.weight_dtype]
    embed = arch.total_params() - arch.dense_params - arch.expert_params
    return int(arch.dense_params * arch.dense_weight_bytes(wb) + arch.expert_params * wb
               + embed * max(wb, 2.0))


def auto_kv_budget(arch: ArchSpec, hw: HardwareSpec, cfg: RooflineConfig) -> int:
    """``cache.kv_budget=auto``, as serving engines size it: memory x utilization minus
    the weights minus an activation reserve (vLLM), or utilization x (memory minus the
    weights minus the reserve) (``memory_utilization_of=free``: TensorRT-LLM's fraction
    of the free memory), per rank, over the tensor-parallel group, as
    distinct cache content: a cache split by KV head adds up over its shards, and a KV
    head replicated on ``tp / kv_heads`` ranks (MLA's latent: on every rank) is counted
    once (:meth:`ArchSpec.kv_shards`), so the tokens it holds are what the group holds."""
    arch.check_tp(cfg.tp)
    usable = hw.mem_bytes * cfg.gpu_memory_utilization
    reserve = cfg.reserve_bytes(hw)
    if reserve >= usable:
        raise UserError(f"roofline.activation_reserve={cfg.activation_reserve} "
                        f"is not below the usable memory of one "
                        f"{hw.name} ({format_bytes(int(usable))}: "
                        f"{format_bytes(hw.mem_bytes)} at gpu_memory_utilization "
                        f"{cfg.gpu_memory_utilization}): lower roofline.activation_reserve")
    w = weights_bytes(arch, cfg)
    if cfg.memory_utilization_of == "free":
        per_rank = cfg.gpu_memory_utilization * (hw.mem_bytes - reserve - w / cfg.tp)
    else:
        per_rank = usable - reserve - w / cfg.tp
    budget = arch.kv_shards(cfg.tp) * per_rank
    if budget <= 0:
        raise UserError(f"{arch.name}'s weights ({format_bytes(w)} in {cfg.weight_dtype}) "
                        f"leave no room for a KV cache on {cfg.tp} x {hw.name} "
                        f"({format_bytes(hw.mem_bytes)} each at utilization "
                        f"{cfg.gpu_memory_utilization}): raise roofline.tp or use a smaller "
                        "roofline.weight_dtype")
    return int(budget)
