"""What the GPU check measures, and how long each part may take: one profile for the H200,
one for the CPU dry run (the same sections at tiny sizes).

Budgets are seconds of wall time per section; the GPU profile's add up to under 7.5
minutes, within the 10 one device call allows the whole script (the install before it
takes ~15 s), leaving a session's 15 minutes of device time room for a rerun of what
failed (``--only``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Size = tuple[int, int]  # (batch, context)


@dataclass(frozen=True, slots=True)
class Geometry:
    """Attention head geometry of the kernel sections; dtype by name ("bfloat16")."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str


@dataclass(frozen=True, slots=True)
class EngineShape:
    """One model shape for the engine sections: its Hydra overrides and KV budget, and
    the labels of :data:`ENGINE_BACKENDS` it runs (None: all of them)."""

    name: str
    overrides: tuple[str, ...]
    kv_budget: str
    backends: tuple[str, ...] | None = None


# Label, overrides. `flex` last: its compilation is the slowest start.
ENGINE_BACKENDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("paged", ("backend=paged",)),
    ("contiguous", ("backend=contiguous",)),
    ("fp8", ("backend=fp8",)),
    ("int8", ("backend=int8",)),
    ("sliding_window", ("backend=sliding_window",)),
    ("h2o", ("backend=h2o",)),
    ("paged-torch", ("backend=paged", "backend.kernel=torch")),
    # The same backends with every step eager: what the decode graphs buy (issue #50).
    ("paged-eager", ("backend=paged", "engine.cuda_graphs=off")),
    ("fp8-eager", ("backend=fp8", "engine.cuda_graphs=off")),
    ("flex", ("backend=flex",)),
)


# The compression section's rows (issue #56): every compression method beside paged and
# contiguous, at its defaults but quest's budget (64 tokens, the target case).
COMPRESSION_BACKENDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("paged", ("backend=paged",)),
    ("contiguous", ("backend=contiguous",)),
    ("quest-64", ("backend=quest", "backend.token_budget=64")),
    ("kivi-2bit", ("backend=kivi", "backend.bits=2")),
    ("h2o", ("backend=h2o",)),
    ("tova", ("backend=tova",)),
    ("snapkv", ("backend=snapkv",)),
    ("knorm", ("backend=knorm",)),
    ("keydiff", ("backend=keydiff",)),
    ("observed_attention", ("backend=observed_attention",)),
    ("expected_attention", ("backend=expected_attention",)),
)


@dataclass(frozen=True, slots=True)
class CompressionPlan:
    """The ``compression`` section: every row of :data:`COMPRESSION_BACKENDS` at one model
    (``model``: its overrides) under one KV budget, once per context: ``requests[i]``
    requests of ``contexts[i]`` tokens (prompt + ``output_tokens``) at once, after a
    warm-up of the same requests with ``warmup_output`` tokens. Kernel rows: one decode
    step of each method's kernel at ``timing_sizes`` (batch, context), the token-evicting
    methods holding ``held_share`` of the context."""

    model: tuple[str, ...]
    kv_budget: str
    contexts: tuple[int, ...]
    requests: tuple[int, ...]
    output_tokens: int
    warmup_output: int
    common: tuple[str, ...]
    timing_sizes: tuple[Size, ...]
    held_share: float = 0.2


def fixed_lengths(requests: int, prompt: int, output: int) -> tuple[str, ...]:
    """Overrides for the `random` workload with every request the same size, all at once."""
    return uniform_lengths(requests, (prompt, prompt), (output, output))


def uniform_lengths(requests: int, prompt: tuple[int, int],
                    output: tuple[int, int]) -> tuple[str, ...]:
    """Overrides for the `random` workload: every request at once, prompt and output
    lengths uniform in the given (min, max)."""
    return ("workload=random", f"workload.num_requests={requests}",
            "workload.distribution=uniform", f"workload.input_min={prompt[0]}",
            f"workload.input_max={prompt[1]}", f"workload.output_min={output[0]}",
            f"workload.output_max={output[1]}", "workload.rate=0")


@dataclass(frozen=True, slots=True)
class Profile:
    """Everything size- or time-dependent in the check.

    grid: (batch, context) pairs for kernel correctness (decode, prefill, store);
    quant_sizes: sizes where fp8 / int8 caches and the window are checked too;
    timing_sizes: sizes for decode timings and bandwidth; copy_bytes: the copy that
    measures the device's bandwidth; warmup_ms / rep_ms: do_bench's (CUDA) or, on the CPU,
    repetitions = max(1, rep_ms // 50).
    """

    name: str
    device: str
    triton_interpret: bool
    geometry: Geometry
    grid: tuple[Size, ...]
    quant_sizes: tuple[Size, ...]
    prefill_chunk: int
    timing_sizes: tuple[Size, ...]
    copy_bytes: int
    warmup_ms: int
    rep_ms: int
    shapes: tuple[EngineShape, ...]
    workload: tuple[str, ...]
    warmup_workload: tuple[str, ...]
    engine_common: tuple[str, ...]
    min_backend_s: float
    bench_args: tuple[str, ...]
    budgets: dict[str, float] = field(default_factory=dict)
    total_s: float = 445.0
    compression: CompressionPlan | None = None
    # Sections run only when named (--only): too long for the default call's budget.
    on_request: tuple[str, ...] = ()

    def budget(self, section: str) -> float:
        return self.budgets.get(section, 30.0)


GPU = Profile(
    name="gpu",
    device="cuda",
    triton_interpret=False,
    geometry=Geometry(32, 8, 128, 16, "bfloat16"),  # Llama-3-8B
    grid=tuple((b, c) for b in (1, 8, 32) for c in (1000, 8191, 32768)),
    quant_sizes=((8, 8191),),
    prefill_chunk=256,
    timing_sizes=tuple(sorted(((b, c) for b in (1, 4, 16, 64)
                               for c in (4096, 8192, 16384, 32768)),
                              key=lambda s: (s[0] * s[1], s))),
    copy_bytes=2 << 30,
    warmup_ms=10,
    rep_ms=40,
    shapes=(
        EngineShape("smollm2", ("model=random_smollm2",), "1GiB"),
        EngineShape("llama8b", ("model=random_llama8b",), "4GiB"),
    ),
    workload=fixed_lengths(32, 256, 64),
    # The measured batch and prompts, 8 output tokens: the same kernel variants (split-K
    # decode: default_splits depends on the batch and the context) for a fraction of a run.
    warmup_workload=fixed_lengths(32, 256, 8),
    engine_common=("device=cuda", "scheduler.max_model_len=1024"),
    min_backend_s=4.0,
    # pytest-benchmark writes its JSON only at the end: short rounds, to finish in budget.
    bench_args=("--benchmark-max-time=0.1", "--benchmark-min-rounds=3"),
    # Seconds. From the first H200 run (2026-12-04, results/gpu/2026-12-04-run1): env 4,
    # kernel checks 17 / 12, engines 50 / 65 with flex (a compile) cut short, roofline 79,
    # gpu tests 62, benchmarks 18.
    budgets={"env": 15, "kernel-correctness": 30, "kernel-bandwidth": 30, "engine-smollm2": 70,
             "engine-llama8b": 90, "roofline-h200": 95, "gpu-tests": 70, "benchmarks": 25,
             "flash-attn": 20, "compression": 400},
    total_s=445.0,
    # Llama-3.1-8B (random weights, bf16) under 6 GiB of KV (48k tokens at 128 KiB each;
    # the what-if of these runs: paged 12 of the 16 at 4k at once and 2 of the 3 at 32k,
    # every method that frees memory all of them; 4 GiB held no 32k request of quest, its
    # bounds beside it, nor of the prompt-time methods, the watermark beside it). Its own call
    # (`scripts/gpu_check.sh "$OUT" --only compression`, < 7 min): 11 rows x 2 contexts,
    # each a warm-up and a measured run, do not fit beside the default sections.
    compression=CompressionPlan(
        model=("model=random_llama8b",), kv_budget="6GiB", contexts=(4096, 32768),
        requests=(16, 3), output_tokens=64, warmup_output=2,
        common=("device=cuda",), timing_sizes=((16, 4096), (4, 32768))),
    on_request=("compression",),
)

DRY = Profile(
    name="dry",
    device="cpu",
    triton_interpret=True,
    geometry=Geometry(4, 2, 16, 8, "float32"),
    grid=((1, 9), (3, 20)),
    quant_sizes=((2, 11),),
    prefill_chunk=5,
    timing_sizes=((2, 24),),
    copy_bytes=1 << 20,
    warmup_ms=0,
    rep_ms=50,
    shapes=(
        EngineShape("tiny", ("model=tiny",), "256KiB"),
        # Two backends suffice for the second shape: the code path is the first's.
        EngineShape("tiny-bias", ("model=tiny", "model.source=tiny-bias"), "256KiB",
                    ("paged", "contiguous")),
    ),
    workload=fixed_lengths(3, 12, 4),
    warmup_workload=fixed_lengths(1, 4, 2),
    engine_common=("device=cpu", "scheduler.max_model_len=256"),
    min_backend_s=0.5,
    bench_args=("--benchmark-max-time=0.0005", "--benchmark-min-rounds=1",
                "--benchmark-warmup=off", "-k", "kernels"),
    budgets={"env": 20, "gpu-tests": 40, "kernel-correctness": 40, "kernel-bandwidth": 30,
             "engine-tiny": 40, "engine-tiny-bias": 40, "roofline-h200": 30, "benchmarks": 40,
             "flash-attn": 20, "compression": 60},
    total_s=270.0,
    # 512 B a token: 320 KiB (kivi's 32 residual blocks of 16 take 256 of them) holds two
    # 256-token sequences for paged, all three for a method.
    compression=CompressionPlan(
        model=("model=tiny",), kv_budget="320KiB", contexts=(40, 256), requests=(3, 3),
        output_tokens=4, warmup_output=1, common=("device=cpu",), timing_sizes=((2, 48),)),
)

PROFILES = {"gpu": GPU, "dry": DRY}
